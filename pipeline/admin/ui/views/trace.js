// Trace view: the span waterfall. Each span's bar spans its time in the trace; inside it,
// the share of that time on CPU (its own, then its children's in the same service) and
// the rest off-CPU (waiting); beside it the figures, the samples behind them and the
// method that placed them (exact / child / thread / window). Where in the span the CPU
// was burnt is not known from a profile, so the CPU is drawn as a share, from the left.
import {
  api, dur, esc, h, link, methodBadges, methodBadgesHtml, pct, rangeAround, rowKeys, size, when,
} from "../lib.js";

export async function render(root, args, params) {
  const tid = args[0] || "";
  const method = params.method || "exact";
  const got = await api(`traces/${encodeURIComponent(tid)}`, { method });
  const spans = got.spans;
  const byId = new Map(spans.map((s) => [s.span_id, s]));
  const kids = new Map();
  const roots = [];
  for (const s of spans) {
    if (s.parent_span_id && byId.has(s.parent_span_id) && s.parent_span_id !== s.span_id) {
      if (!kids.has(s.parent_span_id)) kids.set(s.parent_span_id, []);
      kids.get(s.parent_span_id).push(s);
    } else roots.push(s);
  }
  const byStart = (a, b) => a.start_time_unix_nano - b.start_time_unix_nano || (a.span_id < b.span_id ? -1 : 1);
  roots.sort(byStart);
  const order = [];  // depth first, children by start; no recursion (deep traces)
  const todo = roots.slice().reverse().map((s) => [s, 0]);
  const seen = new Set();
  while (todo.length) {
    const [s, depth] = todo.pop();
    if (seen.has(s.span_id)) continue;
    seen.add(s.span_id);
    order.push([s, depth]);
    const c = (kids.get(s.span_id) || []).sort(byStart);
    for (let i = c.length - 1; i >= 0; i--) todo.push([c[i], depth + 1]);
  }
  const t0 = Math.min(...spans.map((s) => s.start_time_unix_nano));
  const t1 = Math.max(...spans.map((s) => s.start_time_unix_nano + s.duration_ns));
  const span = Math.max(1, t1 - t0);
  const services = [...new Set(spans.map((s) => s.service))];
  const rootSpan = order.length ? order[0][0] : null;

  const methodLink = (m, label) => h("a", { href: link(`trace/${tid}`, { ...params, method: m }),
    "aria-current": method === m ? "true" : null, class: "toggle" }, label);
  root.append(
    h("nav", { class: "crumbs", "aria-label": "breadcrumbs" },
      h("a", { href: rootSpan ? link("search", { service: rootSpan.service, operation: rootSpan.name }) : "#/search" }, "Traces"),
      " › ", h("span", { class: "mono" }, tid)),
    h("h1", {}, rootSpan ? `${rootSpan.service}: ${rootSpan.name}` : "Trace", " ",
      h("span", { class: "sub mono" }, tid)),
    h("p", { class: "figures" },
      figure("spans", got.span_count), figure("duration", dur(span)),
      figure("CPU", dur(got.cpu_ns)), figure("services", services.join(", ")),
      figure("start", when(t0))),
    h("div", { class: "toolbar" }, h("span", {}, "Figures from "),
      methodLink("exact", "exact methods"), methodLink("all", "all methods"),
      h("span", { class: "legend" },
        h("span", { class: "swatch cpu" }), "CPU ", h("span", { class: "swatch kids" }),
        "children's CPU ", h("span", { class: "swatch off" }), "off-CPU (waiting)")));

  const ticks = h("div", { class: "wf-axis", "aria-hidden": "true" },
    [0, 0.25, 0.5, 0.75, 1].map((f) => h("span", { style: { left: `${100 * f}%` } }, dur(span * f))));
  const head = h("div", { class: "wf-row wf-head", role: "row" },
    h("span", { class: "wf-name", role: "columnheader" }, "Span"),
    h("span", { class: "wf-timeline", role: "columnheader" }, ticks),
    h("span", { class: "num", role: "columnheader" }, "Duration"),
    h("span", { class: "num", role: "columnheader" }, "CPU"),
    h("span", { class: "num", role: "columnheader" }, "Off-CPU"),
    h("span", { class: "num", role: "columnheader", title: "profile samples behind the figures" }, "Samples"),
    h("span", { class: "wf-method", role: "columnheader" }, "Method"));
  // one string for all rows: a trace can have thousands, and the parser builds them
  // several times faster than element by element
  const body = h("div", { class: "wf-body", role: "rowgroup" });
  body.innerHTML = order.map(([s, depth]) => row(s, depth, t0, span, tid, params.span)).join("");
  const table = h("div", { class: "waterfall", role: "table", "aria-label": "span waterfall" }, head, body);
  const detail = h("aside", { class: "span-detail", "aria-live": "polite" });
  root.append(table, detail);

  const show = (el) => {
    const s = byId.get(el.dataset.span);
    if (s) detail.replaceChildren(...details(s, tid));
  };
  rowKeys(body, ".wf-row", (el) => { location.hash = el.dataset.href; });
  body.addEventListener("focusin", (ev) => {
    const el = ev.target.closest(".wf-row");
    if (el) show(el);
  });
  body.addEventListener("click", (ev) => {
    const el = ev.target.closest(".wf-row");
    if (el && !ev.target.closest("a")) location.hash = el.dataset.href;
  });
  const chosen = params.span && body.querySelector(`[data-span="${CSS.escape(params.span)}"]`);
  const first = chosen || body.querySelector(".wf-row");
  if (first) {
    show(first);
    if (chosen) { chosen.focus({ preventScroll: true }); chosen.scrollIntoView({ block: "center" }); }
  }
}

function figure(name, value) {
  return h("span", { class: "figure" }, h("span", { class: "k" }, name), " ", h("span", { class: "v" }, value));
}

function row(s, depth, t0, span, tid, chosen) {
  const left = (s.start_time_unix_nano - t0) / span;
  const width = Math.max(s.duration_ns / span, 0.0005);
  const d = Math.max(s.duration_ns, s.inclusive_cpu_ns, 1);
  const self = s.cpu_ns / d;
  const kids = Math.max(0, s.inclusive_cpu_ns - s.cpu_ns) / d;
  const href = esc(link(`span/${tid}/${s.span_id}`));
  const top = (s.top_functions || [])[0];
  const title = top ? ` title="${esc(`top function: ${top.name} ${dur(top.self_ns)}`)}"` : "";
  const more = s.inclusive_cpu_ns > s.cpu_ns ? `<small> +${esc(dur(s.inclusive_cpu_ns - s.cpu_ns))}</small>` : "";
  const label = `CPU ${pct(self)}, children's CPU ${pct(kids)}, off-CPU ${pct(Math.max(0, 1 - self - kids))}`;
  return `<div class="wf-row${s.span_id === chosen ? " chosen" : ""}" role="row" tabindex="0" data-span="${esc(s.span_id)}" data-href="${href}"${title}>` +
    `<span class="wf-name" role="cell" style="padding-left:${Math.min(depth, 30) * 14 + 4}px">` +
    `<span class="svc">${esc(s.service)}</span> <a href="${href}" tabindex="-1" class="span-name">${esc(s.name || "(span not received)")}</a></span>` +
    `<span class="wf-timeline" role="cell"><span class="wf-bar" role="img" aria-label="${label}" style="left:${100 * left}%;width:${100 * width}%">` +
    `<span class="seg cpu" style="width:${100 * self}%"></span><span class="seg kids" style="width:${100 * kids}%"></span></span></span>` +
    `<span class="num" role="cell">${esc(dur(s.duration_ns))}</span>` +
    `<span class="num" role="cell">${esc(dur(s.cpu_ns))}${more}</span>` +
    `<span class="num" role="cell">${esc(dur(s.off_cpu_ns))}</span>` +
    `<span class="num" role="cell">${s.sample_count}</span>` +
    `<span class="wf-method" role="cell">${methodBadgesHtml(s.method, s.approximate)}</span></div>`;
}

function details(s, tid) {
  const fnLink = (f) => h("a", { href: link("function", { name: f.name, service: s.service,
    range: rangeAround(s.start_time_unix_nano) }) }, f.name);
  const out = [
    h("h2", {}, h("span", { class: "svc" }, s.service), " ", s.name),
    h("p", { class: "figures" },
      figure("duration", dur(s.duration_ns)), figure("CPU", dur(s.cpu_ns)),
      figure("with children", dur(s.inclusive_cpu_ns)), figure("off-CPU", dur(s.off_cpu_ns)),
      s.wall_ns ? figure("wall profile", dur(s.wall_ns)) : null,
      s.lock_ns ? figure("lock wait", dur(s.lock_ns)) : null,
      s.alloc_bytes ? figure("allocated", size(s.alloc_bytes)) : null,
      figure("samples", s.sample_count), figure("span", s.span_id)),
    h("p", {}, methodBadges(s.method, s.approximate), " ",
      h("a", { href: link(`span/${tid}/${s.span_id}`), class: "button" }, "flame graph →")),
  ];
  if ((s.top_functions || []).length) {
    out.push(h("h3", {}, "Top functions (self CPU)"), fnTable(s.top_functions, fnLink));
  }
  if ((s.top_wall_functions || []).length) {
    out.push(h("h3", {}, "Where it waited (wall clock)"), fnTable(s.top_wall_functions, fnLink));
  }
  if ((s.top_lock_functions || []).length) {
    out.push(h("h3", {}, "Where it waited for a lock"), fnTable(s.top_lock_functions, fnLink));
  }
  if ((s.top_alloc_functions || []).length) {
    out.push(h("h3", {}, "Where it allocated"), fnTable(s.top_alloc_functions, fnLink));
  }
  return out;
}

/** Functions and their time (``self_ns``) or bytes (``bytes``). */
export function fnTable(fns, fnLink) {
  return h("table", { class: "fns" }, h("tbody", {}, fns.map((f) =>
    h("tr", {}, h("td", {}, fnLink(f)),
      h("td", { class: "num" }, f.bytes !== undefined ? size(f.bytes) : dur(f.self_ns))))));
}

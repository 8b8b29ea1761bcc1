// Trace search: the calls (spans) of a service / operation over a range, filtered by
// duration and CPU, sorted by duration, CPU or off-CPU; above them the operation's duration
// histogram (log scale), where a bar (with Shift: it and every slower one) or "slowest 1%"
// selects the calls to list, and "why are they slow?" compares them with the others.
import {
  api, dur, durParam, h, link, methodBadges, pct, rangeInput, rowKeys, serviceSelects, timeBar,
  when,
} from "../lib.js";

const ORDERS = [["duration", "Duration"], ["cpu", "CPU"], ["self_cpu", "Self CPU"], ["off_cpu", "Off-CPU"]];

export async function render(root, _args, params) {
  const p = { range: "1h", order: "duration", limit: "50", ...params };
  const ops = await api("operations", { range: p.range });
  if (!p.service && ops.services.length === 1) p.service = ops.services[0].name;
  const [svc, op] = serviceSelects(ops, p.service, p.operation);
  const field = (name, label, placeholder) => [h("label", { for: `f-${name}` }, label),
    h("input", { id: `f-${name}`, name, value: p[name] || "", size: 9, placeholder,
      autocomplete: "off" })];
  const form = h("form", { class: "filters", role: "search", onsubmit: (ev) => {
    ev.preventDefault();
    const f = Object.fromEntries(new FormData(form));
    location.hash = link("search", { ...f, order: p.order, limit: p.limit });
  } },
  h("label", { for: "f-service" }, "Service"), svc,
  h("label", { for: "f-operation" }, "Operation"), op,
  rangeInput("range", p.range, "Range"),
  field("min_duration", "Min duration", "250ms"),
  field("max_duration", "Max duration", ""),
  field("min_cpu", "Min CPU", "10ms"),
  h("button", { type: "submit" }, "Search"));
  svc.addEventListener("change", () => form.requestSubmit());
  op.addEventListener("change", () => form.requestSubmit());

  const histBox = h("section", { class: "histogram", "aria-label": "duration histogram" });
  const results = h("section", { class: "results" });
  root.append(h("h1", {}, "Traces"), form, histBox, results);

  const query = { service: p.service, operation: p.operation, range: p.range,
    min_duration: p.min_duration, max_duration: p.max_duration, min_cpu: p.min_cpu,
    order: p.order, limit: p.limit };
  const [calls, hist] = await Promise.all([
    api("search", query),
    p.service ? api("histogram", { service: p.service, operation: p.operation, range: p.range })
      : Promise.resolve(null),
  ]);
  if (hist) drawHistogram(histBox, hist, p);
  else histBox.append(h("p", { class: "hint" }, "Choose a service to see how its calls' durations spread."));
  drawCalls(results, calls, p);
}

function drawHistogram(box, hist, p) {
  if (!hist.calls) {
    box.append(h("p", { class: "hint" }, "No calls in this range."));
    return;
  }
  const W = 760, H = 120, top = 8, bottom = 22;
  const n = hist.buckets.length, bw = W / n;
  const maxLog = Math.log1p(Math.max(...hist.buckets.map((b) => b.count)));
  const lo = Math.log(Math.max(1, hist.buckets[0].from_ns));
  const hi = Math.log(Math.max(2, hist.buckets[n - 1].to_ns));
  const x = (ns) => (hi > lo ? (Math.log(Math.max(1, ns)) - lo) / (hi - lo) : 0) * W;
  const minSel = p.min_duration ? parseDur(p.min_duration) : null;
  const maxSel = p.max_duration ? parseDur(p.max_duration) : null;
  const svg = h("svg:svg", { viewBox: `0 0 ${W} ${H}`, class: "hist", role: "group",
    "aria-label": `durations of ${hist.calls} calls, log scale` });
  hist.buckets.forEach((b, i) => {
    if (!b.count) return;
    const height = (H - top - bottom) * Math.log1p(b.count) / maxLog;
    const y = H - bottom - height;
    const sel = (minSel !== null || maxSel !== null) &&
      b.to_ns >= (minSel ?? 0) && b.from_ns <= (maxSel ?? Infinity);
    const g = h("svg:g", { class: `bar${sel ? " selected" : ""}`, tabindex: "0", role: "button",
      "data-from-ns": b.from_ns, "data-to-ns": b.to_ns,
      "aria-label": `${b.count} calls from ${dur(b.from_ns)} to ${dur(b.to_ns)}` },
    h("svg:title", {}, `${b.count} calls, ${dur(b.from_ns)} – ${dur(b.to_ns)}, ` +
      `${pct(b.cpu_share)} of their time on CPU (Shift: from here up)`),
    h("svg:rect", { x: i * bw + 0.5, y, width: bw - 1, height, class: "off" }),
    h("svg:rect", { x: i * bw + 0.5, y: y + height * (1 - b.cpu_share), width: bw - 1,
      height: height * b.cpu_share, class: "cpu" }));
    // a bar's calls; with Shift, the tail from this bar up (what "why" compares)
    const pick = (up) => {
      location.hash = link("search", { ...p, min_duration: durParam(b.from_ns),
        max_duration: up ? "" : durParam(b.to_ns, true) });
    };
    g.addEventListener("click", (ev) => pick(ev.shiftKey));
    g.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); pick(ev.shiftKey); }
    });
    svg.append(g);
  });
  for (const [name, v] of [["p50", hist.p50_ns], ["p90", hist.p90_ns], ["p99", hist.p99_ns]]) {
    const xx = x(v);
    svg.append(h("svg:line", { x1: xx, x2: xx, y1: top, y2: H - bottom, class: `mark ${name}` }),
      h("svg:text", { x: Math.min(W - 30, xx + 3), y: top + 10, class: "mark-label" }, name));
  }
  const ticks = 6;
  for (let i = 0; i <= ticks; i++) {
    const ns = Math.exp(lo + (hi - lo) * i / ticks);
    svg.append(h("svg:text", { x: Math.min(W - 4, Math.max(2, i * W / ticks)), y: H - 6,
      class: "tick", "text-anchor": i === 0 ? "start" : i === ticks ? "end" : "middle" }, dur(ns)));
  }
  const slowest = link("search", { ...p, min_duration: durParam(hist.p99_ns), max_duration: "" });
  box.append(
    h("div", { class: "hist-head" },
      h("span", {}, `${hist.calls} calls · p50 ${dur(hist.p50_ns)} · p90 ${dur(hist.p90_ns)} · p99 ${dur(hist.p99_ns)}`),
      h("a", { href: slowest, class: "button", id: "slowest" }, "slowest 1%"),
      p.service && p.operation
        ? h("a", { href: link("why", { service: p.service, operation: p.operation, range: p.range,
          ...(p.min_duration ? { slower_than: justUnder(p.min_duration) } : { slowest: "1%" }) }),
        class: "button", id: "why",
        title: `compare the ${p.min_duration ? `calls of ${p.min_duration} and more` : "slowest 1%"} with the others` },
        "why are they slow? →")
        : null,
      (p.min_duration || p.max_duration)
        ? h("a", { href: link("search", { ...p, min_duration: "", max_duration: "" }), class: "button" }, "clear selection")
        : null,
      h("span", { class: "legend" }, h("span", { class: "swatch cpu" }), "on CPU ",
        h("span", { class: "swatch off" }), "off CPU (waiting) · click a bar for its calls, Shift+click for it and all slower")),
    svg);
}

function parseDur(text) {
  const m = /^\s*([0-9]*\.?[0-9]+)\s*(ns|us|ms|s|m|h|d)?\s*$/.exec(text);
  if (!m) return null;
  const unit = { ns: 1, us: 1e3, ms: 1e6, s: 1e9, m: 60e9, h: 3600e9, d: 86400e9 }[m[2] || "s"];
  return parseFloat(m[1]) * unit;
}

function drawCalls(box, got, p) {
  const sortHead = (key, label) => {
    const active = p.order === key;
    return h("th", { class: "num", "aria-sort": active ? "descending" : "none" },
      h("a", { href: link("search", { ...p, order: key }), title: `sort by ${label.toLowerCase()}, largest first` },
        label, active ? " ▼" : ""));
  };
  const rows = got.calls.map((c) => h("tr", { tabindex: "0", class: "call",
    "data-href": link(`trace/${c.trace_id}`, { span: c.span_id }), "data-trace": c.trace_id },
  h("td", { class: "mono" }, when(c.start_time_unix_nano)),
  h("td", {}, h("a", { href: link(`trace/${c.trace_id}`, { span: c.span_id }), tabindex: "-1",
    class: "mono" }, c.trace_id.slice(0, 12) + "…")),
  h("td", {}, h("span", { class: "svc" }, c.service), " ", c.name),
  h("td", { class: "num" }, dur(c.duration_ns)),
  h("td", { class: "num" }, dur(c.inclusive_cpu_ns)),
  h("td", { class: "num" }, dur(c.cpu_ns)),
  h("td", { class: "num" }, dur(c.off_cpu_ns)),
  h("td", { class: "bar-cell" }, timeBar(c.duration_ns, c.cpu_ns, c.inclusive_cpu_ns)),
  h("td", { class: "num" }, c.sample_count),
  h("td", {}, methodBadges(c.method, c.approximate, "inclusive_cpu_ns"))));
  const table = h("table", { class: "calls", "aria-label": "calls found" },
    h("thead", {}, h("tr", {}, h("th", {}, "Start"), h("th", {}, "Trace"), h("th", {}, "Operation"),
      ...ORDERS.map(([k, l]) => sortHead(k, l)),
      h("th", {}, "CPU · off-CPU"), h("th", { class: "num", title: "profile samples on the span itself" }, "Samples"),
      h("th", {}, "Method"))),
    h("tbody", {}, rows));
  box.append(
    h("p", { class: "summary" }, `${got.matched} calls match`,
      got.matched > got.calls.length ? `; the ${got.calls.length} with the most ${ORDERS.find((o) => o[0] === got.order)[1].toLowerCase()} are listed` : "",
      ". CPU is the span's with its children in the same service (exact methods); ↓↑ and Enter open a trace."),
    got.calls.length ? table : h("p", { class: "empty" }, "No calls match."));
  rowKeys(table, "tr.call", (tr) => { location.hash = tr.dataset.href; });
  table.addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr.call");
    if (tr && !ev.target.closest("a")) location.hash = tr.dataset.href;
  });
}

/** why's slower_than for the search's min_duration: "at least 2400ms" is "slower than
 * 2399.999ms" (durations are whole µs here, as durParam writes them). */
function justUnder(minDuration) {
  const m = /^([0-9.]+)ms$/.exec(minDuration);
  return m ? `${Math.max(0, +m[1] - 0.001).toFixed(3)}ms` : minDuration;
}

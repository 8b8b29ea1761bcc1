// Function view, the reverse question: for a function, which spans and which traces burnt
// most of it (self CPU, or wall time) over a range; each a link back to its trace.
import { api, dur, h, link, methodBadges, pct, rangeInput, rowKeys, when } from "../lib.js";

export async function render(root, _args, params) {
  const p = { range: "1h", order: "cpu", method: "exact", ...params };
  const input = (name, label, size) => [h("label", { for: `f-${name}` }, label),
    h("input", { id: `f-${name}`, name, value: p[name] || "", size, autocomplete: "off" })];
  const form = h("form", { class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    location.hash = link("function", { ...Object.fromEntries(new FormData(form)), order: p.order, method: p.method });
  } },
  input("name", "Function", 28), input("service", "Service", 12), input("operation", "Operation", 14),
  rangeInput("range", p.range, "Range"), h("button", { type: "submit" }, "Find spans"));
  root.append(h("h1", {}, "Functions"), form);
  if (!p.name) {
    root.append(h("p", { class: "hint" }, "Name a function (or click one in a flame graph) to see the spans and traces that burnt it."));
    return;
  }
  const got = await api("function_spans", { function: p.name, service: p.service,
    operation: p.operation, range: p.range, order: p.order, method: p.method, limit: 50 });
  const here = (extra) => link("function", { ...p, ...extra });
  const toggle = (key, value, label) => h("a", { href: here({ [key]: value }), class: "toggle",
    "aria-current": p[key] === value ? "true" : null }, label);
  const measure = p.order === "wall" ? "wall" : "CPU";
  root.append(
    h("h2", {}, h("span", { class: "mono" }, p.name)),
    h("p", { class: "figures" }, fig(measure, dur(p.order === "wall" ? got.wall_ns : got.cpu_ns)),
      fig("spans", got.span_count), fig("traces", got.trace_count)),
    h("div", { class: "toolbar" }, toggle("order", "cpu", "by self CPU"), toggle("order", "wall", "by wall time"),
      h("span", { class: "sep" }), toggle("method", "exact", "exact"), toggle("method", "all", "all methods")));
  const val = (x) => (p.order === "wall" ? x.function_wall_ns : x.function_cpu_ns);
  const spans = h("table", { class: "calls fn-spans", "aria-label": `spans that burnt ${p.name}` },
    h("thead", {}, h("tr", {}, h("th", {}, "Span"), h("th", {}, "Trace"), h("th", {}, "Start"),
      h("th", { class: "num" }, `${measure} in ${shorten(p.name)}`),
      h("th", { class: "num", title: "of the span's own CPU" }, "Share"),
      h("th", { class: "num" }, "Duration"), h("th", {}, "Method"), h("th", {}, ""))),
    h("tbody", {}, got.spans.map((s) => h("tr", { class: "call", tabindex: "0",
      "data-href": link(`trace/${s.trace_id}`, { span: s.span_id }) },
    h("td", {}, h("span", { class: "svc" }, s.service), " ", s.name),
    h("td", {}, h("a", { class: "mono trace-link", href: link(`trace/${s.trace_id}`, { span: s.span_id }) },
      s.trace_id.slice(0, 12) + "…")),
    h("td", { class: "mono" }, s.start_time_unix_nano ? when(s.start_time_unix_nano) : "–"),
    h("td", { class: "num" }, dur(val(s))),
    h("td", { class: "num" }, s.cpu_ns ? pct(s.function_cpu_ns / s.cpu_ns) : "–"),
    h("td", { class: "num" }, dur(s.duration_ns)),
    h("td", {}, methodBadges(s.method)),
    h("td", {}, h("a", { href: link(`span/${s.trace_id}/${s.span_id}`, { q: p.name }) }, "flame graph"))))));
  const traces = h("table", { class: "calls fn-traces", "aria-label": `traces that burnt ${p.name}` },
    h("thead", {}, h("tr", {}, h("th", {}, "Trace"), h("th", {}, "Operation"),
      h("th", { class: "num" }, `${measure} in ${shorten(p.name)}`), h("th", { class: "num" }, "Spans"))),
    h("tbody", {}, got.traces.map((t) => h("tr", { class: "call", tabindex: "0", "data-href": link(`trace/${t.trace_id}`) },
      h("td", {}, h("a", { class: "mono trace-link", href: link(`trace/${t.trace_id}`) }, t.trace_id)),
      h("td", {}, h("span", { class: "svc" }, t.service), " ", t.name),
      h("td", { class: "num" }, dur(p.order === "wall" ? t.function_wall_ns : t.function_cpu_ns)),
      h("td", { class: "num" }, t.spans)))));
  root.append(
    h("h2", {}, "Spans that burnt the most"), got.spans.length ? spans : h("p", { class: "empty" }, "None in this range."),
    h("h2", {}, "Traces"), got.traces.length ? traces : h("p", { class: "empty" }, "None in this range."));
  for (const t of [spans, traces]) {
    rowKeys(t, "tr.call", (tr) => { location.hash = tr.dataset.href; });
    t.addEventListener("click", (ev) => {
      const tr = ev.target.closest("tr.call");
      if (tr && !ev.target.closest("a")) location.hash = tr.dataset.href;
    });
  }
}

function shorten(name) {
  return name.length > 24 ? name.slice(0, 22) + "…" : name;
}

function fig(name, value) {
  return h("span", { class: "figure" }, h("span", { class: "k" }, name), " ", h("span", { class: "v" }, value));
}

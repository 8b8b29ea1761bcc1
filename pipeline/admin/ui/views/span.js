// Span view: the span's flame graph, with its children in the same service or alone, of
// CPU or (where a wall-clock profile covers it) wall time; its figures and method; the
// functions it burnt and the ones it waited in, each a link to the spans that burnt it.
import { flameGraph, flameTree } from "../flame.js";
import { api, dur, h, link, methodBadges, rangeAround, replaceParams, size, when } from "../lib.js";
import { fnTable } from "./trace.js";

export async function render(root, args, params) {
  const [tid = "", sid = ""] = args;
  const p = { children: "1", measure: "cpu", method: "exact", ...params };
  const [found, fg] = await Promise.all([
    api(`traces/${encodeURIComponent(tid)}/spans/${encodeURIComponent(sid)}`, { method: p.method })
      .catch((err) => { if (err.status === 404) return null; throw err; }),
    api("flamegraph", { trace_id: tid, span_id: sid, children: p.children, measure: p.measure,
      method: p.method, format: "nodes" }),
  ]);
  const s = found ||
    { span_id: sid, service: "", name: "(span not received)", duration_ns: 0, cpu_ns: 0,
      inclusive_cpu_ns: 0, off_cpu_ns: 0, sample_count: 0, start_time_unix_nano: 0, method: "" };
  const range = rangeAround(s.start_time_unix_nano);
  const here = `span/${tid}/${sid}`;
  const toggle = (key, value, label, disabled) => h("a", {
    href: disabled ? null : link(here, { ...p, [key]: value, zoom: "", q: p.q }),
    "aria-current": p[key] === value ? "true" : null, "aria-disabled": disabled ? "true" : null,
    class: "toggle" }, label);
  const fnLink = (f) => h("a", { href: link("function", { name: f.name, service: s.service, range }) }, f.name);
  const graph = h("section", { class: "flame", "aria-label": "flame graph" });
  root.append(
    h("nav", { class: "crumbs", "aria-label": "breadcrumbs" },
      h("a", { href: link("search", { service: s.service, operation: s.name }) }, "Traces"), " › ",
      h("a", { href: link(`trace/${tid}`, { span: sid }), class: "mono" }, tid.slice(0, 12) + "…"), " › ",
      h("span", {}, s.name)),
    h("h1", {}, h("span", { class: "svc" }, s.service), " ", s.name, " ", h("span", { class: "sub mono" }, sid)),
    h("p", { class: "figures" },
      fig("duration", dur(s.duration_ns)), fig("CPU", dur(s.cpu_ns)),
      fig("with children", dur(s.inclusive_cpu_ns)), fig("off-CPU", dur(s.off_cpu_ns)),
      fg.wall_ns ? fig("wall profile", dur(fg.wall_ns)) : null,
      s.lock_ns ? fig("lock wait", dur(s.lock_ns)) : null,
      s.alloc_bytes ? fig("allocated", size(s.alloc_bytes)) : null,
      fig("samples", s.sample_count), fig("start", s.start_time_unix_nano ? when(s.start_time_unix_nano) : "–")),
    h("p", {}, "Method: ", methodBadges(s.method, s.approximate)),
    h("div", { class: "toolbar" },
      toggle("children", "1", fg.children ? `with children (${fg.spans} span${fg.spans === 1 ? "" : "s"})` : "with children"),
      toggle("children", "0", "this span only"), h("span", { class: "sep" }),
      toggle("measure", "cpu", "CPU"),
      toggle("measure", "wall", "wall clock", !fg.wall_ns && p.measure !== "wall"),
      h("span", { class: "sep" }),
      toggle("method", "exact", "exact"), toggle("method", "all", "all methods"),
      h("a", { href: link("operation", { service: s.service, operation: s.name, range }), class: "button" },
        "this operation's flame graph →")),
    graph);
  const what = p.measure === "wall" ? "wall" : "CPU";
  await flameGraph(graph, flameTree(fg), {
    what, query: p.q, zoom: p.zoom, leftOut: fg.nodes_left_out,
    onState: (st) => replaceParams(here, { ...params, q: st.query, zoom: st.zoom }),
    onSelect: (name) => h("a", { class: "button fn-link", href: link("function", { name, service: s.service, range }) },
      `spans that burnt ${name} →`),
  });
  const lists = h("div", { class: "columns" });
  if ((s.top_functions || []).length) {
    lists.append(h("section", {}, h("h2", {}, "Top functions (self CPU)"), fnTable(s.top_functions, fnLink)));
  }
  if ((s.top_wall_functions || []).length) {
    lists.append(h("section", { class: "wall" }, h("h2", {}, "Wall-clock breakdown (where it waited)"),
      fnTable(s.top_wall_functions, fnLink)));
  }
  if ((s.top_lock_functions || []).length) {
    lists.append(h("section", { class: "lock" }, h("h2", {}, "Lock wait (contention profile)"),
      fnTable(s.top_lock_functions, fnLink)));
  }
  if ((s.top_alloc_functions || []).length) {
    lists.append(h("section", { class: "alloc" }, h("h2", {}, "Allocated (bytes)"),
      fnTable(s.top_alloc_functions, fnLink)));
  }
  root.append(lists);
}

function fig(name, value) {
  return h("span", { class: "figure" }, h("span", { class: "k" }, name), " ", h("span", { class: "v" }, value));
}

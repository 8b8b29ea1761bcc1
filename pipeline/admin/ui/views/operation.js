// Operation view: the flame graph of a service's (or one operation's) CPU over a range, or,
// against a base range, the differential flame graph (widths: the range's CPU; colours:
// more or less per call than in the base); the functions by self CPU (or by change per
// call), each a link to the spans that burnt it.
import { flameGraph, flameTree } from "../flame.js";
import { api, dur, h, link, pct, rangeInput, replaceParams, serviceSelects } from "../lib.js";

export async function render(root, _args, params) {
  const p = { range: "1h", ...params };
  const ops = await api("operations", { range: p.range });
  if (!p.service && ops.services.length) p.service = ops.services[0].name;
  const [svc, op] = serviceSelects(ops, p.service, p.operation, false);
  const form = h("form", { class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    location.hash = link("operation", Object.fromEntries(new FormData(form)));
  } },
  h("label", { for: "f-service" }, "Service"), svc,
  h("label", { for: "f-operation" }, "Operation"), op,
  rangeInput("range", p.range, "Range"),
  rangeInput("base", p.base, "Compare with"),
  h("button", { type: "submit" }, p.base ? "Compare" : "Show"));
  svc.addEventListener("change", () => form.requestSubmit());
  op.addEventListener("change", () => form.requestSubmit());
  root.append(h("h1", {}, "Operations"), form);
  if (!p.service) {
    root.append(h("p", { class: "empty" }, "No operations in this range."));
    return;
  }
  const q = { service: p.service, operation: p.operation, range: p.range, base: p.base, format: "nodes" };
  const [fg, fns] = await Promise.all([
    api("flamegraph", q),
    p.base
      ? api("diff", { service: p.service, operation: p.operation, before: p.base, after: p.range, limit: 30 })
      : api("functions", { service: p.service, operation: p.operation, since: p.range, limit: 30 }),
  ]);
  const title = `${p.service}${p.operation ? ": " + p.operation : " (all operations)"}`;
  const graph = h("section", { class: "flame", "aria-label": "flame graph" });
  root.append(
    h("h2", {}, title),
    h("p", { class: "figures" },
      fig("CPU", dur(fg.total)), fig("stacks", fg.stack_count),
      p.base ? fig("calls", `${fg.calls} (base ${fg.base_calls})`) : fig("calls", fns.calls),
      p.base ? fig("compared", fg.unit_of_diff === "per_call" ? "per call" : "per second of range") : null,
      p.operation ? h("a", { class: "button", href: link("search", { service: p.service, operation: p.operation, range: p.range }) },
        "its traces →") : null),
    graph);
  await flameGraph(graph, flameTree(fg), {
    diff: !!p.base, query: p.q, zoom: p.zoom, leftOut: fg.nodes_left_out,
    onState: (st) => replaceParams("operation", { ...params, q: st.query, zoom: st.zoom }),
    onSelect: (name) => h("a", { class: "button fn-link",
      href: link("function", { name, service: p.service, operation: p.operation, range: p.range }) },
    `spans that burnt ${name} →`),
  });
  const fnLink = (name) => h("a", { href: link("function", { name, service: p.service,
    operation: p.operation, range: p.range }) }, name);
  const table = p.base
    ? h("table", { class: "fns wide" },
      h("thead", {}, h("tr", {}, h("th", {}, "Function"),
        h("th", { class: "num" }, `Base ${fns.unit === "per_call" ? "per call" : "per s"}`),
        h("th", { class: "num" }, "Now"), h("th", { class: "num" }, "Change"))),
      h("tbody", {}, fns.functions.map((f) => h("tr", {}, h("td", {}, fnLink(f.name)),
        h("td", { class: "num" }, dur(f.before_ns)), h("td", { class: "num" }, dur(f.after_ns)),
        h("td", { class: `num ${f.delta_ns > 0 ? "worse" : f.delta_ns < 0 ? "better" : ""}` },
          `${f.delta_ns >= 0 ? "+" : "−"}${dur(Math.abs(f.delta_ns))}`)))))
    : h("table", { class: "fns wide" },
      h("thead", {}, h("tr", {}, h("th", {}, "Function"), h("th", { class: "num" }, "Self CPU"),
        h("th", { class: "num" }, "Share"), h("th", { class: "num" }, "Per call"))),
      h("tbody", {}, fns.functions.map((f) => h("tr", {}, h("td", {}, fnLink(f.name)),
        h("td", { class: "num" }, dur(f.self_cpu_ns)), h("td", { class: "num" }, pct(f.share)),
        h("td", { class: "num" }, f.per_call_ns === null ? "–" : dur(f.per_call_ns))))));
  root.append(h("h2", {}, p.base ? "Functions by change in CPU" : "Functions by self CPU"), table);
}

function fig(name, value) {
  return h("span", { class: "figure" }, h("span", { class: "k" }, name), " ", h("span", { class: "v" }, value));
}

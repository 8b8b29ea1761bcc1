// Why view (issue #21): an operation's slowest calls against its typical ones, as
// `spanprof why` answers (/api/v1/why): the verdict (burning / waiting / unknown), both
// groups per call with their intervals, the functions by difference with the share of the
// extra duration each explains, the attributes that set the tail apart, and the tail's
// flame graph per call coloured by its difference with the typical calls'.
import { flameGraph } from "../flame.js";
import { api, dur, h, link, pct, rangeInput, replaceParams } from "../lib.js";

/** The API's stacks (frames root first, tail and typical ns per call) as a flame tree
 * ({n, v, d, c}): widths the tail's, d the difference with the typical calls. */
export function stacksTree(stacks) {
  const root = { n: "all", v: 0, d: 0, c: [] };
  for (const s of stacks) {
    const v = Math.round(s.tail_ns), d = s.tail_ns - s.typical_ns;
    let node = root;
    node.v += v;
    node.d += d;
    for (const name of s.frames) {
      let child = node.c.find((x) => x.n === name);
      if (!child) { child = { n: name, v: 0, d: 0, c: [] }; node.c.push(child); }
      child.v += v;
      child.d += d;
      node = child;
    }
  }
  return root;
}

const mark = (f) => (f.few ? h("span", { class: "few", title: "too few calls to trust" }, " ?") : null);
const fig = (f) => h("span", {}, dur(f.per_call_ns),
  f.ci_ns !== null && f.ci_ns !== undefined ? h("span", { class: "ci" }, ` ±${dur(f.ci_ns)}`) : null, mark(f));

export async function render(root, _args, params) {
  const p = { range: "1h", ...params };
  if (!p.slower_than && !p.slowest) p.slowest = "1%";
  const form = h("form", { class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    location.hash = link("why", Object.fromEntries(new FormData(form)));
  } },
  h("input", { type: "hidden", name: "service", value: p.service || "" }),
  h("input", { type: "hidden", name: "operation", value: p.operation || "" }),
  rangeInput("range", p.range, "Range"),
  h("label", { for: "f-slowest" }, "Slowest"),
  h("input", { id: "f-slowest", name: "slowest", value: p.slowest || "", size: 5, "data-slash": "" }),
  h("label", { for: "f-slower" }, "or slower than"),
  h("input", { id: "f-slower", name: "slower_than", value: p.slower_than || "", size: 7 }),
  h("button", { type: "submit" }, "Compare"));
  root.append(h("h1", {}, `Why: ${p.service}: ${p.operation}`), form);
  const q = { service: p.service, operation: p.operation, range: p.range, stacks: "1",
    ...(p.slower_than ? { slower_than: p.slower_than } : { slowest: p.slowest }) };
  const w = await api("why", q);
  const verdict = h("p", { class: `verdict verdict-${w.verdict.replace(" ", "-")}` },
    `${w.calls} calls; tail: ${w.rule}`, w.threshold_ns ? ` (≥ ${dur(w.threshold_ns)})` : "", ". ");
  if (!w.tail) {
    verdict.append(h("strong", {}, w.verdict), ": ", w.notes.join("; "));
    root.append(verdict);
    return;
  }
  verdict.append(`The tail takes ${dur(w.extra_ns)} more per call: `, h("strong", {}, w.verdict),
    ` (CPU ${dur(w.extra_cpu_ns)}, off-CPU ${dur(w.extra_off_cpu_ns)}).`);
  const rows = [["duration", "Duration"], ["inclusive_cpu", "CPU with children"],
    ["cpu", "CPU of the span"], ["off_cpu", "Off-CPU"]];
  const groups = h("table", { class: "groups" },
    h("thead", {}, h("tr", {}, h("th", {}, "per call"),
      h("th", { class: "num" }, `tail (${w.tail.calls})`),
      h("th", { class: "num" }, `typical (${w.typical.calls})`))),
    h("tbody", {}, rows.map(([k, label]) => h("tr", {}, h("td", {}, label),
      h("td", { class: "num" }, fig(w.tail[k])), h("td", { class: "num" }, fig(w.typical[k])))),
    h("tr", {}, h("td", {}, "Samples"), h("td", { class: "num" }, w.tail.samples),
      h("td", { class: "num" }, w.typical.samples))));
  const fnLink = (name) => h("a", { href: link("function", { name, service: p.service,
    operation: p.operation, range: p.range }) }, name);
  const fnTable = (list, what) => h("table", { class: "fns wide why-fns" },
    h("thead", {}, h("tr", {}, h("th", {}, "Function"), h("th", { class: "num" }, `Tail ${what}`),
      h("th", { class: "num" }, "Typical"), h("th", { class: "num" }, "Difference"),
      h("th", { class: "num" }, "Explains"))),
    h("tbody", {}, list.map((f) => h("tr", {}, h("td", {}, fnLink(f.name), mark(f)),
      h("td", { class: "num" }, dur(f.tail.per_call_ns)), h("td", { class: "num" }, dur(f.typical.per_call_ns)),
      h("td", { class: `num ${f.delta_ns > 0 ? "worse" : "better"}` },
        `${f.delta_ns >= 0 ? "+" : "−"}${dur(Math.abs(f.delta_ns))}`,
        f.ci_ns !== null ? h("span", { class: "ci" }, ` ±${dur(f.ci_ns)}`) : null),
      h("td", { class: "num" }, f.explains === null ? "–" : pct(f.explains))))));
  root.append(verdict, groups);
  if (w.functions.length) root.append(h("h2", {}, "Functions by self CPU per call"), fnTable(w.functions, "CPU"));
  if (w.wall_functions.length) root.append(h("h2", {}, "Functions by wall time per call"), fnTable(w.wall_functions, "wall"));
  if (w.attributes.length) {
    root.append(h("h2", {}, "Attributes that set the tail apart"), h("table", { class: "attrs" },
      h("thead", {}, h("tr", {}, h("th", {}, "Attribute"), h("th", { class: "num" }, "Separation"),
        h("th", {}, "Tail"), h("th", {}, "Typical"))),
      h("tbody", {}, w.attributes.map((a) => h("tr", {}, h("td", {}, a.key, mark(a)),
        h("td", { class: "num" }, a.separation.toFixed(2)),
        h("td", {}, a.kind === "numeric" ? `mean ${a.tail.mean.toPrecision(4)}` : `${a.value}: ${pct(a.tail.share)}`),
        h("td", {}, a.kind === "numeric" ? `mean ${a.typical.mean.toPrecision(4)}` : `${a.value}: ${pct(a.typical.share)}`))))));
  }
  for (const n of w.notes) root.append(h("p", { class: "note" }, n));
  const graph = h("section", { class: "flame", "aria-label": "differential flame graph" });
  root.append(h("h2", {}, "The tail's CPU per call (red: more than typical, blue: less)"), graph);
  await flameGraph(graph, stacksTree(w.stacks || []), {
    diff: true, query: p.q, zoom: p.zoom,
    onState: (st) => replaceParams("why", { ...params, q: st.query, zoom: st.zoom }),
    onSelect: (name) => fnLink(name),
  });
}

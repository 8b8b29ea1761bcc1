// Why view (issue #21): an operation's slowest calls against its typical ones, as
// `spanprof why` answers (/api/v1/why): the verdict (burning / waiting / unknown / not
// slower), both groups per call with their intervals, the functions by difference with the
// share of the extra duration each explains, the attributes that set the tail apart, and
// the tail's flame graph per call coloured by its difference with the typical calls'.
import { flameGraph } from "../flame.js";
import {
  api, dur, durParam, h, link, pct, rangeInput, replaceParams, rowKeys, serviceSelects, size,
} from "../lib.js";

const VERDICTS = {
  "burning": "most of its extra time is on CPU: the functions below burn it.",
  "waiting": "most of its extra time is off CPU (a lock, a socket, a disk): on CPU it " +
    "burns little more than the typical calls.",
  "unknown": "no CPU profile covers these calls: burning and waiting cannot be told apart.",
  "not slower": "the tail is not slower than the typical calls.",
  "nothing to compare": "there are no two groups to compare.",
};
const FEW_TITLE = "too few calls to trust: fewer than 5, or an interval wider than the figure";

/** The API's stacks (frames root first, tail and typical ns per call) as a flame tree
 * ({n, v, c, d}): widths the tail's CPU per call, d its difference with the typical's. */
export function stacksTree(stacks) {
  const root = { n: "all", v: 0, d: 0, c: [] };
  const kids = new Map([[root, new Map()]]);
  for (const s of stacks) {
    const v = Math.round(s.tail_ns), d = Math.round(s.tail_ns - s.typical_ns);
    let node = root;
    node.v += v;
    node.d += d;
    for (const name of s.frames) {
      const byName = kids.get(node);
      let child = byName.get(name);
      if (!child) {
        child = { n: name, v: 0, d: 0, c: [] };
        byName.set(name, child);
        kids.set(child, new Map());
        node.c.push(child);
      }
      child.v += v;
      child.d += d;
      node = child;
    }
  }
  return root;
}

const few = (f) => (f && f.few ? h("span", { class: "few", title: FEW_TITLE }, "too few calls") : null);
// a figure's unit: "ns" (time), or "bytes" (per_call_bytes, allocations)
const unitOf = (f) => ("per_call_bytes" in f ? "bytes" : "ns");
const show = (v, unit = "ns") => (unit === "bytes" ? size(v) : dur(v));
const signed = (v, unit = "ns") => `${v >= 0 ? "+" : "−"}${show(Math.abs(v), unit)}`;
const ci = (v, unit = "ns") => (v === null || v === undefined ? null
  : h("span", { class: "ci" }, ` ±${show(v, unit)}`));
const figure = (f) => [show(f[`per_call_${unitOf(f)}`], unitOf(f)), ci(f[`ci_${unitOf(f)}`], unitOf(f)), few(f)];
const perCall = (f) => f[`per_call_${unitOf(f)}`];
const callsOf = (n) => `${n} call${n === 1 ? "" : "s"}`;

export async function render(root, _args, params) {
  const p = { range: "1h", ...params };
  const rule = p.slower_than ? "slower_than" : "slowest";
  const value = p.slower_than || p.slowest || "1%";
  const ask = p.service && p.operation;
  const [ops, w] = await Promise.all([api("operations", { range: p.range }),
    ask ? api("why", { service: p.service, operation: p.operation, range: p.range, method: p.method,
      [rule]: value, stacks: "1" }) : null]);
  const [svc, op] = serviceSelects(ops, p.service, p.operation, false);
  const ruleSelect = h("select", { name: "rule", id: "f-rule", "aria-label": "tail" },
    h("option", { value: "slowest", selected: rule === "slowest" }, "slowest"),
    h("option", { value: "slower_than", selected: rule === "slower_than" }, "slower than"));
  const form = h("form", { class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const f = Object.fromEntries(new FormData(form));
    location.hash = link("why", { service: f.service, operation: f.operation, range: f.range,
      [f.rule]: f.value });
  } },
  h("label", { for: "f-service" }, "Service"), svc,
  h("label", { for: "f-operation" }, "Operation"), op,
  rangeInput("range", p.range, "Range"),
  h("label", { for: "f-rule" }, "Tail"), ruleSelect,
  h("input", { id: "f-value", name: "value", value, size: 9, "aria-label": "tail: share or duration",
    placeholder: "1% or 500ms", autocomplete: "off" }),
  h("button", { type: "submit" }, "Compare"));
  svc.addEventListener("change", () => { op.value = ""; });
  const title = p.service ? `${p.service}: ${p.operation || "…"}` : "";
  root.append(
    h("nav", { class: "crumbs", "aria-label": "breadcrumbs" },
      h("a", { href: link("search", { service: p.service, operation: p.operation, range: p.range }) }, "Traces"),
      " › ", h("span", {}, title || "why")),
    h("h1", {}, "Why are the slow calls slow? ", h("span", { class: "sub" }, title)), form);
  if (!ask) {
    root.append(h("p", { class: "hint" }, "Choose an operation, or select the slow calls on a trace " +
      "search's duration histogram and follow “why are they slow?”."));
    return;
  }
  const tailLink = w.threshold_ns
    ? h("a", { class: "button", href: link("search", { service: p.service, operation: p.operation,
      range: p.range, min_duration: durParam(w.threshold_ns) }) }, "the tail's calls →")
    : null;
  const verdict = h("section", { class: `verdict verdict-${w.verdict.replaceAll(" ", "-")}`,
    "aria-label": "verdict" },
  h("strong", { class: "verdict-word" }, w.verdict),
  h("p", {}, `${w.calls} calls; tail: ${w.rule}`,
    w.threshold_ns && rule === "slowest" ? ` (from ${dur(w.threshold_ns)})` : "",
    w.tail ? `, ${callsOf(w.tail.calls)}` : "",
    ". ",
    w.tail && w.verdict !== "not slower"
      ? [`The tail takes ${dur(w.extra_ns)} more per call: `, h("strong", {}, w.verdict), " — ",
        VERDICTS[w.verdict] || "", ` On CPU ${signed(w.extra_cpu_ns)}, off CPU ${signed(w.extra_off_cpu_ns)} per call.`]
      : VERDICTS[w.verdict] || ""),
  tailLink);
  root.append(verdict);
  for (const n of w.notes) root.append(h("p", { class: "note" }, n));
  if (!w.tail) return;

  const rows = [["duration", "Duration"], ["cpu", "CPU of the span"],
    ["inclusive_cpu", "CPU with children"], ["off_cpu", "Off-CPU"]];
  // lock wait and bytes allocated: where a contention or allocation profile reached them
  for (const [k, label] of [["lock", "Lock wait"], ["alloc", "Allocated"]]) {
    if (w.tail[k] && (perCall(w.tail[k]) || perCall(w.typical[k]))) rows.push([k, label]);
  }
  const left = h("section", {}, h("h2", {}, "Tail and typical calls"));
  const right = h("section", {});
  root.append(h("div", { class: "columns" }, left, right));
  left.append(h("table", { class: "groups", "aria-label": "per call, tail and typical" },
    h("thead", {}, h("tr", {}, h("th", {}, "per call"),
      h("th", { class: "num" }, `tail (${w.tail.calls})`),
      h("th", { class: "num" }, `typical (${w.typical.calls})`),
      h("th", { class: "num" }, "difference"))),
    h("tbody", {},
      rows.map(([k, label]) => h("tr", {}, h("th", { scope: "row" }, label),
        h("td", { class: "num" }, figure(w.tail[k])), h("td", { class: "num" }, figure(w.typical[k])),
        h("td", { class: `num ${diffClass(perCall(w.tail[k]) - perCall(w.typical[k]))}` },
          signed(perCall(w.tail[k]) - perCall(w.typical[k]), unitOf(w.tail[k]))))),
      h("tr", {}, h("th", { scope: "row" }, "Samples (all calls)"), h("td", { class: "num" }, w.tail.samples),
        h("td", { class: "num" }, w.typical.samples), h("td", {})))),
  h("p", { class: "hint" }, "± : 95% interval of the mean per call; CPU placed by the exact methods."));

  const fnLink = (name) => h("a", { href: link("function", { name, service: p.service,
    operation: p.operation, range: p.range }) }, name);
  const fnTable = (list, what, unit = "ns") => {
    const table = h("table", { class: "fns wide why-fns" },
      h("thead", {}, h("tr", {}, h("th", {}, "Function"), h("th", { class: "num" }, `Tail ${what}`),
        h("th", { class: "num" }, `Typical ${what}`), h("th", { class: "num" }, "Difference"),
        h("th", { class: "num", title: "share of the tail's extra duration per call" }, "Explains"))),
      h("tbody", {}, list.map((f) => h("tr", { class: "call", tabindex: "0", "data-name": f.name },
        h("td", {}, fnLink(f.name), few(f)),
        h("td", { class: "num" }, show(f.tail[`per_call_${unit}`], unit)),
        h("td", { class: "num" }, show(f.typical[`per_call_${unit}`], unit)),
        h("td", { class: `num ${diffClass(f[`delta_${unit}`])}` }, signed(f[`delta_${unit}`], unit),
          ci(f[`ci_${unit}`], unit)),
        h("td", { class: "num explains" }, f.explains === null ? "–" : [
          h("span", { class: "share", style: { width: `${Math.round(60 * Math.min(1, Math.max(0, f.explains)))}px` } }),
          pct(f.explains)])))));
    rowKeys(table, "tr.call", (tr) => { tr.querySelector("a").click(); });
    return table;
  };
  right.append(h("h2", {}, "Functions by difference in self CPU per call"), w.functions.length
    ? fnTable(w.functions, "CPU")
    : h("p", { class: "hint" }, "No function's CPU per call differs between the groups."));
  if (w.wall_functions.length) {
    right.append(h("h2", {}, "Functions by difference in wall time per call (where it waited)"),
      fnTable(w.wall_functions, "wall"));
  }
  if ((w.lock_functions || []).length) {
    right.append(h("h2", {}, "Functions by difference in lock wait per call (contention profile)"),
      fnTable(w.lock_functions, "lock wait"));
  }
  if ((w.alloc_functions || []).length) {
    right.append(h("h2", {}, "Functions by difference in bytes allocated per call"),
      fnTable(w.alloc_functions, "bytes", "bytes"));
  }
  if (w.attributes.length) {
    const side = (a, g) => (a.kind === "numeric" ? `mean ${+g.mean.toPrecision(4)}`
      : `= ${a.value} in ${pct(g.share)}`);
    right.append(h("h2", {}, "Attributes that set the tail apart"), h("table", { class: "fns attrs" },
      h("thead", {}, h("tr", {}, h("th", {}, "Attribute"),
        h("th", { class: "num", title: "0: the same in both groups, 1: apart" }, "Separation"),
        h("th", {}, "Tail"), h("th", {}, "Typical"))),
      h("tbody", {}, w.attributes.map((a) => h("tr", { "data-key": a.key },
        h("td", { class: "mono" }, a.key, few(a)),
        h("td", { class: "num" }, a.separation.toFixed(2)),
        h("td", {}, side(a, a.tail)), h("td", {}, side(a, a.typical)))))),
    h("p", { class: "hint" }, "Compared on the calls of the minutes holding most tail calls."));
  }

  const graph = h("section", { class: "flame", "aria-label": "differential flame graph" });
  root.append(h("h2", {}, "The tail's CPU per call, by its difference with the typical calls"), graph);
  await flameGraph(graph, stacksTree(w.stacks || []), {
    diff: true, base: "typical", what: "CPU per call", query: p.q, zoom: p.zoom,
    onState: (st) => replaceParams("why", { ...params, q: st.query, zoom: st.zoom }),
    onSelect: (name) => h("a", { class: "button fn-link", href: link("function", { name,
      service: p.service, operation: p.operation, range: p.range }) }, `spans that burnt ${name} →`),
  });
}

function diffClass(ns) {
  return ns > 0 ? "worse" : ns < 0 ? "better" : "";
}

// An interactive flame graph (icicle: the root on top, as `spanprof flamegraph` draws it)
// of a tree from /api/v1/flamegraph, drawn by the vendored d3-flame-graph: click a frame to
// zoom into it, Escape to zoom out, search (substring, any case) to colour the matching
// frames and see their share, hover for a frame's time and share. With `diff`, frames
// are coloured by their difference to the base (red: more, blue: less, orange: only here;
// `base` names it: "typical" in the why view). The library and d3
// are loaded on first use (boot.js): the other views do without them.
import { dur, h, pct } from "./lib.js";

/* global d3, flamegraph */

/** The tree d3-flame-graph draws ({n, v, c}, with `d` in a difference) from an answer of
 * /api/v1/flamegraph: its `tree`, or its compact `graph` (format=nodes: `frames` and four
 * numbers a node, its parent's position first, parents before their children). */
export function flameTree(answer) {
  if (answer.tree) return answer.tree;
  const { frames, nodes, total } = answer.graph;
  const diff = answer.graph.total_d !== undefined;
  const root = { n: "all", v: total };
  if (diff) root.d = answer.graph.total_d;
  const made = new Array(nodes.length / 4);
  for (let i = 0, k = 0; i < nodes.length; i += 4, k++) {
    const node = { n: frames[nodes[i + 1]], v: nodes[i + 2] };
    if (diff) node.d = nodes[i + 3];
    const parent = nodes[i] < 0 ? root : made[nodes[i]];
    (parent.c || (parent.c = [])).push(node);
    made[k] = node;
  }
  return root;
}

/** The path of names from the root's child down to a hierarchy node. */
function pathOf(node) {
  const names = [];
  for (let n = node; n && n.parent; n = n.parent) names.push(n.data.n);
  return names.reverse();
}

/**
 * Draw `tree` in `container`. Options: `diff` (the tree has `d`), `query` (search term),
 * `zoom` (a path of names joined by ";"), `onState({query, zoom})` when either changes,
 * `onSelect(name, node)` when a frame is clicked, `what` (what the values are: "CPU"),
 * `base` (what a diff compares with: "base").
 * Resolves once the frames are drawn.
 */
export async function flameGraph(container, tree, opts = {}) {
  const total = tree.v || 0;
  const what = opts.what || "CPU";
  const base = opts.base || "base";
  const state = { query: opts.query || "", zoom: opts.zoom || "" };
  const details = h("div", { class: "fg-details", "aria-live": "polite" }, "\u00a0");
  const found = h("span", { class: "fg-found" });
  const search = h("input", { type: "search", class: "fg-search", placeholder: "search frames  ( / )",
    "aria-label": "search frames", value: state.query });
  const reset = h("button", { type: "button", class: "fg-reset", title: "zoom out (Escape)" }, "reset zoom");
  const selected = h("div", { class: "fg-selected" });
  const note = opts.leftOut
    ? h("span", { class: "fg-note", title: "the API's max_nodes: the largest frames are drawn" },
      `${opts.leftOut} smaller frames not drawn`) : null;
  const chartEl = h("div", { class: "fg-chart", tabindex: "-1" });
  container.replaceChildren(
    h("div", { class: "fg-tools" }, search, found, reset, note,
      opts.diff ? h("span", { class: "fg-legend" },
        h("span", { class: "swatch more" }), `more than ${base} `,
        h("span", { class: "swatch less" }), "less ",
        h("span", { class: "swatch new" }), `not in ${base}`) : null),
    details, chartEl, selected);
  if (!total) {
    chartEl.append(h("p", { class: "empty" }, `No ${what.toLowerCase()} samples here.`));
    return null;
  }
  await window.spanprofLoadLibs();

  const width = Math.max(320, container.clientWidth || 960);
  const label = (d) => {
    const v = d.data.v;
    let s = `${d.data.n}: ${dur(v)} ${what}, ${pct(v / total)} of all`;
    if (d.parent && d.parent.parent) s += `, ${pct(v / d.parent.data.v)} of ${d.parent.data.n}`;
    if (opts.diff && d.data.d !== undefined) {
      s += `; ${d.data.d >= 0 ? "+" : "−"}${dur(Math.abs(d.data.d))} vs ${base}`;
    }
    return s;
  };
  const chart = flamegraph.default()
    .width(width)
    .cellHeight(18)
    .inverted(true)
    .sort(true)
    .minFrameSize(2)  // narrower frames: unreadable, and most of the DOM
    .transitionDuration(0)
    .setLabelHandler(label)
    .setDetailsElement(details)
    .setSearchMatch((d, term) => !!term && d.data.n.toLowerCase().includes(term.toLowerCase()))
    .setSearchHandler((results, sum, all) => {
      found.textContent = state.query
        ? `${results.length} frames match: ${dur(sum)} (${pct(all ? sum / all : 0)})` : "";
    })
    .onClick((d) => {
      state.zoom = pathOf(d).join(";");
      showSelected(d);
      if (opts.onState) opts.onState({ ...state });
    });
  if (opts.diff) chart.setColorMapper(flamegraph.colorMapper.differentialColorMapper);

  function showSelected(d) {
    if (!d.parent) { selected.replaceChildren(); return; }
    const name = d.data.n;
    selected.replaceChildren(
      h("span", { class: "fg-sel-name" }, name), " ", label(d).slice(name.length + 2),
      opts.onSelect ? opts.onSelect(name, d) : null);
  }

  d3.select(chartEl).datum(tree).call(chart);
  const root = d3.select(chartEl).datum();  // the hierarchy the chart built
  // the library grows new frames from width 0 over d3's default 250 ms: draw them at once
  d3.select(chartEl).selectAll("g.frame").each(function () {
    d3.select(this).select("rect").interrupt().attr("width", this.getAttribute("width"));
  });

  if (state.query) chart.search(state.query);
  if (state.zoom) {
    let node = root;
    for (const name of state.zoom.split(";")) {
      const next = (node.children || []).find((c) => c.data.n === name);
      if (!next) break;
      node = next;
    }
    if (node !== root) chart.zoomTo(node);
  }

  let timer = null;
  search.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      state.query = search.value.trim();
      if (state.query) chart.search(state.query); else { chart.clear(); found.textContent = ""; }
      if (opts.onState) opts.onState({ ...state });
    }, 120);
  });
  search.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    ev.preventDefault();  // zoom into the widest matching frame
    let best = null;
    root.each((n) => {
      if (n.parent && search.value && n.data.n.toLowerCase().includes(search.value.toLowerCase()) &&
          (!best || n.data.v > best.data.v)) best = n;
    });
    if (best) chart.zoomTo(best);
  });
  const zoomOut = () => {
    chart.resetZoom();
    state.zoom = "";
    selected.replaceChildren();
    if (opts.onState) opts.onState({ ...state });
  };
  reset.addEventListener("click", zoomOut);
  container.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") { ev.preventDefault(); zoomOut(); }
  });
  // animate zooms from now on, unless the reader asked for less motion
  if (!matchMedia("(prefers-reduced-motion: reduce)").matches) chart.transitionDuration(200);
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return chart;
}

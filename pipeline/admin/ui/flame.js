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

const SVG = "http://www.w3.org/2000/svg";
const CELL = 18;        // a frame's height (px)
const MIN_FRAME = 2;    // narrower frames (px) are not drawn: unreadable, and most of the DOM
const MIN_LABEL = 35;   // the library shows a frame's name from this width (px)
// d3.ascending on the names: the order the library's sort(true) gave
const byName = (a, b) => (a.n < b.n ? -1 : a.n > b.n ? 1 : 0);
const matches = (name, term) => !!term && name.toLowerCase().includes(term.toLowerCase());

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
 * `base` (what a diff compares with: "base"). Sorts `tree`'s children by name, in place.
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

  // The library builds a d3 hierarchy of every node it is given and lays all of them out
  // on each draw, though it draws only the frames wider than MIN_FRAME: a span's 10 000
  // nodes for ~460 frames. It is given the children of the frames it may draw, in the
  // frame zoomed into (`kids`: of the nodes worth more than `cut`), not their children
  // (the children all, so that each frame keeps its place); a zoom into a frame first
  // adds the nodes it will draw (`grow`). A node's value is still the whole tree's (what
  // is left out included): the widths and the hover shares are unchanged, and the
  // search's figures are taken of the whole tree.
  const cutAt = (value) => value * MIN_FRAME / width * 0.999;
  const sorted = new WeakSet();
  const sortedKids = (d) => {
    if (d.c && !sorted.has(d)) { d.c.sort(byName); sorted.add(d); }
    return d.c;
  };
  let cut = cutAt(total);
  const kids = (d) => (d.v > cut && d.c && d.c.length ? sortedKids(d) : null);
  let zoomed = null;  // the hierarchy node zoomed into (the root: none)
  let nextId = 0;  // the library numbers the nodes of its hierarchy 0..n-1; added ones follow

  /** Add to `top`'s subtree the nodes a zoom into a frame worth `value` may draw. */
  function grow(top, value) {
    cut = cutAt(value);
    top.each((n) => {
      if (n.children || !kids(n.data)) return;
      n.children = n.data.c.map((d) => {
        const k = d3.hierarchy(d, kids);
        k.each((x) => {
          x.depth += n.depth + 1;
          x.id = nextId++;
          x.highlight = matches(x.data.n, state.query);
        });
        k.parent = n;
        return k;
      });
    });
    top.eachAfter((n) => {
      n.height = 0;
      for (const k of n.children || []) n.height = Math.max(n.height, k.height + 1);
    });
    for (let n = top.parent; n; n = n.parent) n.height = Math.max(n.height, top.height + top.depth - n.depth);
  }

  /** The hierarchy node at a path of names (as far as it goes), grown down to it. */
  function nodeAt(names) {
    let node = root;
    for (const name of names) {
      if (!node.children) grow(node, node.data.v);
      const next = (node.children || []).find((k) => k.data.n === name);
      if (!next) break;
      node = next;
    }
    return node;
  }

  /** The path of names to the widest frame whose name matches (breadth first, by name). */
  function widest(term) {
    let best = null;
    const todo = [{ d: tree, up: null }];
    for (let i = 0; i < todo.length; i++) {
      const at = todo[i];
      if (at.up && matches(at.d.n, term) && (!best || at.d.v > best.d.v)) best = at;
      for (const k of sortedKids(at.d) || []) todo.push({ d: k, up: at });
    }
    const names = [];
    for (let at = best; at && at.up; at = at.up) names.push(at.d.n);
    return best && names.reverse();
  }

  /** The search's figures: the frames that match, of the whole tree, and the value under
   * them as the library sums it (of the frames in view: one zoomed out of view adds
   * nothing, one above the zoomed frame adds the zoomed frame's value). */
  function showFound() {
    if (!state.query) { found.textContent = ""; return; }
    let count = 0, sum = 0;
    const todo = [[tree, false, true]];  // node, under a match, in view
    while (todo.length) {
      const [d, under, shown] = todo.pop();
      const hit = matches(d.n, state.query);
      if (hit) {
        count++;
        if (!under && shown) sum += d.fade ? zoomed.data.v : d.v;
      }
      for (const k of d.c || []) {
        todo.push([k, under || hit, shown && !k.hide && (!d.fade || !!k.fade || k === zoomed.data)]);
      }
    }
    found.textContent = `${count} frames match: ${dur(sum)} (${pct(sum / total)})`;
  }

  // no tooltip box (the details line above says it all): each frame's native tooltip
  // (<title>) is made when it is hovered, not for every frame on every draw
  const tooltip = Object.assign(() => {}, {
    show(ev, d) {
      const g = ev.currentTarget;
      let title = g.querySelector(":scope > title");
      if (!title) title = g.insertBefore(document.createElementNS(SVG, "title"), g.lastChild);
      title.textContent = label(d);
    },
    hide() {},
  });

  const chart = flamegraph.default()
    .width(width)
    .cellHeight(CELL)
    .inverted(true)
    .getChildren(kids)
    .sort(false)  // kids gives them by name
    .minFrameSize(MIN_FRAME)
    .transitionDuration(0)
    .tooltip(tooltip)
    .setLabelHandler(label)
    .setDetailsElement(details)
    .setSearchMatch((d, term) => matches(d.data.n, term))
    .setSearchHandler(showFound)
    .onClick((d) => {  // after each zoom (the library's, zoomTo, resetZoom)
      zoomed = d;
      labels();
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

  /** A frame too narrow for its name (most) has no label box at all, where the library
   * only hides the name: fewer boxes to style, lay out and paint. After each draw. */
  function labels() {
    for (const g of chartEl.querySelectorAll("g.frame")) {
      g.lastChild.style.display = +g.getAttribute("width") < MIN_LABEL ? "none" : "";
    }
  }

  d3.select(chartEl).datum(tree).call(chart);
  const root = d3.select(chartEl).datum();  // the hierarchy the chart built
  zoomed = root;
  root.each(() => { nextId++; });

  if (state.query) chart.search(state.query);
  if (state.zoom) {
    const node = nodeAt(state.zoom.split(";"));
    if (node !== root) { grow(node, node.data.v); chart.zoomTo(node); }
  }
  labels();

  // a zoom by click: first the frames it will show (before the library's own handler)
  chartEl.addEventListener("click", (ev) => {
    const g = ev.target.closest("g.frame");
    if (g && g.__data__) grow(g.__data__, g.__data__.data.v);
  }, true);
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
    const names = search.value ? widest(search.value) : null;
    if (!names) return;
    const node = nodeAt(names);
    grow(node, node.data.v);
    chart.zoomTo(node);
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

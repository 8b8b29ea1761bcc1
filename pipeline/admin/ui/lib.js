// Shared helpers of the UI's views: DOM building, number and time formats, the admin API,
// links that hold a view's whole state (the URL's hash is the state: a link is the view).

/** An element: h("a", {href: "#/x", class: "c", onclick: f}, "text", child, ...). */
export function h(tag, attrs = {}, ...children) {
  const el = tag.startsWith("svg:")
    ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** A duration in ns as people read it: 850 µs, 12.3 ms, 1.25 s. */
export function dur(ns) {
  if (ns === null || ns === undefined || Number.isNaN(ns)) return "–";
  const a = Math.abs(ns);
  if (a === 0) return "0 ms";
  if (a < 1e6) return `${(ns / 1e3).toFixed(a < 1e4 ? 1 : 0)} µs`;
  if (a < 1e9) return `${(ns / 1e6).toFixed(a < 1e7 ? 2 : a < 1e8 ? 1 : 0)} ms`;
  return `${(ns / 1e9).toFixed(a < 1e10 ? 2 : 1)} s`;
}

/** Bytes as people read them: 512 B, 4.0 KiB, 12.5 MiB. */
export function size(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return "–";
  const a = Math.abs(bytes);
  for (const [unit, n] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (a >= n) return `${(bytes / n).toFixed(1)} ${unit}`;
  }
  return `${Math.round(bytes)} B`;
}

/** A duration in ns as the API reads it back (``123.457ms``), rounded down or up to µs. */
export function durParam(ns, up = false) {
  const us = up ? Math.ceil(ns / 1e3) : Math.floor(ns / 1e3);
  return `${+(us / 1e3).toFixed(3)}ms`;
}

export const pct = (x) => `${(100 * x).toFixed(x < 0.001 && x > 0 ? 3 : 1)}%`;

/** A unix-ns instant as local date and time to the millisecond. */
export function when(ns) {
  const d = new Date(ns / 1e6);
  const p = (n, w = 2) => String(n).padStart(w, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
    `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`;
}

/** A unix-seconds instant as the ISO time (UTC) the API's ranges take. */
export function iso(s) {
  return new Date(s * 1000).toISOString().slice(0, 19) + "Z";
}

/** An hour around a span, as a range the API takes. */
export function rangeAround(startNs) {
  const mid = Math.floor(startNs / 1e9);
  return `${iso(mid - 1800)}..${iso(mid + 1800)}`;
}

/** The hash link of a view: ``#/route?k=v`` without the empty parameters. */
export function link(route, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return `#/${route}${s ? "?" + s : ""}`;
}

/** Change the current view's state in the URL without rendering it again. */
export function replaceParams(route, params) {
  history.replaceState(history.state, "", link(route, params));
  document.body.dataset.route = location.hash;  // still the view drawn (app.js)
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function setToken(token) {
  if (token) sessionStorage.setItem("spanprof.token", token);
  else sessionStorage.removeItem("spanprof.token");
}

/** GET an admin API answer as JSON; the token the user gave, if any, goes with it. The
 * answers boot.js asked for while the page loaded are taken once, not asked again. */
export async function api(path, params = {}) {
  const url = window.spanprofUrl(path, params);
  let pending = window.spanprofPrefetched.get(url);
  window.spanprofPrefetched.delete(url);
  if (!pending) pending = window.spanprofFetch(url);
  const resp = await pending;
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new ApiError(resp.status, body.error || `${resp.status} ${resp.statusText}`);
  return body;
}

// The attribution methods: how a span's CPU came to it (README: How attribution works)
export const METHODS = {
  "link": { label: "exact", exact: true,
    title: "link: the samples named this span (its profile's link or span_id label)" },
  "link+time": { label: "child", exact: true,
    title: "link+time: samples of the local root placed in this child span by their instant and thread" },
  "link+share": { label: "child ~", exact: false,
    title: "link+share (approximate): samples of the local root shared in its subtree by self time, or placed by their stack among children open at once" },
  "thread": { label: "thread ~", exact: false,
    title: "thread (approximate): unlabelled samples matched by process and thread to the span running then" },
  "window": { label: "window ~", exact: false,
    title: "window (approximate): unlabelled samples shared by the spans of the process open at that instant" },
};

/** Text for HTML: & < > " ' escaped. */
export function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

/** Badges (HTML) for a span's methods (``link,link+time``) and its approximate figures
 * (their ``field``: the span's own CPU, or with its children); an approximate figure of 0
 * is left out. */
export function methodBadgesHtml(method, approximate, field = "cpu_ns") {
  let out = "";
  for (const m of (method || "").split(",").filter(Boolean)) {
    const d = METHODS[m] || { label: m, title: m, exact: false };
    out += `<span class="method ${d.exact ? "exact" : "approx"}" title="${esc(d.title)}" data-method="${esc(m)}">${esc(d.label)}</span>`;
  }
  for (const [m, f] of Object.entries(approximate || {})) {
    if (!f[field]) continue;
    const d = METHODS[m] || { label: m, title: m };
    out += `<span class="method approx" data-method="${esc(m)}" title="${esc(d.title)}; not in the figures shown (method=all adds it)">${esc(d.label)} ${esc(dur(f[field]))}</span>`;
  }
  return out || '<span class="method none" title="no samples joined to this span">no samples</span>';
}

/** The same badges as elements. */
export function methodBadges(method, approximate, field = "cpu_ns") {
  const t = document.createElement("template");
  t.innerHTML = methodBadgesHtml(method, approximate, field);
  return t.content;
}

/** A bar of a span's time: CPU (its own, then its children's) and off-CPU, as shares. */
export function timeBar(durationNs, cpuNs, inclusiveNs) {
  const d = Math.max(durationNs, inclusiveNs, 1);
  const self = cpuNs / d, kids = Math.max(0, inclusiveNs - cpuNs) / d;
  return h("span", { class: "timebar", role: "img",
    "aria-label": `CPU ${pct(self)}, children's CPU ${pct(kids)}, off-CPU ${pct(1 - self - kids)}` },
  h("span", { class: "seg cpu", style: { width: `${100 * self}%` } }),
  h("span", { class: "seg kids", style: { width: `${100 * kids}%` } }));
}

/** Arrow keys, j/k move between the rows a selector finds; Enter opens the focused one. */
export function rowKeys(container, selector, open) {
  container.addEventListener("keydown", (ev) => {
    if (ev.target.closest("input, select, textarea")) return;
    const rows = [...container.querySelectorAll(selector)];
    const i = rows.indexOf(document.activeElement);
    let next = -1;
    if (ev.key === "ArrowDown" || ev.key === "j") next = Math.min(rows.length - 1, i + 1);
    else if (ev.key === "ArrowUp" || ev.key === "k") next = Math.max(0, i - 1);
    else if (ev.key === "Home") next = 0;
    else if (ev.key === "End") next = rows.length - 1;
    else if (ev.key === "Enter" && i >= 0) { ev.preventDefault(); open(rows[i]); return; }
    else return;
    ev.preventDefault();
    if (rows[next]) { rows[next].focus(); rows[next].scrollIntoView({ block: "nearest" }); }
  });
}

/** The choices of the service and operation selects, from /api/v1/operations. */
export function serviceSelects(ops, service, operation, allServices = true) {
  const svc = h("select", { name: "service", id: "f-service" },
    allServices ? h("option", { value: "" }, "all services") : null,
    ops.services.map((s) => h("option", { value: s.name, selected: s.name === service }, s.name)));
  if (service && !ops.services.some((s) => s.name === service)) {
    svc.append(h("option", { value: service, selected: true }, service));
  }
  const op = h("select", { name: "operation", id: "f-operation" });
  const fill = () => {
    op.replaceChildren(h("option", { value: "" }, "all operations"));
    const s = ops.services.find((x) => x.name === svc.value);
    for (const o of s ? s.operations : []) {
      op.append(h("option", { value: o.name, selected: o.name === operation }, `${o.name} (${o.calls})`));
    }
    if (operation && ![...op.options].some((o) => o.value === operation)) {
      op.append(h("option", { value: operation, selected: true }, operation));
    }
  };
  fill();
  svc.addEventListener("change", () => { operation = ""; fill(); });
  return [svc, op];
}

export const RANGES = ["15m", "1h", "6h", "24h", "7d", "2h..1h"];

export function rangeInput(name, value, label) {
  const id = `f-${name}`;
  return [h("label", { for: id }, label),
    h("input", { id, name, value: value || "", list: "ranges", size: 12,
      placeholder: "1h, 2h..1h, ISO..ISO", autocomplete: "off" })];
}

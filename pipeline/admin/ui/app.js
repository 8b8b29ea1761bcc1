// The UI's router: the URL's hash names a view and holds its whole state
// (#/search?service=..., #/trace/ID?span=..., #/span/TRACE/SPAN?children=0, #/operation?...,
// #/function?name=..., #/why?service=...&operation=...&slowest=1%), so every screen is a
// link to share or bookmark. Each view renders
// into <main> and resolves when its data is on screen; then <body data-ready="1"> (what the
// tests and the page-load benchmark wait for).
import { ApiError, h, setToken } from "./lib.js";
import * as fn from "./views/function.js";
import * as operation from "./views/operation.js";
import * as search from "./views/search.js";
import * as span from "./views/span.js";
import * as trace from "./views/trace.js";
import * as why from "./views/why.js";

const VIEWS = { search, trace, span, operation, function: fn, why };
const main = document.getElementById("main");
let generation = 0;

function parse() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?", 2);
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { name: parts[0] || "search", args: parts.slice(1),
    params: Object.fromEntries(new URLSearchParams(query)) };
}

async function route() {
  const mine = ++generation;
  if (mine > 1) window.spanprofPrefetched.clear();  // boot.js's are for the first view only
  const t0 = performance.now();
  document.body.dataset.ready = "0";
  // the URL this view is drawn for: a test waits for ready="1" with its own URL here, not
  // the previous view's ready="1" before the hashchange that replaces it has arrived
  document.body.dataset.route = location.hash;
  const { name, args, params } = parse();
  const view = VIEWS[name] || search;
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.toggleAttribute("aria-current", a.dataset.nav === (["trace", "span", "why"].includes(name) ? "search" : name));
  }
  const root = h("div", { class: `view view-${name}` });
  main.replaceChildren(root);
  try {
    await view.render(root, args, params);
  } catch (err) {
    if (mine !== generation) return;
    root.replaceChildren(errorBox(err));
  }
  if (mine !== generation) return;  // a newer route took over meanwhile
  // readyAt: since the page's navigation began (the page-load benchmark's figure)
  document.body.dataset.readyAt = String(Math.round(performance.now()));
  document.body.dataset.renderMs = String(Math.round(performance.now() - t0));
  document.body.dataset.ready = "1";
}

function errorBox(err) {
  const box = h("div", { class: "error", role: "alert" }, h("strong", {}, "Could not load: "),
    String(err.message || err));
  if (err instanceof ApiError && err.status === 401) {
    const input = h("input", { type: "password", id: "token", autocomplete: "off",
      placeholder: "bearer token" });
    box.append(h("form", { class: "token", onsubmit: (ev) => {
      ev.preventDefault();
      setToken(input.value.trim());
      route();
    } }, h("label", { for: "token" }, "This pipeline checks tokens: "), input,
    h("button", { type: "submit" }, "use token")));
  }
  return box;
}

// the colour scheme: auto (the system's) -> light -> dark
const themeButton = document.getElementById("theme");
function showTheme() {
  themeButton.textContent = `theme: ${document.documentElement.dataset.theme || "auto"}`;
}
themeButton.addEventListener("click", () => {
  const order = ["", "light", "dark"];
  const next = order[(order.indexOf(document.documentElement.dataset.theme || "") + 1) % 3];
  if (next) {
    document.documentElement.dataset.theme = next;
    localStorage.setItem("spanprof.theme", next);
  } else {
    delete document.documentElement.dataset.theme;
    localStorage.removeItem("spanprof.theme");
  }
  showTheme();
});
showTheme();

const help = document.getElementById("help");
const keysButton = document.getElementById("keys");
function toggleHelp(show = help.hidden) {
  help.hidden = !show;
  keysButton.setAttribute("aria-expanded", String(show));
}
keysButton.addEventListener("click", () => toggleHelp());

let pendingG = false;
document.addEventListener("keydown", (ev) => {
  if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
  const typing = ev.target.closest && ev.target.closest("input, select, textarea");
  if (ev.key === "Escape" && !help.hidden) { toggleHelp(false); return; }
  if (typing) return;
  if (ev.key === "?") { toggleHelp(); return; }
  if (ev.key === "/") {
    const target = main.querySelector(".fg-search, [data-slash], input, select");
    if (target) { ev.preventDefault(); target.focus(); }
    return;
  }
  if (pendingG) {
    pendingG = false;
    const to = { t: "#/search", o: "#/operation", f: "#/function" }[ev.key];
    if (to) { location.hash = to; return; }
  }
  if (ev.key === "g") { pendingG = true; setTimeout(() => { pendingG = false; }, 1000); }
});

window.addEventListener("hashchange", route);
route();

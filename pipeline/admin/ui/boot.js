// Runs before anything else (a classic script in <head>), so that the page starts to work
// while its scripts load:
// * the colour scheme the reader chose last time (light, dark), or none to follow the
//   system's (prefers-color-scheme): no flash of the other scheme;
// * the first answers the view in the URL needs are asked for at once (trace, span): the
//   view takes them from `spanprofPrefetched` instead of asking again (lib.js `api`).
//   `spanprofUrl` is the one place that spells an API URL, so both ask for the same.
(function () {
  var t = localStorage.getItem("spanprof.theme");
  if (t === "light" || t === "dark") document.documentElement.dataset.theme = t;

  window.spanprofUrl = function (path, params) {
    var q = new URLSearchParams();
    Object.keys(params || {}).forEach(function (k) {
      var v = params[k];
      if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
    });
    var s = q.toString();
    return "../api/v1/" + path + (s ? "?" + s : "");
  };
  window.spanprofFetch = function (url) {
    var headers = {};
    var token = sessionStorage.getItem("spanprof.token");
    if (token) headers.Authorization = "Bearer " + token;
    return fetch(url, { headers: headers });
  };
  window.spanprofPrefetched = new Map();
  var raw = location.hash.replace(/^#\/?/, "").split("?");
  var parts = raw[0].split("/").map(decodeURIComponent);
  var p = Object.fromEntries(new URLSearchParams(raw[1] || ""));
  var method = p.method || "exact";
  var want = [];
  if (parts[0] === "trace" && parts[1]) {
    want.push(["traces/" + encodeURIComponent(parts[1]), { method: method }]);
  } else if (parts[0] === "span" && parts[1] && parts[2]) {
    want.push(["traces/" + encodeURIComponent(parts[1]) + "/spans/" + encodeURIComponent(parts[2]),
      { method: method }]);
    want.push(["flamegraph", { trace_id: parts[1], span_id: parts[2],
      children: p.children || "1", measure: p.measure || "cpu", method: method, format: "nodes" }]);
  }
  // the flame graph's libraries (300 kB), loaded only by the views that draw one: at once
  // for those, later (flame.js) for the others; by the URLs index.html names them with
  // (their version: taken from the cache without asking the server, which is busy with
  // the view's answers then)
  var libs = document.getElementById("libs");
  var srcs = libs ? Array.prototype.map.call(libs.content.querySelectorAll("script"),
    function (s) { return s.getAttribute("src"); }) : [];
  if (srcs.length !== 2) srcs = ["vendor/d3.min.js", "vendor/d3-flamegraph.umd.min.js"];
  window.spanprofLoadLibs = function () {
    if (!window.spanprofLibs) {
      window.spanprofLibs = srcs.map(function (src) {
        return new Promise(function (resolve, reject) {
          var el = document.createElement("script");
          el.src = src;
          el.async = false;  // in order: d3-flame-graph needs d3
          el.onload = resolve;
          el.onerror = function () { reject(new Error(src + ": could not load")); };
          document.head.appendChild(el);
        });
      });
    }
    return Promise.all(window.spanprofLibs);
  };
  if (parts[0] === "span" || parts[0] === "operation") window.spanprofLoadLibs();
  want.forEach(function (w) {
    var url = window.spanprofUrl(w[0], w[1]);
    var got = window.spanprofFetch(url);
    got.catch(function () {});  // the view reports the error when it takes the answer
    window.spanprofPrefetched.set(url, got);
  });
})();

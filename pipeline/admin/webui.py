"""The web UI (issue #18): its files, served under ``/ui`` by the admin listener, and the
flame graph trees its views draw.

The UI is plain ES modules, CSS and two vendored libraries (``ui/vendor/VENDORED.md``):
no build step, nothing fetched from elsewhere, so it works air-gapped. The files are read
once when the listener starts and served from memory under a fixed list of paths (no
path from a request ever reaches the file system), with an ``ETag`` so that a browser
revalidates them (``304``) rather than loading them again, and a Content-Security-Policy
that lets a page load nothing but this listener's own files and answers.

The files index.html names (boot.js, app.js, the stylesheets, the vendored libraries) are
named there with their version (``boot.js?v=<ETag>``, rewritten when the files are read),
and the modules app.js imports through an import map index.html holds (``./lib.js`` ->
``./lib.js?v=<ETag>``); a request naming a file's current version is answered as never
changing (``immutable``): a browser that has it runs it without asking again, so a page's
first API call no longer waits for boot.js's revalidation (it went out 10-15 ms earlier
here), and the server, busy with the view's answers, is not asked for eight modules again
on each load; a new version is a new URL. index.html itself is revalidated on each load.
The import map is an inline script: the policy allows it by its hash alone.

The files hold no data, so they are served without a token when the listener checks
tokens (``open_paths``); the UI sends the token the user gives it with each API call.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from aiohttp import web

PREFIX = "/ui"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
          ".md": "text/markdown", ".svg": "image/svg+xml", ".png": "image/png"}
# the page may load this listener's files and answers only (no CDN, no inline script but
# index.html's import map, by its hash); styles: d3 sets element styles and d3-flame-graph
# adds its stylesheet from script
_CSP = ("default-src 'none'; script-src 'self'{hashes}; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'")


class StaticUi:
    """The UI's files, read from the package (``pipeline/admin/ui``) at construction."""

    def __init__(self, root: Traversable | None = None) -> None:
        self.files: dict[str, tuple[bytes, str, str]] = {}  # path -> body, type, etag
        self.csp = _CSP.format(hashes="")
        todo = [(root or resources.files("pipeline.admin") / "ui", "")]
        while todo:
            node, rel = todo.pop()
            for child in node.iterdir():
                name = f"{rel}{child.name}"
                if child.is_dir():
                    todo.append((child, name + "/"))
                elif not child.name.startswith("."):
                    body = child.read_bytes()
                    suffix = "." + child.name.rpartition(".")[2] if "." in child.name else ""
                    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
                    self.files[name] = (body, _TYPES.get(suffix, "text/plain"), etag)
        if "index.html" in self.files:
            self._version_index()

    def _version_index(self) -> None:
        """index.html with each of the UI's files it names as ``name?v=<its ETag>``."""
        body, ctype, _ = self.files["index.html"]
        text = body.decode()
        modules = {}
        for name, (_, _, etag) in self.files.items():
            version = etag.strip('"')
            named = False
            for attr in ("src", "href"):
                named |= f'{attr}="{name}"' in text
                text = text.replace(f'{attr}="{name}"', f'{attr}="{name}?v={version}"')
            if name.endswith(".js") and not named and not name.startswith("vendor/"):
                modules[f"./{name}"] = f"./{name}?v={version}"
        # before the first module script: a map must be known before any module loads
        imap = json.dumps({"imports": dict(sorted(modules.items()))}, indent=1)
        at = text.find('<script type="module"')
        if modules and at >= 0:
            text = f'{text[:at]}<script type="importmap">{imap}</script>\n{text[at:]}'
            digest = base64.b64encode(hashlib.sha256(imap.encode()).digest()).decode()
            self.csp = _CSP.format(hashes=f" 'sha256-{digest}'")
        body = text.encode()
        self.files["index.html"] = (body, ctype,
                                    '"' + hashlib.sha256(body).hexdigest()[:20] + '"')

    @property
    def open_paths(self) -> tuple[str, ...]:
        return (PREFIX, PREFIX + "/", *(f"{PREFIX}/{p}" for p in self.files))

    def routes(self, app: web.Application) -> None:
        app.router.add_get(PREFIX, self.redirect)
        app.router.add_get(PREFIX + "/{path:.*}", self.serve)

    async def redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(PREFIX + "/")

    async def serve(self, request: web.Request) -> web.Response:
        path = request.match_info["path"] or "index.html"
        got = self.files.get(path)
        if got is None:
            return web.Response(status=404, text=f"{PREFIX}/{path[:200]}: no such file")
        body, ctype, etag = got
        # the current version named: it never changes under this URL
        fresh = request.query.get("v") == etag.strip('"')
        headers = {"ETag": etag,
                   "Cache-Control": "max-age=31536000, immutable" if fresh else "no-cache",
                   "X-Content-Type-Options": "nosniff", "Content-Security-Policy": self.csp,
                   "Referrer-Policy": "no-referrer"}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        charset = "utf-8" if ctype.startswith("text/") or ctype.endswith("+xml") else None
        return web.Response(body=body, content_type=ctype, charset=charset, headers=headers)


def flame_tree(nodes: Iterable[tuple[int, int, str, int]], total: int,
               base: dict[int, int] | None = None, base_total: int = 0,
               scale: float = 1.0) -> dict[str, Any]:
    """Flame graph nodes (``queries._flame``: hash, parent's hash (0 under the root), frame,
    value) as the nested tree d3-flame-graph draws: ``{"n": name, "v": inclusive value,
    "c": [children sorted by name]}`` under a root ``all`` worth ``total``. With ``base``
    (hash -> value in the base, worth ``base_total`` in all), a differential tree: each
    node also has ``"d"``, its value less the base's times ``scale`` (e.g. calls now /
    calls then: per call). Nodes whose parent is not among them are left out (the query
    keeps whole trees). No recursion: trees can be deeper than Python's stack."""
    root: dict[str, Any] = {"n": "all", "v": total}
    if base is not None:
        root["d"] = total - round(base_total * scale)
    kids: dict[int, list[tuple[str, int, int]]] = {}
    for h, up, name, value in nodes:
        kids.setdefault(up, []).append((name, h, value))
    todo: list[tuple[int, dict[str, Any]]] = [(0, root)]
    while todo:
        h, parent = todo.pop()
        children = kids.get(h)
        if not children:
            continue
        out = []
        for name, ch, value in sorted(children):
            node: dict[str, Any] = {"n": name, "v": value}
            if base is not None:
                node["d"] = value - round(base.get(ch, 0) * scale)
            out.append(node)
            todo.append((ch, node))
        parent["c"] = out
    return root


def flame_nodes(nodes: Iterable[tuple[int, int, str, int]], total: int,
                base: dict[int, int] | None = None, base_total: int = 0,
                scale: float = 1.0) -> dict[str, Any]:
    """The same flame graph as ``flame_tree``, in the compact form the UI reads
    (``format=nodes``): ``frames``, each name once, and ``nodes``, four numbers per node
    in one flat list: its parent's position in the list (-1: the root ``all``, worth
    ``total``), its frame's position in ``frames``, its value, and with ``base`` its
    difference (``flame_tree``'s ``d``; else 0). Parents come before their children (the
    query's order: by value, then depth); a node whose parent is not among them is left
    out. A third of the tree's JSON, no object per node to build here or to parse there:
    a span's 10 000 frames took 12-50 ms as a tree in Python."""
    frames: dict[str, int] = {}
    at: dict[int, int] = {0: -1}
    flat: list[int] = []
    for h, up, name, value in nodes:
        parent = at.get(up)
        if parent is None:
            continue
        at[h] = len(flat) // 4
        fi = frames.setdefault(name, len(frames))
        d = value - round(base.get(h, 0) * scale) if base is not None else 0
        flat += (parent, fi, value, d)
    out: dict[str, Any] = {"total": total, "frames": list(frames), "nodes": flat}
    if base is not None:
        out["total_d"] = total - round(base_total * scale)
    return out


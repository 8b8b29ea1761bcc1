"""Admin HTTP API of a running pipeline (read-only).

The embedded engine can be opened by one process only, so questions about the data go to
the running pipeline, which asks ClickHouse on its own connection::

    GET /health                                   200 {"status": "ok"} / 503 stopping, failed
    GET /metrics                                  Prometheus text
    GET /api/v1/spans?order=cpu|inclusive|duration|off_cpu&limit=N&service=S&method=M
    GET /api/v1/traces/{trace_id}?method=M
    GET /api/v1/functions?service=S&operation=O&since=1h&limit=N    functions by self CPU
    GET /api/v1/diff?service=S&operation=O&before=2h..1h&after=1h  which got more expensive
    GET /api/v1/stacks?trace_id=T&span_id=S | ?service=S&operation=O&since=1h   flame graph

``method``: ``exact`` (link + link+time, the default), ``all``, or a comma-separated list.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import msgspec
import structlog
from aiohttp import web

from pipeline.admin import queries
from pipeline.graph import Graph
from pipeline.receivers.http import serve

MAX_LIMIT = 10_000


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)


class AdminServer:
    def __init__(self, endpoint: str, graph: Graph, query_exporter: str = "") -> None:
        self.endpoint = endpoint
        self.graph = graph
        self.log = structlog.get_logger().bind(component="admin")
        exporters = {k: v for k, v in graph.components("exporter").items()
                     if hasattr(v, "query")}
        self.db = exporters.get(query_exporter) if query_exporter else \
            next(iter(exporters.values()), None)
        self.stopping = False
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/v1/spans", self.spans)
        app.router.add_get("/api/v1/traces/{trace_id}", self.trace)
        app.router.add_get("/api/v1/functions", self.functions)
        app.router.add_get("/api/v1/diff", self.diff)
        app.router.add_get("/api/v1/stacks", self.stacks)
        host, _, port = self.endpoint.rpartition(":")
        self._runner, self.port = await serve(app, f"{host or '127.0.0.1'}:{port}",
                                              "service.admin.endpoint")
        self.log.info("admin_listening", endpoint=self.endpoint, port=self.port)

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        if self.stopping:
            return _json({"status": "stopping", "pid": os.getpid()}, status=503)
        # a component whose own loop died (``failed``) makes the process unhealthy, so
        # that an orchestrator restarts it rather than it idling with a 200
        failed = {key: f for key, node in self.graph.nodes.items()
                  if (f := getattr(node.component, "failed", None))}
        if failed:
            return _json({"status": "failed", "pid": os.getpid(), "failed": failed},
                         status=503)
        return _json({"status": "ok", "pid": os.getpid()})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = []
        for key, node in self.graph.nodes.items():
            kind, cid = key.split(":", 1)
            comp = node.component
            counters: dict[str, int] = dict(getattr(comp, "metrics", {}) or {})
            state = getattr(comp, "state", None)
            if state is not None and hasattr(state, "stats"):
                counters.update(dataclasses.asdict(state.stats))
            for name, value in sorted(counters.items()):
                base, _, table = name.partition(".")
                labels = f'{kind}="{cid}"' + (f',table="{table}"' if table else "")
                lines.append(f"spanprof_{kind}_{base}_total{{{labels}}} {value}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _db(self) -> Any:
        assert self.db is not None
        return self.db

    def _database(self) -> str:
        assert self.db is not None
        return str(self.db.cfg.database)

    async def spans(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            order = q.get("order", "cpu")
            if order not in ("cpu", "inclusive", "duration", "off_cpu"):
                raise _BadRequest("order: expected cpu, inclusive, duration or off_cpu")
            queries.methods_of(q.get("method", "exact"))  # ValueError -> 400, before limit
            return {"spans": await queries.top_spans(
                self._db(), self._database(), order=order, limit=_limit(q),
                service=q.get("service") or None, method=q.get("method", "exact"))}
        return await self._answer(request, work)

    async def _answer(self, request: web.Request, work: Any) -> web.Response:
        if self.db is None:
            return _error(404, "no clickhouse exporter in this pipeline: nothing to query")
        try:
            return _json(await work(request.query, time.time()))
        except (_BadRequest, ValueError) as err:
            return _error(400, str(err))

    async def functions(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            rng = queries.parse_range(_param(q, "since") or "1h", now)
            return await queries.functions(
                self._db(), self._database(), str(_param(q, "service", True)),
                _param(q, "operation"), rng, limit=_limit(q), method=q.get("method", "exact"))
        return await self._answer(request, work)

    async def diff(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            before = queries.parse_range(str(_param(q, "before", True)), now)
            after = queries.parse_range(str(_param(q, "after", True)), now)
            return await queries.diff(
                self._db(), self._database(), str(_param(q, "service", True)),
                _param(q, "operation"), before, after, limit=_limit(q),
                method=q.get("method", "exact"))
        return await self._answer(request, work)

    async def stacks(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            tid, sid = _param(q, "trace_id"), _param(q, "span_id")
            if tid or sid:
                if not (tid and queries.HEX32.match(tid.lower())):
                    raise _BadRequest("trace_id: expected 32 hex characters")
                if not (sid and len(sid) == 16):
                    raise _BadRequest("span_id: expected 16 hex characters")
                return await queries.span_stacks(self._db(), self._database(), tid.lower(),
                                                 sid.lower(), method=q.get("method", "exact"))
            rng = queries.parse_range(_param(q, "since") or "1h", now)
            return await queries.operation_stacks(
                self._db(), self._database(), str(_param(q, "service", True)),
                _param(q, "operation"), rng, method=q.get("method", "exact"))
        return await self._answer(request, work)

    async def trace(self, request: web.Request) -> web.Response:
        if self.db is None:
            return _error(404, "no clickhouse exporter in this pipeline: nothing to query")
        tid = request.match_info["trace_id"].lower()
        if not queries.HEX32.match(tid):
            return _error(400, "trace_id: expected 32 hex characters")
        try:
            method = request.query.get("method", "exact")
            queries.methods_of(method)
        except ValueError as err:
            return _error(400, str(err))
        result = await queries.trace(self.db, self._database(), tid, method=method)
        if not result["spans"]:
            return _error(404, f"trace {tid} not found")
        return _json(result)


def _limit(q: Any) -> int:
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise _BadRequest("limit: expected an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise _BadRequest(f"limit: expected 1..{MAX_LIMIT}")
    return limit


class _BadRequest(Exception):
    pass


def _param(q: Any, name: str, required: bool = False) -> str | None:
    v = q.get(name) or None
    if required and v is None:
        raise _BadRequest(f"{name}: required")
    return str(v) if v is not None else None

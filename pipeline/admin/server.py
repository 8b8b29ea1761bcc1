"""Admin HTTP API of a running pipeline (read-only, but for backfill jobs).

The embedded engine can be opened by one process only, so questions about the data go to
the running pipeline, which asks ClickHouse on its own connection::

    GET /health                                   200 {"status": "ok"} / 503 stopping, failed
    GET /metrics                                  Prometheus text
    GET /api/v1/spans?order=cpu|inclusive|duration|off_cpu|lock|alloc&limit=N&service=S&method=M
    GET /api/v1/traces/{trace_id}?method=M
    GET /api/v1/functions?service=S&operation=O&since=1h&limit=N    functions by self CPU
    GET /api/v1/diff?service=S&operation=O&before=2h..1h&after=1h  which got more expensive
    GET /api/v1/stacks?trace_id=T&span_id=S | ?service=S&operation=O&since=1h   flame graph
    GET /api/v1/why?service=S&operation=O&range=1h&slowest=1%|slower_than=1s[&stacks=1]  tail
    POST /api/v1/backfill, GET /api/v1/backfill/{job}   backfill jobs (admin/backfill.py)

For the web UI (``/ui``: admin/webui.py serves it, admin/ui_api.py answers; issue #18)::

    GET /api/v1/operations?range=1h                 services and operations with calls
    GET /api/v1/search?service=S&operation=O&range=1h&min_duration=250ms&max_duration=2s
        &min_cpu=10ms&order=duration|cpu|self_cpu|off_cpu&limit=N    calls (spans)
    GET /api/v1/traces/{trace_id}/spans/{span_id}?method=M   one span, as in its trace
    GET /api/v1/histogram?service=S&operation=O&range=1h&buckets=40   durations, p50/90/99
    GET /api/v1/function_spans?function=F&service=S&operation=O&range=1h&order=cpu|wall
        &limit=N&method=M                           spans and traces that burnt F most
    GET /api/v1/flamegraph?trace_id=T&span_id=S&children=1|0&measure=cpu|wall&method=M
        | ?service=S&operation=O&range=1h[&base=2h..1h]   a tree; with base, per-call deltas
        &max_nodes=N (10000; at most 100000): the largest frames drawn, the rest counted
    GET /ui/...                                     the UI's files (no token needed)

``method``: ``exact`` (link + link+time, the default), ``all``, or a comma-separated list.

Each answer is one tenant's (``params.tenant_of``): the one the request's token maps to when the
listener checks tokens, else the one ``X-Scope-OrgID`` names, else the default tenant
(``request[TENANT]``, set by pipeline/receivers/authn.py; with a token, a header naming
another tenant is refused there). Only tokens of ``admin_tenants`` read ``/metrics``.

Every parameter is checked before a query runs, and a bad one is a 400 naming it: ranges
outside 1970..2106 (ClickHouse ``DateTime``) or reversed, ``limit`` outside 1..10000,
ids that are not 32 / 16 hex characters, service and operation names with control
characters, NUL or lone surrogates or over 1024 characters. A 500 is a server fault only,
logged as ``http_handler_failed``. Connection limits are those of
pipeline/receivers/http.py (``ServerLimits``), set from ``service.admin``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from typing import Any

import structlog
from aiohttp import web

from pipeline.admin import function_queries, params, queries, webui, why
from pipeline.admin.backfill import BackfillJobs
from pipeline.admin.querier import Querier
from pipeline.admin.ui_api import UiApi
from pipeline.auth import TokenAuth
from pipeline.config.tls import TlsConfig
from pipeline.graph import Graph
from pipeline.log import redact
from pipeline.looplag import LoopLag
from pipeline.receivers.authn import TENANT
from pipeline.receivers.http import ServerLimits, serve


class AdminServer:
    def __init__(self, endpoint: str, graph: Graph, query_exporter: str = "",
                 limits: ServerLimits | None = None, loop_lag: LoopLag | None = None,
                 tls: TlsConfig | None = None, auth: TokenAuth | None = None) -> None:
        self.endpoint = endpoint
        self.auth = auth  # all but /health (orchestrators' probes) need a token
        self.tls = tls
        self.loop_lag = loop_lag
        self.limits = limits or ServerLimits()
        self.guard_metrics: Counter[str] = Counter()  # the listener's guards
        self.graph = graph
        self.log = structlog.get_logger().bind(component="admin")
        exporters = {k: v for k, v in graph.components("exporter").items()
                     if hasattr(v, "query")}
        self.db = exporters.get(query_exporter) if query_exporter else \
            next(iter(exporters.values()), None)
        self.stopping = False
        self.backfill: BackfillJobs | None = None
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
        app.router.add_get("/api/v1/why", self.why)
        UiApi(self._answer, self._db, self._database).routes(app)
        Querier(lambda: self.db, self._database).routes(app)  # Grafana (querier.py)
        ui = webui.StaticUi()
        ui.routes(app)
        if self.db is not None:
            self.backfill = BackfillJobs(self.db, self.auth)
            self.backfill.routes(app)
        host, _, port = self.endpoint.rpartition(":")
        self._runner, self.port = await serve(
            app, f"{host or '127.0.0.1'}:{port}", "service.admin.endpoint", self.limits,
            self.guard_metrics, self.log, tls=self.tls, auth=self.auth,
            open_paths=("/health", *ui.open_paths))
        self.log.info("admin_listening", endpoint=self.endpoint, port=self.port,
                      tls=self.tls is not None)

    async def stop_jobs(self) -> None:
        if self.backfill is not None:
            await self.backfill.stop()

    async def shutdown(self) -> None:
        await self.stop_jobs()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        if self.stopping:
            return params.json_response({"status": "stopping", "pid": os.getpid()}, status=503)
        # a component whose own loop died (``failed``) makes the process unhealthy, so
        # that an orchestrator restarts it rather than it idling with a 200
        failed = {key: redact(str(f)) for key, node in self.graph.nodes.items()
                  if (f := getattr(node.component, "failed", None))}
        if failed:
            return params.json_response({"status": "failed", "pid": os.getpid(), "failed": failed},
                         status=503)
        return params.json_response({"status": "ok", "pid": os.getpid()})

    async def metrics(self, request: web.Request) -> web.Response:
        # every tenant's counters: with auth on, for the admin role only
        if self.auth is not None and not self.auth.is_admin(request[TENANT]):
            return params.error_response(
                403, "/metrics: the token's tenant does not have the admin role "
                "(extensions.<tenantauth>.admin_tenants)")
        lines = []
        for key, node in self.graph.nodes.items():
            kind, cid = key.split(":", 1)
            comp = node.component
            counters: dict[str, int] = dict(getattr(comp, "metrics", {}) or {})
            if callable(stats := getattr(comp, "stats", None)):  # a correlator's, summed
                counters.update(dataclasses.asdict(stats()))
            for name, value in sorted(counters.items()):
                base, _, table = name.partition(".")
                labels = f'{kind}="{cid}"' + (f',table="{table}"' if table else "")
                lines.append(f"spanprof_{kind}_{base}_total{{{labels}}} {value}")
            # what a correlator holds per tenant (entries: what max_entries bounds)
            for tenant, state in sorted((getattr(comp, "states", None) or {}).items()):
                for gauge in ("entries", "bytes"):
                    lines.append(f'spanprof_{kind}_state_{gauge}{{{kind}="{cid}",'
                                 f'tenant="{tenant}"}} {getattr(state, gauge)}')
        for tenant, counts in sorted(self.graph.tenants.counters().items()):
            for name, value in sorted(counts.items()):
                lines.append(f'spanprof_tenant_{name}_total{{tenant="{tenant}"}} {value}')
        for name, value in sorted(self.guard_metrics.items()):  # this listener's own
            lines.append(f"spanprof_admin_{name}_total {value}")
        if self.loop_lag is not None:
            lines.extend(self.loop_lag.prometheus())
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
            if order not in queries.TOP_ORDERS:
                raise params.BadRequest(f"order: expected one of {', '.join(queries.TOP_ORDERS)}")
            method, limit, service = params.method(q), params.limit(q), params.text(q, "service")
            return {"spans": await queries.top_spans(
                self._db(), self._database(), order=order, limit=limit, service=service,
                method=method, tenant=params.tenant_of(request))}
        return await self._answer(request, work)

    async def _answer(self, request: web.Request, work: Any) -> web.Response:
        """``work``'s answer as JSON; 400 for a bad parameter (``params.BadRequest``, raised
        before any query runs). Anything else is a server fault: the app's middleware
        logs it and answers 500."""
        if self.db is None:
            return params.error_response(
                404, "no clickhouse exporter in this pipeline: nothing to query")
        try:
            return params.json_response(await work(request.query, time.time()))
        except params.BadRequest as err:
            return params.error_response(400, str(err))

    async def functions(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = str(params.text(q, "service", True)), params.text(q, "operation")
            rng = params.time_range(q, "since", now, "1h")
            limit, method = params.limit(q), params.method(q)
            return await function_queries.functions(self._db(), self._database(), service,
                                                    operation, rng, limit=limit, method=method,
                                                    tenant=params.tenant_of(request))
        return await self._answer(request, work)

    async def diff(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = str(params.text(q, "service", True)), params.text(q, "operation")
            before, after = params.time_range(q, "before", now), params.time_range(q, "after", now)
            limit, method = params.limit(q), params.method(q)
            return await function_queries.diff(self._db(), self._database(), service, operation,
                                               before, after, limit=limit, method=method,
                                               tenant=params.tenant_of(request))
        return await self._answer(request, work)

    async def stacks(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            method = params.method(q)
            tid, sid = params.param(q, "trace_id"), params.param(q, "span_id")
            if tid or sid:
                tid, sid = params.hex_id(tid, "trace_id", 32), params.hex_id(sid, "span_id", 16)
                return await function_queries.span_stacks(
                    self._db(), self._database(), tid, sid, method=method,
                    tenant=params.tenant_of(request))
            service, operation = str(params.text(q, "service", True)), params.text(q, "operation")
            rng = params.time_range(q, "since", now, "1h")
            return await function_queries.operation_stacks(
                self._db(), self._database(), service, operation, rng, method=method,
                tenant=params.tenant_of(request))
        return await self._answer(request, work)

    async def why(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service = str(params.text(q, "service", True))
            operation = str(params.text(q, "operation", True))
            rng = params.time_range(q, "range", now, "1h")
            limit, method = params.limit(q), params.method(q)
            slowest, slower_than = params.tail_rule(q)
            return await why.why(self._db(), self._database(), service, operation, rng,
                                 slowest=slowest, slower_than_ns=slower_than, method=method,
                                 limit=limit, stacks=q.get("stacks") in ("1", "true"),
                                 tenant=params.tenant_of(request))
        return await self._answer(request, work)

    async def trace(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            tid = params.hex_id(request.match_info["trace_id"], "trace_id", 32)
            result = await queries.trace(self._db(), self._database(), tid, method=params.method(q),
                                         tenant=params.tenant_of(request))
            if not result["spans"]:
                raise params.NotFound(f"trace {tid} not found")
            return result
        try:
            return await self._answer(request, work)
        except params.NotFound as err:
            return params.error_response(404, str(err))


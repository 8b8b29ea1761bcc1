"""Admin HTTP API of a running pipeline (read-only, but for backfill jobs).

The embedded engine can be opened by one process only, so questions about the data go to
the running pipeline, which asks ClickHouse on its own connection::

    GET /health                                   200 {"status": "ok"} / 503 stopping, failed
    GET /metrics                                  Prometheus text
    GET /api/v1/spans?order=cpu|inclusive|duration|off_cpu&limit=N&service=S&method=M
    GET /api/v1/traces/{trace_id}?method=M
    GET /api/v1/functions?service=S&operation=O&since=1h&limit=N    functions by self CPU
    GET /api/v1/diff?service=S&operation=O&before=2h..1h&after=1h  which got more expensive
    GET /api/v1/stacks?trace_id=T&span_id=S | ?service=S&operation=O&since=1h   flame graph
    GET /api/v1/why?service=S&operation=O&range=1h&slowest=1%|slower_than=1s[&stacks=1]  tail
    POST /api/v1/backfill, GET /api/v1/backfill/{job}   backfill jobs (admin/backfill.py)

For the web UI (``/ui``, admin/webui.py, issue #18)::

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

Each answer is one tenant's (``_tenant``): the one the request's token maps to when the
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

import msgspec
import structlog
from aiohttp import web

from pipeline.admin import queries, ui_queries, webui, why
from pipeline.admin.backfill import BackfillJobs
from pipeline.auth import TokenAuth
from pipeline.config import Duration
from pipeline.config.tls import TlsConfig
from pipeline.graph import Graph
from pipeline.log import redact
from pipeline.looplag import LoopLag
from pipeline.receivers.authn import TENANT
from pipeline.receivers.http import ServerLimits, serve
from pipeline.records import DEFAULT_TENANT

MAX_LIMIT = 10_000
MAX_TEXT = 1024  # characters in a service or operation name


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": redact(message)}, status=status)


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
        app.router.add_get("/api/v1/operations", self.operations)
        app.router.add_get("/api/v1/search", self.search)
        app.router.add_get("/api/v1/histogram", self.histogram)
        app.router.add_get("/api/v1/function_spans", self.function_spans)
        app.router.add_get("/api/v1/flamegraph", self.flamegraph)
        app.router.add_get("/api/v1/traces/{trace_id}/spans/{span_id}", self.span)
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
            return _json({"status": "stopping", "pid": os.getpid()}, status=503)
        # a component whose own loop died (``failed``) makes the process unhealthy, so
        # that an orchestrator restarts it rather than it idling with a 200
        failed = {key: redact(str(f)) for key, node in self.graph.nodes.items()
                  if (f := getattr(node.component, "failed", None))}
        if failed:
            return _json({"status": "failed", "pid": os.getpid(), "failed": failed},
                         status=503)
        return _json({"status": "ok", "pid": os.getpid()})

    async def metrics(self, request: web.Request) -> web.Response:
        # every tenant's counters: with auth on, for the admin role only
        if self.auth is not None and not self.auth.is_admin(request[TENANT]):
            return _error(403, "/metrics: the token's tenant does not have the admin role "
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
            if order not in ("cpu", "inclusive", "duration", "off_cpu"):
                raise _BadRequest("order: expected cpu, inclusive, duration or off_cpu")
            method, limit, service = _method(q), _limit(q), _text(q, "service")
            return {"spans": await queries.top_spans(
                self._db(), self._database(), order=order, limit=limit, service=service,
                method=method, tenant=_tenant(request))}
        return await self._answer(request, work)

    async def _answer(self, request: web.Request, work: Any) -> web.Response:
        """``work``'s answer as JSON; 400 for a bad parameter (``_BadRequest``, raised
        before any query runs). Anything else is a server fault: the app's middleware
        logs it and answers 500."""
        if self.db is None:
            return _error(404, "no clickhouse exporter in this pipeline: nothing to query")
        try:
            return _json(await work(request.query, time.time()))
        except _BadRequest as err:
            return _error(400, str(err))

    async def functions(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = str(_text(q, "service", True)), _text(q, "operation")
            rng, limit, method = _range(q, "since", now, "1h"), _limit(q), _method(q)
            return await queries.functions(self._db(), self._database(), service, operation,
                                           rng, limit=limit, method=method,
                                           tenant=_tenant(request))
        return await self._answer(request, work)

    async def diff(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = str(_text(q, "service", True)), _text(q, "operation")
            before, after = _range(q, "before", now), _range(q, "after", now)
            limit, method = _limit(q), _method(q)
            return await queries.diff(self._db(), self._database(), service, operation,
                                      before, after, limit=limit, method=method,
                                      tenant=_tenant(request))
        return await self._answer(request, work)

    async def stacks(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            method = _method(q)
            tid, sid = _param(q, "trace_id"), _param(q, "span_id")
            if tid or sid:
                tid, sid = _hex_id(tid, "trace_id", 32), _hex_id(sid, "span_id", 16)
                return await queries.span_stacks(self._db(), self._database(), tid, sid,
                                                 method=method, tenant=_tenant(request))
            service, operation = str(_text(q, "service", True)), _text(q, "operation")
            rng = _range(q, "since", now, "1h")
            return await queries.operation_stacks(self._db(), self._database(), service,
                                                  operation, rng, method=method,
                                                  tenant=_tenant(request))
        return await self._answer(request, work)

    async def why(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service = str(_text(q, "service", True))
            operation = str(_text(q, "operation", True))
            rng, limit, method = _range(q, "range", now, "1h"), _limit(q), _method(q)
            slowest, slower_than = _tail_rule(q)
            return await why.why(self._db(), self._database(), service, operation, rng,
                                 slowest=slowest, slower_than_ns=slower_than, method=method,
                                 limit=limit, stacks=q.get("stacks") in ("1", "true"),
                                 tenant=_tenant(request))
        return await self._answer(request, work)

    async def operations(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            return await ui_queries.operations(self._db(), self._database(),
                                            _range(q, "range", now, "1h"),
                                            tenant=_tenant(request))
        return await self._answer(request, work)

    async def search(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = _text(q, "service"), _text(q, "operation")
            order = _choice(q, "order", tuple(ui_queries.SEARCH_ORDERS), "duration")
            rng, limit = _range(q, "range", now, "1h"), _limit(q)
            return await ui_queries.search_calls(
                self._db(), self._database(), rng, service=service, operation=operation,
                min_duration_ns=_duration_ns(q, "min_duration", 0),
                max_duration_ns=_duration_ns(q, "max_duration", ui_queries.MAX_NS),
                min_cpu_ns=_duration_ns(q, "min_cpu", 0), order=order, limit=limit,
                tenant=_tenant(request))
        return await self._answer(request, work)

    async def histogram(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = str(_text(q, "service", True)), _text(q, "operation")
            buckets = _int(q, "buckets", 1, 200, 40)
            return await ui_queries.duration_histogram(
                self._db(), self._database(), service, operation,
                _range(q, "range", now, "1h"), buckets, tenant=_tenant(request))
        return await self._answer(request, work)

    async def function_spans(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            function = str(_text(q, "function", True))
            service, operation = _text(q, "service"), _text(q, "operation")
            order = _choice(q, "order", ("cpu", "wall"), "cpu")
            rng, limit, method = _range(q, "range", now, "1h"), _limit(q), _method(q)
            return await ui_queries.function_spans(
                self._db(), self._database(), function, rng, service=service,
                operation=operation, order=order, limit=limit, method=method,
                tenant=_tenant(request))
        return await self._answer(request, work)

    async def flamegraph(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            method, tenant = _method(q), _tenant(request)
            max_nodes = _int(q, "max_nodes", 1, ui_queries.MAX_FLAME_NODES, 10_000)
            tid, sid = _param(q, "trace_id"), _param(q, "span_id")
            if tid or sid:
                tid, sid = _hex_id(tid, "trace_id", 32), _hex_id(sid, "span_id", 16)
                children = _choice(q, "children", ("1", "0", "true", "false"), "1")
                measure = _choice(q, "measure", ("cpu", "wall"), "cpu")
                got = await ui_queries.span_flame(
                    self._db(), self._database(), tid, sid, children=children in ("1", "true"),
                    measure=measure, method=method, max_nodes=max_nodes, tenant=tenant)
                return _flame_answer(got)
            service, operation = str(_text(q, "service", True)), _text(q, "operation")
            rng = _range(q, "range", now, "1h")
            base = _range(q, "base", now) if _param(q, "base") else None
            return _flame_answer(await ui_queries.operation_flame(
                self._db(), self._database(), service, operation, rng, base=base,
                method=method, max_nodes=max_nodes, tenant=tenant))
        return await self._answer(request, work)

    async def span(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            tid = _hex_id(request.match_info["trace_id"], "trace_id", 32)
            sid = _hex_id(request.match_info["span_id"], "span_id", 16)
            result = await ui_queries.span(self._db(), self._database(), tid, sid,
                                        method=_method(q), tenant=_tenant(request))
            if result is None:
                raise _NotFound(f"span {sid} of trace {tid} not found")
            return result
        try:
            return await self._answer(request, work)
        except _NotFound as err:
            return _error(404, str(err))

    async def trace(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            tid = _hex_id(request.match_info["trace_id"], "trace_id", 32)
            result = await queries.trace(self._db(), self._database(), tid, method=_method(q),
                                         tenant=_tenant(request))
            if not result["spans"]:
                raise _NotFound(f"trace {tid} not found")
            return result
        try:
            return await self._answer(request, work)
        except _NotFound as err:
            return _error(404, str(err))


def _tenant(request: web.Request) -> str:
    """Whose data a request may see: what the listener's middleware resolved (``authn``):
    the tenant its token maps to with auth on, else ``X-Scope-OrgID``'s or the default
    tenant. A ``tenant`` query parameter is never read."""
    return request.get(TENANT) or DEFAULT_TENANT


def _limit(q: Any) -> int:
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise _BadRequest("limit: expected an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise _BadRequest(f"limit: expected 1..{MAX_LIMIT}")
    return limit


class _BadRequest(Exception):
    """A query parameter is wrong: 400, its message names the parameter."""


class _NotFound(Exception):
    pass


def _param(q: Any, name: str, required: bool = False) -> str | None:
    v = q.get(name) or None
    if required and v is None:
        raise _BadRequest(f"{name}: required")
    return str(v) if v is not None else None


def _text(q: Any, name: str, required: bool = False) -> str | None:
    """A name compared with stored ones (service, operation): printable, bounded."""
    v = _param(q, name, required)
    if v is None:
        return None
    if len(v) > MAX_TEXT:
        raise _BadRequest(f"{name}: longer than {MAX_TEXT} characters")
    if any(ord(c) < 32 or 127 <= ord(c) < 160 or 0xD800 <= ord(c) < 0xE000 for c in v):
        raise _BadRequest(f"{name}: control characters, NUL and lone surrogates are not "
                          "allowed")
    return v


def _hex_id(v: str | None, name: str, length: int) -> str:
    """A trace (32) or span (16) id as lowercase hex."""
    v = (v or "").lower()
    if len(v) != length or not all(c in "0123456789abcdef" for c in v):
        raise _BadRequest(f"{name}: expected {length} hex characters")
    return v


def _range(q: Any, name: str, now: float, default: str | None = None) -> tuple[int, int]:
    spec = _param(q, name, default is None) or str(default)
    try:
        return queries.parse_range(spec, now, name)
    except ValueError as err:
        raise _BadRequest(str(err)) from None


def _tail_rule(q: Any) -> tuple[float | None, int | None]:
    """``slowest`` (``1%`` or ``0.01``: up to half of the calls; the default, 1%) or
    ``slower_than`` (a duration: ``1s``, ``250ms``), not both."""
    slowest, slower = _param(q, "slowest"), _param(q, "slower_than")
    if slowest and slower:
        raise _BadRequest("slowest: give slowest or slower_than, not both")
    if slower:
        try:
            ns = int(Duration.parse(slower) * 1e9)
        except ValueError as err:
            raise _BadRequest(f"slower_than: {err}") from None
        if not 0 <= ns < 2**63:
            raise _BadRequest("slower_than: out of range")
        return None, ns
    text = (slowest or "1%").strip()
    try:
        frac = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise _BadRequest("slowest: expected a share of the calls such as 1% or 0.01") \
            from None
    if not 0 < frac <= 0.5:
        raise _BadRequest("slowest: expected more than 0 and at most 50%")
    return frac, None


def _flame_answer(got: dict[str, Any]) -> dict[str, Any]:
    """A flame graph query's answer with its nodes as a tree (webui.flame_tree); with a
    base range, compared per call when both ranges have calls, else per second."""
    nodes, base = got.pop("nodes"), got.pop("base_values", None)
    if base is None:
        return {**got, "unit": "ns", "tree": webui.flame_tree(nodes, got["total"])}
    per_call = bool(got["calls"] and got["base_calls"])
    scale = got["calls"] / got["base_calls"] if per_call else \
        (got["to"] - got["from"]) / max(1, got["base_range"][1] - got["base_range"][0])
    return {**got, "unit": "ns", "unit_of_diff": "per_call" if per_call else "per_second",
            "tree": webui.flame_tree(nodes, got["total"], base, got["base_total"], scale)}


def _choice(q: Any, name: str, options: tuple[str, ...], default: str) -> str:
    v = _param(q, name) or default
    if v not in options:
        raise _BadRequest(f"{name}: expected {', '.join(options[:-1])} or {options[-1]}")
    return v


def _int(q: Any, name: str, lo: int, hi: int, default: int) -> int:
    try:
        v = int(_param(q, name) or default)
    except ValueError:
        raise _BadRequest(f"{name}: expected an integer") from None
    if not lo <= v <= hi:
        raise _BadRequest(f"{name}: expected {lo}..{hi}")
    return v


def _duration_ns(q: Any, name: str, default: int) -> int:
    """A duration (``250ms``, ``1.5s``, ``0``) in ns, within 0..2^63-1."""
    v = _param(q, name)
    if v is None:
        return default
    try:
        ns = int(Duration.parse(v) * 1e9)
    except (ValueError, OverflowError):
        raise _BadRequest(f"{name}: expected a duration such as 250ms or 1.5s") from None
    if not 0 <= ns <= ui_queries.MAX_NS:
        raise _BadRequest(f"{name}: out of range")
    return ns


def _method(q: Any) -> str:
    method = str(q.get("method", "exact"))
    try:
        queries.methods_of(method)
    except ValueError as err:
        raise _BadRequest(str(err)) from None
    return method

"""The admin API's questions for the web UI (pipeline/admin/ui/, issue #18): the routes
and their parameters; the answers are ui_queries'. Parameters are checked (``params``)
before a query runs, as for the other questions of server.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pipeline.admin import flame_queries, params, ui_queries, webui

Answer = Callable[[web.Request, Any], Awaitable[web.Response]]


class UiApi:
    def __init__(self, answer: Answer, db: Callable[[], Any], database: Callable[[], str]
                 ) -> None:
        self.answer, self.db, self.database = answer, db, database

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/operations", self.operations)
        app.router.add_get("/api/v1/search", self.search)
        app.router.add_get("/api/v1/histogram", self.histogram)
        app.router.add_get("/api/v1/function_spans", self.function_spans)
        app.router.add_get("/api/v1/flamegraph", self.flamegraph)
        app.router.add_get("/api/v1/traces/{trace_id}/spans/{span_id}", self.span)

    async def operations(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            return await ui_queries.operations(self.db(), self.database(),
                                            params.time_range(q, "range", now, "1h"),
                                            tenant=params.tenant_of(request))
        return await self.answer(request, work)

    async def search(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = params.text(q, "service"), params.text(q, "operation")
            order = params.choice(q, "order", tuple(ui_queries.SEARCH_ORDERS), "duration")
            rng, limit = params.time_range(q, "range", now, "1h"), params.limit(q)
            return await ui_queries.search_calls(
                self.db(), self.database(), rng, service=service, operation=operation,
                min_duration_ns=params.duration_ns(q, "min_duration", 0),
                max_duration_ns=params.duration_ns(q, "max_duration", ui_queries.MAX_NS),
                min_cpu_ns=params.duration_ns(q, "min_cpu", 0), order=order, limit=limit,
                tenant=params.tenant_of(request))
        return await self.answer(request, work)

    async def histogram(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            service, operation = str(params.text(q, "service", True)), params.text(q, "operation")
            buckets = params.integer(q, "buckets", 1, 200, 40)
            return await ui_queries.duration_histogram(
                self.db(), self.database(), service, operation,
                params.time_range(q, "range", now, "1h"), buckets, tenant=params.tenant_of(request))
        return await self.answer(request, work)

    async def function_spans(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            function = str(params.text(q, "function", True))
            service, operation = params.text(q, "service"), params.text(q, "operation")
            order = params.choice(q, "order", ("cpu", "wall"), "cpu")
            rng = params.time_range(q, "range", now, "1h")
            limit, method = params.limit(q), params.method(q)
            return await ui_queries.function_spans(
                self.db(), self.database(), function, rng, service=service,
                operation=operation, order=order, limit=limit, method=method,
                tenant=params.tenant_of(request))
        return await self.answer(request, work)

    async def flamegraph(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            method, tenant = params.method(q), params.tenant_of(request)
            max_nodes = params.integer(q, "max_nodes", 1, flame_queries.MAX_FLAME_NODES, 10_000)
            fmt = params.choice(q, "format", ("tree", "nodes"), "tree")
            tid, sid = params.param(q, "trace_id"), params.param(q, "span_id")
            if tid or sid:
                tid, sid = params.hex_id(tid, "trace_id", 32), params.hex_id(sid, "span_id", 16)
                children = params.choice(q, "children", ("1", "0", "true", "false"), "1")
                measure = params.choice(q, "measure", ("cpu", "wall"), "cpu")
                got = await flame_queries.span_flame(
                    self.db(), self.database(), tid, sid, children=children in ("1", "true"),
                    measure=measure, method=method, max_nodes=max_nodes, tenant=tenant)
                return _flame_answer(got, fmt)
            service, operation = str(params.text(q, "service", True)), params.text(q, "operation")
            rng = params.time_range(q, "range", now, "1h")
            base = params.time_range(q, "base", now) if params.param(q, "base") else None
            return _flame_answer(await flame_queries.operation_flame(
                self.db(), self.database(), service, operation, rng, base=base,
                method=method, max_nodes=max_nodes, tenant=tenant), fmt)
        return await self.answer(request, work)

    async def span(self, request: web.Request) -> web.Response:
        async def work(q: Any, now: float) -> Any:
            tid = params.hex_id(request.match_info["trace_id"], "trace_id", 32)
            sid = params.hex_id(request.match_info["span_id"], "span_id", 16)
            result = await ui_queries.span(self.db(), self.database(), tid, sid,
                                        method=params.method(q), tenant=params.tenant_of(request))
            if result is None:
                raise params.NotFound(f"span {sid} of trace {tid} not found")
            return result
        try:
            return await self.answer(request, work)
        except params.NotFound as err:
            return params.error_response(404, str(err))


def _flame_answer(got: dict[str, Any], fmt: str = "tree") -> dict[str, Any]:
    """A flame graph query's answer with its nodes as a tree (webui.flame_tree), or with
    ``fmt="nodes"`` as flat lists under ``graph`` (webui.flame_nodes, what the UI asks
    for); with a base range, compared per call when both ranges have calls, else per
    second."""
    nodes, base = got.pop("nodes"), got.pop("base_values", None)
    key, encode = ("graph", webui.flame_nodes) if fmt == "nodes" else ("tree", webui.flame_tree)
    if base is None:
        return {**got, "unit": "ns", key: encode(nodes, got["total"])}
    per_call = bool(got["calls"] and got["base_calls"])
    scale = got["calls"] / got["base_calls"] if per_call else \
        (got["to"] - got["from"]) / max(1, got["base_range"][1] - got["base_range"][0])
    return {**got, "unit": "ns", "unit_of_diff": "per_call" if per_call else "per_second",
            key: encode(nodes, got["total"], base, got["base_total"], scale)}

"""Pyroscope's query API (``querier.v1.QuerierService``, Connect protocol) on the admin
listener: what Grafana's built-in Pyroscope data source and its traces-to-profiles link
ask, answered from spanprof's tables, so that Grafana needs no plugin (issue #18)::

    POST /querier.v1.QuerierService/ProfileTypes            types with samples in a range
    POST /querier.v1.QuerierService/LabelNames              labels of matching samples
    POST /querier.v1.QuerierService/LabelValues             values of one label
    POST /querier.v1.QuerierService/Series                  label sets
    POST /querier.v1.QuerierService/SelectMergeStacktraces  flame graph (names + levels)
    POST /querier.v1.QuerierService/SelectMergeSpanProfile  flame graph of spans
    POST /querier.v1.QuerierService/SelectSeries            the value over time

Connect unary calls: ``Content-Type: application/proto`` (what Grafana's Go client sends)
or ``application/json``, the body gzipped or not, the answer in the request's encoding.
Errors are Connect errors, ``{"code": "invalid_argument", "message": "..."}`` with the
code's HTTP status: a request field spanprof cannot answer (a label it does not store, a
profile type it does not have, a format other than the flame graph, a profile id
selector) is ``invalid_argument`` naming the field, an answer over a bound
``resource_exhausted`` (429) naming the field to narrow, the other RPCs of the service
(SelectMergeProfile, SelectHeatmap, Diff, GetProfileStats, AnalyzeQuery)
``unimplemented`` (501). Label selectors and profile type ids: querier_selector.py; SQL:
querier_queries.py.

Every answer is one tenant's, as for the rest of the admin API (``params.tenant_of``: the
token's with auth on, else ``X-Scope-OrgID``'s, else ``default``), and every input is
bounded before a query runs: the body (``MAX_BODY`` bytes, inflated), the time range
(``MAX_RANGE_MS``; 1970..2106), ``max_nodes`` (``MAX_NODES``), the points of a series
(``MAX_STEPS``), span and trace ids (``MAX_IDS``), selectors (querier_selector).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from pipeline.admin import params
from pipeline.admin import querier_queries as qq
from pipeline.admin import querier_selector as sel
from pipeline.admin.querier_messages import M
from pipeline.errors import Retryable
from pipeline.log import redact
from pipeline.receivers.http import GuardedProtocol, ServerLimits

SERVICE = "/querier.v1.QuerierService/"
MAX_BODY = 1 << 20  # bytes of a request, once inflated
MAX_RANGE_MS = 32 * 86_400_000  # a month's range, and a day over
MAX_TIME_MS = (2**32 - 1) * 1000  # ClickHouse DateTime's end (2106)
DEFAULT_RANGE_MS = 3_600_000  # start and end 0: the last hour
MAX_NODES, DEFAULT_NODES = 100_000, 8192  # Pyroscope's default max_nodes is 8192
MAX_STEPS = 11_000  # points of a series (Prometheus's bound)
MAX_IDS = 1000  # span or trace ids of a selector
MAX_LIST = 32  # matchers, label names, group_by
STATUS = {"invalid_argument": 400, "resource_exhausted": 429, "unimplemented": 501,
          "not_found": 404, "unavailable": 503, "internal": 500, "deadline_exceeded": 504}
UNIMPLEMENTED = ("SelectMergeProfile", "SelectHeatmap", "Diff", "GetProfileStats",
                 "AnalyzeQuery")


class ConnectError(Exception):
    """A Connect error: its code (``invalid_argument``, ...) and a message naming the
    field; answered with the code's HTTP status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


Handler = Callable[[Any, str, int], Awaitable[Any]]


class Querier:
    """The RPCs, on the database the admin server queries (``db()``: None without one)."""

    def __init__(self, db: Callable[[], Any], database: Callable[[], str]) -> None:
        self.db, self.database = db, database
        self.log = structlog.get_logger().bind(component="admin", api="querier.v1")
        self.rpcs: dict[str, tuple[str, Handler]] = {
            "ProfileTypes": ("ProfileTypesRequest", self.profile_types),
            "LabelNames": ("LabelNamesRequest", self.label_names),
            "LabelValues": ("LabelValuesRequest", self.label_values),
            "Series": ("SeriesRequest", self.series),
            "SelectMergeStacktraces": ("SelectMergeStacktracesRequest", self.merge_stacktraces),
            "SelectMergeSpanProfile": ("SelectMergeSpanProfileRequest", self.merge_span_profile),
            "SelectSeries": ("SelectSeriesRequest", self.select_series),
        }

    def routes(self, app: web.Application) -> None:
        for name in (*self.rpcs, *UNIMPLEMENTED):
            app.router.add_post(SERVICE + name, self.handle)

    # ---- Connect unary protocol --------------------------------------------------------

    async def handle(self, request: web.Request) -> web.Response:
        name = request.path.removeprefix(SERVICE)
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        codec = {"application/proto": "proto", "application/json": "json"}.get(ctype)
        if codec is None:
            return _error("invalid_argument", f"Content-Type {ctype[:60]!r}: use "
                          "application/proto or application/json (Connect unary)", 415,
                          {"Accept-Post": "application/proto, application/json"})
        try:
            if request.headers.get("Connect-Protocol-Version", "1") != "1":
                raise ConnectError("invalid_argument", "Connect-Protocol-Version: expected 1")
            if name in UNIMPLEMENTED:
                raise ConnectError("unimplemented", f"querier.v1.QuerierService/{name} is not "
                                   "answered by spanprof (see README, Grafana)")
            msg_name, handler = self.rpcs[name]
            msg = _decode(M[msg_name](), await _body(request), codec)
            if self.db() is None:
                raise ConnectError("not_found", "no clickhouse exporter in this pipeline: "
                                   "nothing to query")
            out = await handler(msg, params.tenant_of(request), int(time.time() * 1000))
        except ConnectError as err:
            return _error(err.code, str(err))
        except sel.Invalid as err:
            return _error("invalid_argument", str(err))
        except qq.TooMany as err:
            return _error("resource_exhausted", str(err))
        except Retryable as err:
            return _error("unavailable", str(err))
        except Exception as err:
            if _regex_refused(err):  # a pattern RE2 refused although Python's re took it
                field = "matchers" if name in ("LabelNames", "LabelValues", "Series") \
                    else "label_selector"
                return _error("invalid_argument", f"{field}: a regular expression ClickHouse "
                              f"(RE2) cannot compile: {str(err)[:300]}")
            self.log.exception("querier_failed", rpc=name, error=type(err).__name__)
            return _error("internal", "internal error (logged)")
        if codec == "json":
            return web.Response(body=json_format.MessageToJson(out, indent=None).encode(),
                                content_type="application/json")
        return web.Response(body=out.SerializeToString(), content_type="application/proto")

    # ---- the RPCs --------------------------------------------------------------------

    async def profile_types(self, req: Any, tenant: str, now: int) -> Any:
        rng = _range(req.start, req.end, now)
        types = await qq.profile_types(self.db(), self.database(), rng, tenant=tenant)
        out = M["ProfileTypesResponse"]()
        for t in types:
            _, _, _, period_type, period_unit = t.id.split(":")
            out.profile_types.add(ID=t.id, name=t.name, sample_type=t.sample_type,
                                  sample_unit=t.sample_unit, period_type=period_type,
                                  period_unit=period_unit)
        return out

    async def label_names(self, req: Any, tenant: str, now: int) -> Any:
        rng, p = _range(req.start, req.end, now), dict[str, Any]()
        where = sel.where_any(_selectors(req.matchers), p, "s")
        return M["LabelNamesResponse"](names=await qq.label_names(
            self.db(), self.database(), where, p, rng, tenant=tenant))

    async def label_values(self, req: Any, tenant: str, now: int) -> Any:
        if req.name not in sel.LABELS:
            raise sel.Invalid(f"name: {req.name[:100]!r} is not a label spanprof stores (it "
                              f"has {', '.join(sorted(sel.LABELS))})")
        rng, p = _range(req.start, req.end, now), dict[str, Any]()
        where = sel.where_any(_selectors(req.matchers), p, "s")
        return M["LabelValuesResponse"](names=await qq.label_values(
            self.db(), self.database(), req.name, where, p, rng, tenant=tenant))

    async def series(self, req: Any, tenant: str, now: int) -> Any:
        names = _labels(req.label_names, "label_names") or sorted(sel.LABELS)
        rng, p = _range(req.start, req.end, now), dict[str, Any]()
        where = sel.where_any(_selectors(req.matchers), p, "s")
        sets = await qq.series(self.db(), self.database(), names, where, p, rng,
                               tenant=tenant)
        out = M["SeriesResponse"]()
        for labels in sets:
            out.labels_set.add().labels.extend(M["LabelPair"](name=n, value=v)
                                               for n, v in labels)
        return out

    async def merge_stacktraces(self, req: Any, tenant: str, now: int) -> Any:
        if req.profile_id_selector:
            raise sel.Invalid("profile_id_selector: spanprof keeps no profile ids; select by "
                              "labels, trace_id_selector or span_selector")
        if req.HasField("async") and getattr(req, "async").type != 0:
            raise sel.Invalid("async: asynchronous queries are not supported")
        return await self._flame(req, tenant, now, "SelectMergeStacktracesResponse",
                                 trace_ids=_ids(req.trace_id_selector, "trace_id_selector", 32),
                                 span_ids=_ids(req.span_selector, "span_selector", 16))

    async def merge_span_profile(self, req: Any, tenant: str, now: int) -> Any:
        span_ids = _ids(req.span_selector, "span_selector", 16)
        if not span_ids:
            raise sel.Invalid("span_selector: required (the span ids whose profile to merge)")
        return await self._flame(req, tenant, now, "SelectMergeSpanProfileResponse",
                                 span_ids=span_ids)

    async def _flame(self, req: Any, tenant: str, now: int, response: str,
                     trace_ids: list[str] | None = None, span_ids: list[str] | None = None
                     ) -> Any:
        ptype = sel.parse_type(req.profile_typeID)
        matchers = sel.parse_selector(req.label_selector)
        if req.format not in (0, 1):
            raise sel.Invalid("format: only PROFILE_FORMAT_FLAMEGRAPH is answered (not tree, "
                              "DOT or pprof)")
        _no_stack_selector(req)
        if not 0 <= req.max_nodes <= MAX_NODES:
            raise sel.Invalid(f"max_nodes: expected 0 (the default, {DEFAULT_NODES}) to "
                              f"{MAX_NODES}")
        rng = _range(req.start, req.end, now)
        if span_ids:
            span_ids = await qq.with_descendants(self.db(), self.database(), span_ids,
                                                 tenant=tenant)
        p: dict[str, Any] = {}
        sql = qq.sample_filter(ptype, matchers, p, trace_ids, span_ids)
        got = await qq.flame(self.db(), self.database(), sql, p, rng,
                             req.max_nodes or DEFAULT_NODES, tenant=tenant)
        out = M[response]()
        fg = out.flamegraph
        fg.names.extend(got["names"])
        for values in got["levels"]:
            fg.levels.add().values.extend(values)
        fg.total, fg.max_self = got["total"], got["max_self"]
        return out

    async def select_series(self, req: Any, tenant: str, now: int) -> Any:
        ptype = sel.parse_type(req.profile_typeID)
        matchers = sel.parse_selector(req.label_selector)
        group_by = _labels(req.group_by, "group_by")
        if len(set(group_by)) != len(group_by):
            raise sel.Invalid("group_by: a label named twice")
        if req.aggregation != 0:
            raise sel.Invalid("aggregation: only TIME_SERIES_AGGREGATION_TYPE_SUM is answered")
        _no_stack_selector(req)
        if req.limit < 0:
            raise sel.Invalid("limit: expected 0 (no limit) or more")
        rng = _range(req.start, req.end, now)
        if not (math.isfinite(req.step) and req.step > 0):
            raise sel.Invalid("step: expected a number of seconds greater than 0")
        step_ms = max(1, round(min(req.step, MAX_RANGE_MS / 1000) * 1000))
        if -(-(rng[1] - rng[0]) // step_ms) > MAX_STEPS:
            raise sel.Invalid(f"step: {req.step:g} s over the range makes more than "
                              f"{MAX_STEPS} points")
        p: dict[str, Any] = {}
        sql = qq.sample_filter(ptype, matchers, p)
        got = await qq.select_series(self.db(), self.database(), sql, p, rng, step_ms,
                                     group_by, min(req.limit, qq.MAX_SERIES), tenant=tenant)
        out = M["SelectSeriesResponse"]()
        for labels, points in got:
            s = out.series.add()
            s.labels.extend(M["LabelPair"](name=n, value=v) for n, v in labels)
            s.points.extend(M["Point"](value=float(v), timestamp=t) for t, v in points)
        return out


# ---- request checks ------------------------------------------------------------------


def _range(start: int, end: int, now_ms: int) -> tuple[int, int]:
    """[start, end) in ms; 0 for both: the last hour, an end of 0: now."""
    end = end or now_ms
    start = start or max(0, end - DEFAULT_RANGE_MS)
    if not 0 < end <= MAX_TIME_MS:
        raise sel.Invalid("end: expected milliseconds since 1970 within 1970..2106")
    if not 0 <= start < end:
        raise sel.Invalid("start: expected milliseconds since 1970, before end")
    if end - start > MAX_RANGE_MS:
        raise sel.Invalid(f"start: a range longer than {MAX_RANGE_MS // 86_400_000} days")
    return start, end


def _selectors(texts: Any) -> list[list[sel.Matcher]]:
    if len(texts) > MAX_LIST:
        raise sel.Invalid(f"matchers: more than {MAX_LIST} selectors")
    return [sel.parse_selector(t, "matchers") for t in texts]


def _labels(names: Any, field: str) -> list[str]:
    if len(names) > MAX_LIST:
        raise sel.Invalid(f"{field}: more than {MAX_LIST} labels")
    bad = [n for n in names if n not in sel.LABELS]
    if bad:
        raise sel.Invalid(f"{field}: {bad[0][:100]!r} is not a label spanprof stores (it has "
                          f"{', '.join(sorted(sel.LABELS))})")
    return list(names)


def _ids(values: Any, field: str, length: int) -> list[str]:
    if len(values) > MAX_IDS:
        raise sel.Invalid(f"{field}: more than {MAX_IDS} ids")
    out = []
    for v in values:
        v = v.lower()
        if len(v) != length or not all(c in "0123456789abcdef" for c in v):
            raise sel.Invalid(f"{field}: {v[:40]!r} is not {length} hex characters")
        out.append(v)
    return sorted(set(out))


def _no_stack_selector(req: Any) -> None:
    if "stack_trace_selector" in req.DESCRIPTOR.fields_by_name and \
            req.HasField("stack_trace_selector") and (
            req.stack_trace_selector.call_site or req.stack_trace_selector.HasField("go_pgo")):
        raise sel.Invalid("stack_trace_selector: not supported")


# ---- the wire --------------------------------------------------------------------------


async def _body(request: web.Request) -> bytes:
    """The body, within ``MAX_BODY`` once inflated (the admin listener inflates gzip as it
    reads, so a bomb stops at the bound) and the listener's ``read_timeout``."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity", "gzip"):
        raise ConnectError("unimplemented", f"Content-Encoding {encoding[:40]!r}: use gzip "
                           "or none")
    proto = request.protocol
    guarded = proto if isinstance(proto, GuardedProtocol) else None
    timeout = guarded.limits.read_timeout if guarded else ServerLimits.read_timeout
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > MAX_BODY:
                    raise ConnectError("resource_exhausted", f"request body over {MAX_BODY} "
                                       "bytes")
                chunks.append(chunk)
    except (ConnectError, TimeoutError, web.RequestPayloadError) as err:
        if guarded:  # the rest of a body refused is not read (nor lingered on)
            guarded.close_after_response()
        if isinstance(err, ConnectError):
            raise
        if isinstance(err, TimeoutError):
            raise ConnectError("deadline_exceeded", f"request body not received within "
                               f"read_timeout={timeout}s") from None
        # bad chunked framing, a truncated body, gzip the listener could not inflate
        raise ConnectError("invalid_argument", f"request body: {err}") from None
    return b"".join(chunks)


def _decode(msg: Message, body: bytes, codec: str) -> Any:
    name = msg.DESCRIPTOR.full_name
    try:
        if codec == "proto":
            msg.ParseFromString(body)
        else:
            doc = json.loads(body or b"{}")
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object")
            json_format.ParseDict(doc, msg, ignore_unknown_fields=True,
                                  max_recursion_depth=32)
    except (DecodeError, json_format.ParseError, ValueError, RecursionError, TypeError,
            UnicodeDecodeError) as err:
        raise ConnectError("invalid_argument", f"request: not a {name} ({codec}): "
                           f"{str(err)[:200]}") from None
    for f, v in msg.ListFields():  # strings a column could hold (JSON admits \\ud800)
        values = [v] if isinstance(v, str) else v
        if f.type == f.TYPE_STRING and not all(sel.printable(s.replace("\n", " ").replace(
                "\t", " ")) for s in values):
            raise ConnectError("invalid_argument", f"{f.name}: control characters, NUL and "
                               "lone surrogates are not allowed")
    return msg


def _regex_refused(err: Exception) -> bool:
    text = str(err)
    return any(s in text for s in ("Code: 427", "CANNOT_COMPILE_REGEXP",
                                   "OptimizedRegularExpression"))


def _error(code: str, message: str, status: int | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps({"code": code, "message": redact(message)}).encode(),
                        status=status or STATUS[code], content_type="application/json",
                        headers=headers)

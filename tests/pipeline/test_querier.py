"""Pyroscope's query API (querier.v1, admin/querier.py) on the real embedded engine, with
generated samples whose answers are known exactly: profile types, label names and values,
series, the merged flame graph (flamebearer levels, ``max_nodes`` and its ``other``
nodes), span profiles (the spans named and their descendants in their service), the time
series by step and label; two tenants with the same ids see their own only. Then over
HTTP: both Connect encodings, gzip, and Connect errors naming the field.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from google.protobuf import json_format

from pipeline.admin import querier_queries as qq
from pipeline.admin import querier_selector as sel
from pipeline.admin.querier import Querier
from pipeline.admin.querier_messages import M
from pipeline.admin.server import AdminServer
from pipeline.auth import AuthConfig, TokenAuth
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.graph import Graph, Node
from pipeline.records import ProfileBatch, Sample, Span, SpanBatch, Stack
from pipeline.registry import Context

MS = 1_000_000
T0_S = int(time.time()) // 60 * 60 - 1200  # a whole minute, twenty minutes ago
T0 = T0_S * 1000  # ms
RANGE = {"start": T0, "end": T0 + 180_000}
CPU = "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
WALL = "wall:wall:nanoseconds:wall:nanoseconds"
ALLOC = "other:alloc_space:bytes:alloc_space:bytes"
TID, TID2 = bytes(range(1, 17)), bytes(range(2, 18))
R, C, D, R2 = (b"\x00" * 7 + bytes([i]) for i in (1, 2, 3, 4))  # spans
# stacks, leaf first
H, SLOW, DB, GC = 1, 2, 3, 4
FRAMES = {H: ["handle", "main"], SLOW: ["slow_path", "handle", "main"],
          DB: ["db_exec", "query_fn", "main"], GC: ["gc"]}


def sample(span: bytes, stack: int, ms: int, at_s: int, service: str = "shop",
           trace: bytes = TID, measure: str = "cpu", span_name: str = "",
           thread: str = "", host: str = "", sample_type: str = "cpu",
           unit: str = "nanoseconds") -> Sample:
    return Sample(trace if span else b"", span, service, (T0_S + at_s) * 10**9, stack, measure,
                  ms * MS if unit == "nanoseconds" else ms, 1, sample_type, unit,
                  thread_name=thread, span_name=span_name, host=host)


def data(tenant: str) -> list[Any]:
    """Tenant a: trace 1 is shop's checkout (R) with its child query (C), which calls db
    (D, another service); trace 2 is another checkout (R2). CPU (ms): R handle 10 +
    slow_path 30, C db_exec 20, D db_exec 5, R2 handle 7 + gc 3, unlinked slow_path 1
    (thread worker-1, host h1); wall: R handle 100; alloc_space: C db_exec 4096 bytes.
    Tenant b: the same ids, R burning 1000 ms in b_handle only."""
    if tenant == "b":
        stacks = {1: Stack(1, ["b_handle", "b_main"], [], [])}
        return [SpanBatch([Span(TID, R, b"", "checkout", 2, "shop", T0 * MS, T0 * MS + 1)],
                          tenant="b"),
                ProfileBatch([sample(R, 1, 1000, 0, span_name="checkout")], stacks,
                             tenant="b")]
    t = T0 * MS
    spans = [Span(TID, R, b"", "checkout", 2, "shop", t, t + 500 * MS),
             Span(TID, C, R, "query", 3, "shop", t + 10 * MS, t + 400 * MS),
             Span(TID, D, C, "select", 2, "db", t + 20 * MS, t + 300 * MS),
             Span(TID2, R2, b"", "checkout", 2, "shop", t + 70_000 * MS, t + 70_100 * MS)]
    samples = [
        sample(R, H, 10, 0, span_name="checkout"), sample(R, SLOW, 30, 0, span_name="checkout"),
        sample(C, DB, 20, 10, span_name="query"), sample(D, DB, 5, 10, service="db"),
        sample(R2, H, 7, 70, trace=TID2, span_name="checkout"),
        sample(R2, GC, 3, 70, trace=TID2, span_name="checkout"),
        sample(b"", SLOW, 1, 130, thread="worker-1", host="h1"),
        sample(R, H, 100, 0, measure="wall", sample_type="wall", span_name="checkout"),
        sample(C, DB, 4096, 10, measure="other", sample_type="alloc_space", unit="bytes",
               span_name="query")]
    stacks = {k: Stack(k, v, [], []) for k, v in FRAMES.items()}
    return [SpanBatch(spans, tenant="a"), ProfileBatch(samples, stacks, tenant="a")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ClickHouseExporter]:
    tmp = tmp_path_factory.mktemp("querier")
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp}/ch", flush_interval=0.05, ttl=0),
                            Context("clickhouse", ["traces"], data_dir=str(tmp)))
    try:
        await ex.start()
        for tenant in ("a", "b"):
            for batch in data(tenant):
                await ex.consume(batch)
        yield ex
    finally:
        await ex.shutdown()


async def call(store: ClickHouseExporter, rpc: str, tenant: str = "a", **req: Any
               ) -> dict[str, Any]:
    """One RPC through the handler, its answer as the Connect JSON a client decodes."""
    q = Querier(lambda: store, lambda: "spanprof")
    msg_name, handler = q.rpcs[rpc]
    out = await handler(json_format.ParseDict(req, M[msg_name]()), tenant,
                        int(time.time() * 1000))
    return json_format.MessageToDict(out)


def fg(names: list[str], levels: list[list[int]], total: int, max_self: int
       ) -> dict[str, Any]:
    """A FlameGraph as Connect JSON (64-bit integers as strings), values (offsets, totals,
    selfs; not name indexes) in ms."""
    return {"names": names, "levels": [{"values": [str(v * MS if i % 4 != 3 else v)
                                                   for i, v in enumerate(lv)]}
                                       for lv in levels],
            "total": str(total * MS), "maxSelf": str(max_self * MS)}


SHOP = '{service_name="shop"}'


@pytest.mark.asyncio(loop_scope="module")
class TestQueries:
    async def test_profile_types(self, store: ClickHouseExporter) -> None:
        """One type per measure, the other measure's by its sample type and unit."""
        got = await call(store, "ProfileTypes", **RANGE)
        assert got == {"profileTypes": [
            {"ID": ALLOC, "name": "other", "sampleType": "alloc_space", "sampleUnit": "bytes",
             "periodType": "alloc_space", "periodUnit": "bytes"},
            {"ID": CPU, "name": "process_cpu", "sampleType": "cpu", "sampleUnit": "nanoseconds",
             "periodType": "cpu", "periodUnit": "nanoseconds"},
            {"ID": WALL, "name": "wall", "sampleType": "wall", "sampleUnit": "nanoseconds",
             "periodType": "wall", "periodUnit": "nanoseconds"}]}
        none = await call(store, "ProfileTypes", start=T0 - 3_600_000, end=T0 - 60_000)
        assert none == {}

    async def test_label_names_and_values(self, store: ClickHouseExporter) -> None:
        """Labels with a value in the matching samples; values sorted, empty ones absent;
        the selector narrows both (Grafana's __profile_type__ matcher included)."""
        got = await call(store, "LabelNames", matchers=["{}"], **RANGE)
        assert got["names"] == ["__name__", "__profile_type__", "host_name", "service_name",
                                "span_name", "thread_name"]
        got = await call(store, "LabelNames", matchers=[
            f'{{__profile_type__="{CPU}", service_name="db"}}'], **RANGE)
        assert got["names"] == ["__name__", "__profile_type__", "service_name"]
        got = await call(store, "LabelValues", name="service_name", matchers=["{}"], **RANGE)
        assert got["names"] == ["db", "shop"]
        got = await call(store, "LabelValues", name="span_name",
                         matchers=['{service_name=~"sh.p"}'], **RANGE)
        assert got["names"] == ["checkout", "query"]
        got = await call(store, "LabelValues", name="__profile_type__",
                         matchers=['{span_name="query"}'], **RANGE)
        assert got["names"] == [ALLOC, CPU]
        got = await call(store, "LabelValues", name="service_name",
                         matchers=['{service_name!~"sh.*"}', '{thread_name="worker-1"}'],
                         **RANGE)
        assert got["names"] == ["db", "shop"]  # any of the selectors

    async def test_series(self, store: ClickHouseExporter) -> None:
        got = await call(store, "Series", matchers=[SHOP],
                         labelNames=["__name__", "span_name"], **RANGE)
        assert got["labelsSet"] == [
            {"labels": [{"name": "__name__", "value": "other"},
                        {"name": "span_name", "value": "query"}]},
            {"labels": [{"name": "__name__", "value": "process_cpu"}]},
            {"labels": [{"name": "__name__", "value": "process_cpu"},
                        {"name": "span_name", "value": "checkout"}]},
            {"labels": [{"name": "__name__", "value": "process_cpu"},
                        {"name": "span_name", "value": "query"}]},
            {"labels": [{"name": "__name__", "value": "wall"},
                        {"name": "span_name", "value": "checkout"}]}]

    async def test_merged_flame_graph(self, store: ClickHouseExporter) -> None:
        """shop's CPU: gc 3 beside main 68 (handle 48: self 17 + slow_path 31;
        query_fn 20 > db_exec 20); children after their parent's self width, by name;
        offsets from the previous node's end."""
        got = await call(store, "SelectMergeStacktraces", profileTypeID=CPU,
                         labelSelector=SHOP, **RANGE)
        assert got["flamegraph"] == fg(
            ["total", "gc", "main", "handle", "query_fn", "slow_path", "db_exec"],
            [[0, 71, 0, 0], [0, 3, 3, 1, 0, 68, 0, 2], [3, 48, 17, 3, 0, 20, 0, 4],
             [20, 31, 31, 5, 0, 20, 20, 6]], 71, 31)
        # the largest 3 nodes; what is left out below a node is its "other"
        got = await call(store, "SelectMergeStacktraces", profileTypeID=CPU,
                         labelSelector=SHOP, maxNodes=3, **RANGE)
        assert got["flamegraph"] == fg(
            ["total", "main", "other", "handle", "slow_path"],
            [[0, 71, 0, 0], [0, 68, 0, 1, 0, 3, 3, 2], [0, 48, 17, 3, 0, 20, 20, 2],
             [17, 31, 31, 4]], 71, 31)
        wall = await call(store, "SelectMergeStacktraces", profileTypeID=WALL,
                          labelSelector="{}", **RANGE)
        assert wall["flamegraph"]["total"] == str(100 * MS)
        alloc = await call(store, "SelectMergeStacktraces", profileTypeID=ALLOC,
                           labelSelector="{}", **RANGE)
        assert alloc["flamegraph"]["total"] == "4096"
        threads = await call(store, "SelectMergeStacktraces", profileTypeID=CPU,
                             labelSelector='{thread_name="worker-1", host_name="h1"}', **RANGE)
        assert threads["flamegraph"]["total"] == str(1 * MS)
        empty = await call(store, "SelectMergeStacktraces", profileTypeID=CPU,
                           labelSelector='{service_name="nope"}', **RANGE)
        assert empty["flamegraph"] == {"names": ["total"], "levels": [{"values": [
            "0", "0", "0", "0"]}]}  # total and max_self 0: not written

    async def test_span_profiles(self, store: ClickHouseExporter) -> None:
        """A span's profile is its samples and its descendants' in its service: C alone is
        db_exec 20 (D, in db, is not C's), R is R's 40 and C's 20; D's own 5; two spans
        add up; by trace id, every sample of the trace; SelectMergeStacktraces'
        span_selector is the same question."""
        async def total(rpc: str = "SelectMergeSpanProfile", sel_: str = "{}",
                        **kw: Any) -> int:
            got = await call(store, rpc, profileTypeID=CPU, labelSelector=sel_, **RANGE, **kw)
            return int(got["flamegraph"].get("total", 0)) // MS
        assert await total(spanSelector=[C.hex()]) == 20
        assert await total(spanSelector=[R.hex()]) == 60
        assert await total(spanSelector=[D.hex()]) == 5
        assert await total(spanSelector=[D.hex()], sel_=SHOP) == 0
        assert await total(spanSelector=[R2.hex().upper(), C.hex()]) == 30
        assert await total("SelectMergeStacktraces", spanSelector=[R.hex()]) == 60
        assert await total("SelectMergeStacktraces", traceIdSelector=[TID.hex()]) == 65
        got = await call(store, "SelectMergeSpanProfile", profileTypeID=CPU,
                         labelSelector="{}", spanSelector=[C.hex()], **RANGE)
        assert got["flamegraph"] == fg(["total", "main", "query_fn", "db_exec"],
                                       [[0, 20, 0, 0], [0, 20, 0, 1], [0, 20, 0, 2],
                                        [0, 20, 20, 3]], 20, 20)

    async def test_select_series(self, store: ClickHouseExporter) -> None:
        """CPU per minute step (points at start + k * step where there are samples), by
        span_name; the unlabelled sample is the series without labels; limit keeps the
        largest."""
        got = await call(store, "SelectSeries", profileTypeID=CPU, labelSelector=SHOP,
                         step=60, groupBy=["span_name"], **RANGE)
        assert got["series"] == [
            {"points": [{"value": 1.0 * MS, "timestamp": str(T0 + 120_000)}]},
            {"labels": [{"name": "span_name", "value": "checkout"}],
             "points": [{"value": 40.0 * MS, "timestamp": str(T0)},
                        {"value": 10.0 * MS, "timestamp": str(T0 + 60_000)}]},
            {"labels": [{"name": "span_name", "value": "query"}],
             "points": [{"value": 20.0 * MS, "timestamp": str(T0)}]}]
        got = await call(store, "SelectSeries", profileTypeID=CPU, labelSelector="{}",
                         step=60, groupBy=["service_name"], limit=1, **RANGE)
        assert [s["labels"] for s in got["series"]] == [[{"name": "service_name",
                                                          "value": "shop"}]]
        got = await call(store, "SelectSeries", profileTypeID=CPU, labelSelector="{}",
                         step=120, **RANGE)
        assert got["series"] == [{"points": [
            {"value": 75.0 * MS, "timestamp": str(T0)},
            {"value": 1.0 * MS, "timestamp": str(T0 + 120_000)}]}]

    async def test_each_tenant_sees_its_own(self, store: ClickHouseExporter) -> None:
        """Tenant b has the same trace and span ids: its answers are its own samples only,
        and a's are unchanged by b's (the tests above); a tenant with no data has none."""
        got = await call(store, "SelectMergeSpanProfile", "b", profileTypeID=CPU,
                         labelSelector="{}", spanSelector=[R.hex()], **RANGE)
        assert got["flamegraph"] == fg(["total", "b_main", "b_handle"],
                                       [[0, 1000, 0, 0], [0, 1000, 0, 1], [0, 1000, 1000, 2]],
                                       1000, 1000)
        assert (await call(store, "LabelValues", "b", name="service_name", **RANGE)
                )["names"] == ["shop"]
        assert (await call(store, "ProfileTypes", "b", **RANGE))["profileTypes"][0]["ID"] == CPU
        assert await call(store, "ProfileTypes", "c", **RANGE) == {}
        got = await call(store, "SelectMergeStacktraces", "c", profileTypeID=CPU,
                         labelSelector="{}", spanSelector=[R.hex()], **RANGE)
        assert "total" not in got["flamegraph"]  # 0


class TestFlamebearer:
    def test_other_sorted_last_and_offsets(self) -> None:
        """Children by name, ``other`` (what was left out) after them, offsets relative to
        the level's previous node's end; names deduplicated."""
        nodes = [(1, 0, "b", 6, 1), (2, 0, "a", 2, 2), (3, 1, "a", 4, 4)]
        got = qq.flamebearer(nodes, 10)
        assert got == {"names": ["total", "a", "b", "other"],
                       "levels": [[0, 10, 0, 0], [0, 2, 2, 1, 0, 6, 1, 2, 0, 2, 2, 3],
                                  [3, 4, 4, 1, 0, 1, 1, 3]], "total": 10, "max_self": 4}


class TestSelectors:
    @pytest.mark.parametrize("text, want", [
        ("{}", []), ("", []), ("  { } ", []),
        ('{service_name="a",}', [("service_name", "=", "a")]),
        ("{span_name!='x', host_name=~`a.*`}", [("span_name", "!=", "x"),
                                               ("host_name", "=~", "a.*")]),
        ('{service_name="a\\"b\\u00e9"}', [("service_name", "=", 'a"bé')]),
        (f"{CPU}{{}}", [("__profile_type__", "=", CPU)]),
        ("process_cpu", [("__name__", "=", "process_cpu")]),
    ])
    def test_parses(self, text: str, want: list[tuple[str, str, str]]) -> None:
        assert [tuple(m) for m in sel.parse_selector(text)] == want

    @pytest.mark.parametrize("text, says", [
        ('{pod="x"}', "label 'pod' is not one spanprof stores"),
        ('{service_name="a"', "expected ',' or '}'"),
        ('{service_name="a}', "unterminated string"),
        ("{service_name=a}", "expected a quoted value"),
        ('{service_name=="a"}', "expected a quoted value"),
        ('{service_name="\\ud800"}', "invalid escape"),
        ('{service_name="\\q"}', "invalid escape"),
        ('{service_name="a"} x', "unexpected text after"),
        ('{service_name=~"(?=a)"}', "look-around"),
        ('{service_name=~"a{1000}"}', "repeat count over 100"),
        ('{service_name=~"("}', "not a regular expression"),
        ("{" + 'service_name="a",' * 33 + "}", "more than 32 matchers"),
        ('{service_name="' + "a" * 1025 + '"}', "longer than 1024"),
        ("{" * 5000, "longer than 4096"),
        ('{service_name="\x00"}', "control characters"),
    ])
    def test_refuses_naming_the_field(self, text: str, says: str) -> None:
        with pytest.raises(sel.Invalid) as err:
            sel.parse_selector(text)
        assert str(err.value).startswith("label_selector: ") and says in str(err.value)

    @pytest.mark.parametrize("text", ["memory:inuse_space:bytes:space:bytes", "", "cpu",
                                      "other:a:b:c:d", "other:a:b:a:b:x", "process_cpu:cpu"])
    def test_unknown_profile_types(self, text: str) -> None:
        with pytest.raises(sel.Invalid, match="^profile_typeID: "):
            sel.parse_type(text)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def admin(store: ClickHouseExporter) -> AsyncIterator[AdminServer]:
    graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                  order=["exporter:clickhouse"])
    server = AdminServer("127.0.0.1:0", graph)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown()


async def post(admin: AdminServer, rpc: str, body: bytes, ctype: str = "application/proto",
               **headers: str) -> tuple[int, str, bytes]:
    """A Connect unary call, by hand."""
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{admin.port}/querier.v1.QuerierService/{rpc}", data=body,
            headers={"Content-Type": ctype, **headers}) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


@pytest.mark.asyncio(loop_scope="module")
class TestConnect:
    async def test_proto_json_and_gzip(self, admin: AdminServer) -> None:
        """The same answer in both encodings, to a plain and a gzipped request; the
        tenant from X-Scope-OrgID."""
        req = M["SelectMergeSpanProfileRequest"](profile_typeID=CPU, label_selector="{}",
                                                 span_selector=[R.hex()], **RANGE)
        status, ctype, body = await post(admin, "SelectMergeSpanProfile",
                                         req.SerializeToString(), **{"X-Scope-OrgID": "b"})
        assert (status, ctype) == (200, "application/proto")
        got = M["SelectMergeSpanProfileResponse"].FromString(body)
        assert got.flamegraph.total == 1000 * MS
        status, ctype, body = await post(
            admin, "SelectMergeSpanProfile", gzip.compress(json_format.MessageToJson(
                req).encode()), "application/json", **{"Content-Encoding": "gzip",
                                                       "X-Scope-OrgID": "a"})
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body)["flamegraph"]["total"] == str(60 * MS)

    @pytest.mark.parametrize("rpc, req, status, code, says", [
        ("SelectMergeStacktraces", {"profileTypeID": "memory:inuse_space:bytes:space:bytes"},
         400, "invalid_argument", "profile_typeID: "),
        ("SelectMergeStacktraces", {"profileTypeID": CPU, "labelSelector": '{pod="a"}'},
         400, "invalid_argument", "label_selector: label 'pod'"),
        ("SelectMergeStacktraces", {"profileTypeID": CPU,  # Python's re takes it, RE2 not
                                    "labelSelector": '{service_name=~"\\\\N{DIGIT ONE}"}'},
         400, "invalid_argument", "label_selector: a regular expression ClickHouse"),
        ("SelectMergeStacktraces", {"profileTypeID": CPU, "format": "PROFILE_FORMAT_PPROF"},
         400, "invalid_argument", "format: "),
        ("SelectMergeStacktraces", {"profileTypeID": CPU, "maxNodes": "100001"},
         400, "invalid_argument", "max_nodes: "),
        ("SelectMergeStacktraces", {"profileTypeID": CPU, "profileIdSelector": ["x"]},
         400, "invalid_argument", "profile_id_selector: "),
        ("SelectMergeStacktraces", {"profileTypeID": CPU, "stackTraceSelector": {
            "callSite": [{"name": "main"}]}}, 400, "invalid_argument",
         "stack_trace_selector: "),
        ("SelectMergeSpanProfile", {"profileTypeID": CPU}, 400, "invalid_argument",
         "span_selector: required"),
        ("SelectMergeSpanProfile", {"profileTypeID": CPU, "spanSelector": ["xyz"]}, 400,
         "invalid_argument", "span_selector: 'xyz'"),
        ("SelectMergeSpanProfile", {"profileTypeID": CPU, "spanSelector": ["0" * 16] * 1001},
         400, "invalid_argument", "span_selector: more than 1000"),
        ("SelectSeries", {"profileTypeID": CPU, "step": 0}, 400, "invalid_argument",
         "step: "),
        ("SelectSeries", {"profileTypeID": CPU, "step": 0.001, "start": "1", "end":
                          "86400000"}, 400, "invalid_argument", "step: "),
        ("SelectSeries", {"profileTypeID": CPU, "step": 15, "groupBy": ["pod"]}, 400,
         "invalid_argument", "group_by: 'pod'"),
        ("SelectSeries", {"profileTypeID": CPU, "step": 15,
                          "aggregation": "TIME_SERIES_AGGREGATION_TYPE_AVERAGE"}, 400,
         "invalid_argument", "aggregation: "),
        ("LabelValues", {"name": "pod"}, 400, "invalid_argument", "name: 'pod'"),
        ("LabelNames", {"start": "5", "end": "4"}, 400, "invalid_argument", "start: "),
        ("LabelNames", {"start": "1", "end": "99999999999999"}, 400, "invalid_argument",
         "end: "),
        ("ProfileTypes", {"start": "1", "end": str(40 * 86_400_000)}, 400,
         "invalid_argument", "start: a range longer than 32 days"),
        ("Series", {"labelNames": ["a"] * 33}, 400, "invalid_argument", "label_names: "),
        ("SelectHeatmap", {}, 501, "unimplemented", "SelectHeatmap"),
        ("SelectMergeProfile", {}, 501, "unimplemented", "SelectMergeProfile"),
    ])
    async def test_connect_errors_name_the_field(self, admin: AdminServer, rpc: str,
                                                 req: dict[str, Any], status: int, code: str,
                                                 says: str) -> None:
        got = await post(admin, rpc, json.dumps(req).encode(), "application/json")
        assert got[0] == status and got[1] == "application/json", got
        err = json.loads(got[2])
        assert err["code"] == code and says in err["message"], err

    async def test_wire_errors(self, admin: AdminServer) -> None:
        """Bytes that are no request, an unknown content type, a body over the bound."""
        status, _, body = await post(admin, "ProfileTypes", b"\xff\xff\xff")
        assert status == 400 and json.loads(body)["code"] == "invalid_argument"
        status, _, body = await post(admin, "ProfileTypes", b"[1]", "application/json")
        assert status == 400 and "ProfileTypesRequest" in json.loads(body)["message"]
        status, _, _ = await post(admin, "ProfileTypes", b"{}", "text/plain")
        assert status == 415
        status, _, body = await post(admin, "ProfileTypes", gzip.compress(b"\0" * (2 << 20)),
                                     **{"Content-Encoding": "gzip"})
        assert status == 429 and json.loads(body)["code"] == "resource_exhausted"
        status, _, body = await post(admin, "ProfileTypes", b"{}", "application/json",
                                     **{"Content-Encoding": "snappy"})
        assert status == 501
        status, _, body = await post(admin, "LabelValues", json.dumps(
            {"name": "service_name", "matchers": ['{service_name="\ud800"}']}).encode(),
            "application/json")
        assert status == 400 and "surrogate" in json.loads(body)["message"]
        status, _, body = await post(admin, "LabelValues", json.dumps(
            {"name": "service_name\u0000"}).encode(), "application/json")
        assert status == 400 and json.loads(body)["message"].startswith(
            "name: control characters")

    async def test_tokens(self, store: ClickHouseExporter) -> None:
        """With tokens on the listener, the RPCs need one, and answer its tenant's data; an
        X-Scope-OrgID naming another tenant is refused."""
        auth = TokenAuth(AuthConfig(tokens={"token-of-tenant-b-0123456789": "b"}),
                         "tenantauth", None)
        await auth.start()
        graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                      order=["exporter:clickhouse"])
        server = AdminServer("127.0.0.1:0", graph, auth=auth)
        await server.start()
        body = M["LabelValuesRequest"](name="span_name", **RANGE).SerializeToString()
        bearer = "Bearer token-of-tenant-b-0123456789"
        try:
            status, _, _ = await post(server, "LabelValues", body)
            assert status == 401
            status, _, out = await post(server, "LabelValues", body, Authorization=bearer)
            assert status == 200
            assert list(M["LabelValuesResponse"].FromString(out).names) == ["checkout"]
            status, _, _ = await post(server, "LabelValues", body, Authorization=bearer,
                                      **{"X-Scope-OrgID": "a"})
            assert status == 403
        finally:
            await server.shutdown()
            await auth.shutdown()

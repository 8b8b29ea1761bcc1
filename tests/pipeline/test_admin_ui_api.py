"""The admin API's questions for the web UI (issue #18) on the real embedded engine: trace
search with filters and orders, the duration histogram, function -> spans and traces, a
span's flame graph with and without its children (CPU and wall), an operation's flame
graph and its per-call difference to another range; each tenant sees its own only. Then
through the HTTP API: every bad parameter is a 400 naming it, and the UI's files are
served (without a token, with a Content-Security-Policy and an ETag)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import inspect
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from pipeline.admin import flame_queries, queries, ui_queries
from pipeline.admin.server import AdminServer
from pipeline.admin.webui import StaticUi, flame_nodes, flame_tree
from pipeline.auth import AuthConfig, TokenAuth
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.graph import Graph, Node
from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Span,
    SpanBatch,
    Stack,
)
from pipeline.registry import Context

MS = 1_000_000
NOW_S = int(time.time()) // 60 * 60 - 1200  # whole minutes, twenty minutes ago
T0 = NOW_S * 1_000_000_000
RANGE = (NOW_S - 60, NOW_S + 3600)
CALLS, SLOW = 20, 7
CHILD = (100).to_bytes(8, "big")
H, S, D, L = 1, 2, 3, 4  # stacks (leaf first): handle, slow_path, db_exec, lock_wait
FRAMES = {H: ["handle", "main"], S: ["slow_path", "handle", "main"],
          D: ["db_exec", "query_fn", "main"], L: ["lock_wait", "query_fn", "main"]}


def ids(i: int) -> tuple[bytes, bytes]:
    return (i + 1).to_bytes(16, "big"), (i + 1).to_bytes(8, "big")


def batches(tenant: str) -> list[Any]:
    """shop/checkout: 20 calls of 100+i ms burning 20 ms in handle; call 7 lasts 2 s and
    burns 500 ms more in slow_path, and has a child span ``query`` (link+time: 30 ms in
    db_exec, 800 ms of wall in lock_wait); call 3 has 5 ms by thread (approximate).
    Tenant b: the same ids, its functions named ``b_...``."""
    pre = "" if tenant == "a" else "b_"
    stacks = {k: Stack(k, [pre + f for f in v], [], []) for k, v in FRAMES.items()}
    spans, attrs = [], []
    for i in range(CALLS):
        tid, sid = ids(i)
        start = T0 + i * 1000 * MS
        dur = 2000 * MS if i == SLOW else (100 + i) * MS
        spans.append(Span(tid, sid, b"", "checkout", 2, "shop", start, start + dur))
        cpu = {H: 20 * MS} | ({S: 500 * MS} if i == SLOW else {})
        incl = sum(cpu.values()) + (30 * MS if i == SLOW else 0)
        attrs.append(Attribution(
            tid, sid, "link", "shop", "checkout", b"", start, dur, True, sum(cpu.values()), 0,
            sum(cpu.values()) // (10 * MS), {pre + FRAMES[k][0]: v for k, v in cpu.items()},
            {}, 1, incl, cpu))
        if i == 3:
            attrs.append(Attribution(tid, sid, "thread", "shop", "checkout", b"", start, dur,
                                     True, 5 * MS, 0, 1, {pre + "handle": 5 * MS}, {}, 2,
                                     5 * MS, {H: 5 * MS}))
    tid, sid = ids(SLOW)
    start = T0 + SLOW * 1000 * MS + 100 * MS
    spans.append(Span(tid, CHILD, sid, "query", 3, "shop", start, start + 1000 * MS))
    attrs.append(Attribution(tid, CHILD, "link+time", "shop", "query", sid, start, 1000 * MS,
                             True, 30 * MS, 800 * MS, 3, {pre + "db_exec": 30 * MS},
                             {pre + "lock_wait": 800 * MS}, 3, 30 * MS, {D: 30 * MS},
                             {L: 800 * MS}))
    return [SpanBatch(spans, tenant=tenant), ProfileBatch([], stacks, tenant=tenant),
            AttributionBatch(attrs, tenant=tenant)]


@contextlib.asynccontextmanager
async def open_store(tmp_path: Path) -> AsyncIterator[ClickHouseExporter]:
    """Tenants a's and b's calls (``batches``) in the embedded engine on ``tmp_path``."""
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                   ttl=0),
                            Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
    try:
        await ex.start()
        for tenant in ("a", "b"):
            for batch in batches(tenant):
                await ex.consume(batch)
        yield ex
    finally:
        await ex.shutdown()


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def store(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ClickHouseExporter]:
    """One store per class, for tests that only read it (they run on the class's loop:
    ``ON_CLASS_LOOP``); shut down at the class's end, as chdb takes one engine path per
    process. A test that writes has its own (``TestWrites``)."""
    async with open_store(tmp_path_factory.mktemp("ui_api")) as ex:
        yield ex


# the async tests on a class-scoped store run on their class's loop, as the store does (one
# by one where the class also holds a sync test: pytest-asyncio warns about a marked one)
ON_CLASS_LOOP = pytest.mark.asyncio(loop_scope="class")


def hexid(i: int) -> tuple[str, str]:
    t, s = ids(i)
    return t.hex(), s.hex()


class TestQueries:
    @ON_CLASS_LOOP
    async def test_operations_and_search(self, store: ClickHouseExporter) -> None:
        """The operations with their calls; the search finds the slow call first by
        duration, with its inclusive CPU, off-CPU, samples and method, and every filter
        and order narrows or sorts as asked; approximate figures ride along."""
        ops = await ui_queries.operations(store, "spanprof", RANGE, tenant="a")
        assert ops["services"] == [{"name": "shop", "operations": [
            {"name": "checkout", "calls": CALLS, "cpu_ns": (CALLS * 20 + 500) * MS},
            {"name": "query", "calls": 1, "cpu_ns": 30 * MS}]}]
        got = await ui_queries.search_calls(store, "spanprof", RANGE, service="shop",
                                         operation="checkout", limit=5, tenant="a")
        assert got["matched"] == CALLS and len(got["calls"]) == 5
        first = got["calls"][0]
        assert (first["trace_id"], first["span_id"]) == hexid(SLOW)
        assert (first["duration_ns"], first["cpu_ns"], first["inclusive_cpu_ns"],
                first["off_cpu_ns"]) == (2000 * MS, 520 * MS, 550 * MS, 1450 * MS)
        assert (first["method"], first["sample_count"], first["name"]) == \
            ("link", 52, "checkout")
        assert first["start_time_unix_nano"] == T0 + SLOW * 1000 * MS
        assert [c["duration_ns"] for c in got["calls"][1:]] == \
            [119 * MS, 118 * MS, 117 * MS, 116 * MS]
        slow = await ui_queries.search_calls(store, "spanprof", RANGE, service="shop",
                                          min_duration_ns=1000 * MS, tenant="a")
        assert [(c["name"], c["duration_ns"]) for c in slow["calls"]] == \
            [("query", 1000 * MS), ("checkout", 2000 * MS)][::-1] and slow["matched"] == 2
        window = await ui_queries.search_calls(store, "spanprof", RANGE, operation="checkout",
                                            min_duration_ns=105 * MS,
                                            max_duration_ns=110 * MS, order="self_cpu",
                                            tenant="a")
        assert [c["duration_ns"] // MS for c in window["calls"]] == [105, 106, 108, 109, 110]
        cpu = await ui_queries.search_calls(store, "spanprof", RANGE, min_cpu_ns=25 * MS,
                                         order="cpu", tenant="a")
        assert [c["name"] for c in cpu["calls"]] == ["checkout", "query"]
        off = await ui_queries.search_calls(store, "spanprof", RANGE, order="off_cpu",
                                         limit=2, tenant="a")
        assert [c["off_cpu_ns"] for c in off["calls"]] == [1450 * MS, 970 * MS]
        assert off["calls"][1]["method"] == "link+time"
        three = await ui_queries.search_calls(store, "spanprof", RANGE, operation="checkout",
                                           min_duration_ns=103 * MS,
                                           max_duration_ns=103 * MS, tenant="a")
        assert three["calls"][0]["approximate"] == {
            "thread": {"cpu_ns": 5 * MS, "inclusive_cpu_ns": 5 * MS, "sample_count": 1}}

    @ON_CLASS_LOOP
    async def test_histogram(self, store: ClickHouseExporter) -> None:
        """Log-spaced buckets from the shortest call to the longest, the counts adding up
        to the calls, the slow call alone in the last bucket with its CPU share, and the
        percentiles."""
        h = await ui_queries.duration_histogram(store, "spanprof", "shop", "checkout", RANGE,
                                             10, tenant="a")
        assert h["calls"] == CALLS and len(h["buckets"]) == 10
        assert sum(b["count"] for b in h["buckets"]) == CALLS
        assert h["buckets"][0]["from_ns"] == 100 * MS
        assert h["buckets"][-1] == {"from_ns": h["buckets"][-1]["from_ns"],
                                    "to_ns": 2000 * MS, "count": 1, "cpu_share": 550 / 2000}
        assert all(a["to_ns"] == b["from_ns"] for a, b in
                   zip(h["buckets"], h["buckets"][1:], strict=False))
        assert h["p99_ns"] == 2000 * MS and 100 * MS < h["p50_ns"] < 120 * MS
        none = await ui_queries.duration_histogram(store, "spanprof", "shop", "nothing", RANGE,
                                                tenant="a")
        assert (none["calls"], none["buckets"], none["p99_ns"]) == (0, [], None)

    @ON_CLASS_LOOP
    async def test_function_spans(self, store: ClickHouseExporter) -> None:
        """slow_path was burnt by one span of one trace; handle by every call, the slow one
        and call 3 (with its approximate row under ``all``) first; lock_wait only shows
        by wall time; each span carries its own figures for the link back."""
        got = await ui_queries.function_spans(store, "spanprof", "slow_path", RANGE, tenant="a")
        assert [(s["trace_id"], s["span_id"], s["function_cpu_ns"]) for s in got["spans"]] \
            == [(*hexid(SLOW), 500 * MS)]
        assert got["traces"] == [{"trace_id": hexid(SLOW)[0], "function_cpu_ns": 500 * MS,
                                  "function_wall_ns": 0, "spans": 1, "service": "shop",
                                  "name": "checkout"}]
        assert (got["cpu_ns"], got["span_count"], got["trace_count"]) == (500 * MS, 1, 1)
        s = got["spans"][0]
        assert (s["name"], s["duration_ns"], s["cpu_ns"], s["method"]) == \
            ("checkout", 2000 * MS, 520 * MS, "link")
        handle = await ui_queries.function_spans(store, "spanprof", "handle", RANGE, limit=3,
                                              method="all", tenant="a")
        assert handle["span_count"] == CALLS and len(handle["spans"]) == 3
        assert handle["spans"][0]["span_id"] == hexid(3)[1]  # 20 + 5 ms by thread
        assert handle["cpu_ns"] == (CALLS * 20 + 5) * MS
        lock = await ui_queries.function_spans(store, "spanprof", "lock_wait", RANGE,
                                            order="wall", tenant="a")
        assert [(s["name"], s["function_wall_ns"]) for s in lock["spans"]] == \
            [("query", 800 * MS)]
        assert (await ui_queries.function_spans(store, "spanprof", "lock_wait", RANGE,
                                             tenant="a"))["spans"] == []

    @ON_CLASS_LOOP
    async def test_span_flame_graph_with_and_without_children(
            self, store: ClickHouseExporter) -> None:
        """With children the slow call's flame graph includes its child's db_exec (CPU),
        and its wall graph the child's lock_wait; alone, only its own frames. Nodes are
        paths (hash, parent hash, frame, value), merged from the stacks."""
        tid, sid = hexid(SLOW)
        both = await flame_queries.span_flame(store, "spanprof", tid, sid, method="all",
                                        tenant="a")
        assert (both["spans"], both["cpu_ns"], both["wall_ns"], both["total"],
                both["stack_count"]) == (2, 550 * MS, 800 * MS, 550 * MS, 3)
        tree = flame_tree(both["nodes"], both["total"])
        assert tree == {"n": "all", "v": 550 * MS, "c": [{"n": "main", "v": 550 * MS, "c": [
            {"n": "handle", "v": 520 * MS, "c": [{"n": "slow_path", "v": 500 * MS}]},
            {"n": "query_fn", "v": 30 * MS, "c": [{"n": "db_exec", "v": 30 * MS}]}]}]}
        wall = await flame_queries.span_flame(store, "spanprof", tid, sid, measure="wall",
                                        method="all", tenant="a")
        assert [n[2] for n in wall["nodes"]] == ["main", "query_fn", "lock_wait"]
        alone = await flame_queries.span_flame(store, "spanprof", tid, sid, children=False,
                                         tenant="a")
        assert (alone["spans"], alone["total"], alone["wall_ns"]) == (1, 520 * MS, 0)
        assert {n[2] for n in alone["nodes"]} == {"main", "handle", "slow_path"}
        few = await flame_queries.span_flame(store, "spanprof", tid, sid, max_nodes=3,
                                       method="all", tenant="a")
        assert [n[2] for n in few["nodes"]] == ["main", "handle", "slow_path"]
        assert few["nodes_left_out"] == 2  # query_fn, db_exec: the smallest

    @ON_CLASS_LOOP
    async def test_operation_flame_graph_and_base(self, store: ClickHouseExporter) -> None:
        """An operation's nodes over a range; against a base range, each kept node's
        value there and both ranges' calls."""
        got = await flame_queries.operation_flame(store, "spanprof", "shop", "checkout", RANGE,
                                            tenant="a")
        assert got["total"] == (CALLS * 20 + 500) * MS and "base_values" not in got
        same = await flame_queries.operation_flame(store, "spanprof", "shop", "checkout", RANGE,
                                             base=RANGE, tenant="a")
        assert same["base_values"] == {h: v for h, _, _, v in same["nodes"]}
        assert (same["calls"], same["base_calls"], same["base_total"]) == \
            (CALLS, CALLS, same["total"])

    @ON_CLASS_LOOP
    async def test_one_span(self, store: ClickHouseExporter) -> None:
        """One span read by its ids has the figures its trace gives it; an unknown one is
        None."""
        tid, sid = hexid(3)
        one = await ui_queries.span(store, "spanprof", tid, sid, tenant="a")
        whole = await queries.trace(store, "spanprof", tid, tenant="a")
        assert one == next(s for s in whole["spans"] if s["span_id"] == sid)
        assert one is not None and one["approximate"]["thread"]["cpu_ns"] == 5 * MS
        assert await ui_queries.span(store, "spanprof", tid, "00" * 8, tenant="a") is None
        assert await ui_queries.span(store, "spanprof", tid, sid, tenant="c") is None

    @ON_CLASS_LOOP
    async def test_path_hashes_tell_paths_apart(self, store: ClickHouseExporter) -> None:
        """PATH_HASHES gives every distinct path (prefix of frames) its own hash, and its
        parent's prefix sum: 50 000 random stacks up to 40 frames deep, over 6 names that
        recur at every depth (recursion), so that many paths share frames in other
        orders or places."""
        _, rows = await store.query(
            f"SELECT uniqExact(h), uniqExact(p), countIf(h = 0) FROM (SELECT f, "
            f"{flame_queries.PATH_HASHES} AS hs FROM (SELECT arrayMap(i -> concat('fn', "
            "toString(cityHash64(number, i) % 6)), range(1 + number % 40)) AS f "
            "FROM numbers(50000))) ARRAY JOIN hs AS h, arrayEnumerate(f) AS depth "
            "ARRAY JOIN [arraySlice(f, 1, depth)] AS p")
        (hashes, paths, zeros), = rows
        assert hashes == paths > 100_000 and zeros == 0

    @ON_CLASS_LOOP
    async def test_each_tenant_sees_its_own(self, store: ClickHouseExporter) -> None:
        """b's answers name b's functions only; a tenant with no data gets nothing."""
        tid, sid = hexid(SLOW)
        b = await ui_queries.function_spans(store, "spanprof", "b_slow_path", RANGE, tenant="b")
        assert b["span_count"] == 1
        assert (await ui_queries.function_spans(store, "spanprof", "b_slow_path", RANGE,
                                             tenant="a"))["spans"] == []
        prof = await flame_queries.span_flame(store, "spanprof", tid, sid, tenant="b")
        assert prof["nodes"] and all(n[2].startswith("b_") for n in prof["nodes"])
        for tenant in ("c", "x' OR 1=1 --"):
            assert (await ui_queries.operations(store, "spanprof", RANGE,
                                             tenant=tenant))["services"] == []
            got = await ui_queries.search_calls(store, "spanprof", RANGE, tenant=tenant)
            assert (got["matched"], got["calls"]) == (0, [])
            assert (await ui_queries.duration_histogram(store, "spanprof", "shop", None, RANGE,
                                                     tenant=tenant))["calls"] == 0
            assert (await flame_queries.span_flame(store, "spanprof", tid, sid,
                                                   tenant=tenant))["nodes"] == []
            assert (await flame_queries.operation_calls(store, "spanprof", "shop", None,
                                                        RANGE, tenant=tenant)) == 0

    def test_every_function_needs_a_tenant(self) -> None:
        """``tenant`` is a required keyword of each new query function: every public
        function of ui_queries and flame_queries (so that one added later is checked too)."""
        funcs = [f for m in (ui_queries, flame_queries) for n, f in vars(m).items()
                 if inspect.iscoroutinefunction(f) and not n.startswith("_")
                 and f.__module__ == m.__name__]
        assert len(funcs) >= 8
        for f in funcs:
            name = f.__name__
            p = inspect.signature(f).parameters["tenant"]
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
            assert p.default is inspect.Parameter.empty, name


class TestWrites:
    """Tests that add rows: each on a store of its own (not the shared one)."""

    @pytest_asyncio.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[ClickHouseExporter]:
        async with open_store(tmp_path) as ex:
            yield ex

    async def test_one_span_with_rows_stored_without_their_trace(
            self, store: ClickHouseExporter) -> None:
        """Rows stored with a span id alone (``trace_id ''``) count for the span whose
        trace span_index gives them, as in its trace; not for the same span id elsewhere."""
        tid, sid = hexid(5)
        extra = Attribution(b"", ids(5)[1], "link", "shop", "checkout", b"", T0, 0, False,
                            7 * MS, 0, 1, {"handle": 7 * MS}, {}, 9, 7 * MS, {H: 7 * MS})
        await store.consume(AttributionBatch([extra], tenant="a"))
        await store.consume(AttributionBatch([extra], tenant="b"))
        one = await ui_queries.span(store, "spanprof", tid, sid, tenant="a")
        whole = await queries.trace(store, "spanprof", tid, tenant="a")
        assert one == next(s for s in whole["spans"] if s["span_id"] == sid)
        assert one is not None and one["cpu_ns"] == (20 + 7) * MS
        other = await ui_queries.span(store, "spanprof", hexid(6)[0], sid, tenant="a")
        assert other is None  # that span id is trace 5's


class TestFlameTree:
    def test_tree_and_difference(self) -> None:
        """Nodes nest under their parents with children sorted by name; with a base, each
        node's ``d`` is its value less the base's scaled one; a node whose parent is not
        there is left out."""
        nodes = [(1, 0, "main", 45), (3, 1, "b", 30), (2, 1, "a", 10), (9, 8, "orphan", 1)]
        assert flame_tree(nodes, 45) == {"n": "all", "v": 45, "c": [
            {"n": "main", "v": 45, "c": [{"n": "a", "v": 10}, {"n": "b", "v": 30}]}]}
        diff = flame_tree(nodes, 45, base={1: 14, 3: 10}, base_total=14, scale=2)
        assert diff == {"n": "all", "v": 45, "d": 17, "c": [
            {"n": "main", "v": 45, "d": 17, "c": [{"n": "a", "v": 10, "d": 10},
                                                  {"n": "b", "v": 30, "d": 10}]}]}
        assert flame_tree([], 0) == {"n": "all", "v": 0}

    def test_compact_nodes(self) -> None:
        """format=nodes: each frame name once, four numbers a node (parent's position or
        -1, frame's position, value, difference), parents first; the same graph as the
        tree, orphans left out too."""
        nodes = [(1, 0, "main", 45), (3, 1, "b", 30), (2, 1, "a", 10), (4, 3, "a", 5),
                 (9, 8, "orphan", 1)]
        assert flame_nodes(nodes, 45) == {"total": 45, "frames": ["main", "b", "a"],
                                          "nodes": [-1, 0, 45, 0, 0, 1, 30, 0, 0, 2, 10, 0,
                                                    1, 2, 5, 0]}
        diff = flame_nodes(nodes, 45, base={1: 14, 3: 10}, base_total=14, scale=2)
        assert diff["total_d"] == 17 and diff["nodes"][3::4] == [17, 10, 10, 5]
        assert flame_nodes([], 0) == {"total": 0, "frames": [], "nodes": []}

    def test_deep_trees(self) -> None:
        """No recursion: a tree deeper than Python's recursion limit."""
        tree = flame_tree([(i + 1, i, f"f{i}", 1) for i in range(5000)], 1)
        depth = 0
        while "c" in tree:
            tree, depth = tree["c"][0], depth + 1
        assert depth == 5000


@pytest_asyncio.fixture(loop_scope="class")  # on TestHttp's loop, as its store
async def admin(store: ClickHouseExporter) -> AsyncIterator[AdminServer]:
    graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                  order=["exporter:clickhouse"])
    server = AdminServer("127.0.0.1:0", graph)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown()


def fetch(port: int, path: str, headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def as_tree(graph: dict[str, Any]) -> dict[str, Any]:
    """format=nodes' graph as flame_tree's tree, as the UI builds it (flame.js)."""
    diff = "total_d" in graph
    root: dict[str, Any] = {"n": "all", "v": graph["total"]} | (
        {"d": graph["total_d"]} if diff else {})
    made: list[dict[str, Any]] = []
    flat = graph["nodes"]
    for i in range(0, len(flat), 4):
        up, frame, value, d = flat[i:i + 4]
        node = {"n": graph["frames"][frame], "v": value} | ({"d": d} if diff else {})
        (root if up < 0 else made[up]).setdefault("c", []).append(node)
        made.append(node)
    todo = [root]
    while todo:  # flame_tree sorts children by name
        n = todo.pop()
        n.get("c", []).sort(key=lambda c: c["n"])
        todo += n.get("c", [])
    return root


BAD = [
    ("/api/v1/operations?range=nope", "range"),
    ("/api/v1/search?order=size", "order"),
    ("/api/v1/search?min_duration=fast", "min_duration"),
    ("/api/v1/search?max_duration=-1s", "max_duration"),
    ("/api/v1/search?min_cpu=1e400s", "min_cpu"),
    ("/api/v1/search?limit=0", "limit"),
    ("/api/v1/search?service=a%00b", "service"),
    ("/api/v1/search?range=2h..3h", "range"),
    ("/api/v1/histogram?operation=x", "service"),
    ("/api/v1/histogram?service=shop&buckets=500", "buckets"),
    ("/api/v1/histogram?service=shop&buckets=ten", "buckets"),
    ("/api/v1/function_spans?service=shop", "function"),
    ("/api/v1/function_spans?function=f&order=both", "order"),
    ("/api/v1/function_spans?function=f&method=guess", "method"),
    ("/api/v1/function_spans?function=" + "x" * 1025, "function"),
    ("/api/v1/flamegraph?trace_id=zz&span_id=0000000000000001", "trace_id"),
    ("/api/v1/flamegraph?trace_id=" + "0" * 32, "span_id"),
    ("/api/v1/flamegraph?trace_id=" + "0" * 32 + "&span_id=" + "0" * 16 + "&children=2",
     "children"),
    ("/api/v1/flamegraph?trace_id=" + "0" * 32 + "&span_id=" + "0" * 16 + "&measure=heap",
     "measure"),
    ("/api/v1/flamegraph?operation=x", "service"),
    ("/api/v1/flamegraph?service=shop&base=later", "base"),
    ("/api/v1/flamegraph?service=shop&max_nodes=0", "max_nodes"),
    ("/api/v1/traces/" + "0" * 32 + "/spans/xyz", "span_id"),
    ("/api/v1/flamegraph?service=shop&max_nodes=100001", "max_nodes"),
    ("/api/v1/flamegraph?service=shop&format=svg", "format"),
]


@ON_CLASS_LOOP
class TestHttp:
    @pytest.mark.parametrize(("path", "field"), BAD)
    async def test_a_bad_parameter_is_a_400_naming_it(self, admin: AdminServer, path: str,
                                                      field: str) -> None:
        """Checked before any query runs; the message starts with the parameter's name."""
        assert admin.port is not None
        status, _, body = await asyncio.to_thread(fetch, admin.port, path)
        assert status == 400, body
        assert msgspec.json.decode(body)["error"].startswith(f"{field}:")

    async def test_answers(self, admin: AdminServer) -> None:
        """The endpoints answer the default tenant's data (none here but a's and b's: so
        nothing), and the flame graph of a span of tenant a through X-Scope-OrgID."""
        assert admin.port is not None
        port, tid, sid = admin.port, *hexid(SLOW)
        hdr = {"X-Scope-OrgID": "a"}

        def get(path: str) -> Any:
            status, _, body = fetch(port, path, hdr)
            assert status == 200, body
            return msgspec.json.decode(body)

        got = await asyncio.to_thread(
            get, "/api/v1/search?service=shop&min_duration=1.5s&order=cpu&range=2h")
        assert [c["span_id"] for c in got["calls"]] == [sid]
        hist = await asyncio.to_thread(get, "/api/v1/histogram?service=shop&range=2h")
        assert hist["calls"] == CALLS + 1 and len(hist["buckets"]) == 40
        fn = await asyncio.to_thread(get, "/api/v1/function_spans?function=slow_path&range=2h")
        assert fn["traces"][0]["trace_id"] == tid
        fg = await asyncio.to_thread(
            get, f"/api/v1/flamegraph?trace_id={tid}&span_id={sid}&children=0")
        assert (fg["tree"]["v"], fg["stack_count"], fg["measure"]) == (520 * MS, 2, "cpu")
        assert [c["n"] for c in fg["tree"]["c"][0]["c"]] == ["handle"]
        one = await asyncio.to_thread(get, f"/api/v1/traces/{tid}/spans/{sid}")
        assert (one["name"], one["cpu_ns"]) == ("checkout", 520 * MS)
        status, _, _ = await asyncio.to_thread(fetch, port, f"/api/v1/traces/{tid}/spans/"
                                               f"{'ab' * 8}", hdr)
        assert status == 404
        wall = await asyncio.to_thread(
            get, f"/api/v1/flamegraph?trace_id={tid}&span_id={sid}&measure=wall&method=all")
        assert wall["tree"]["v"] == 800 * MS
        op = await asyncio.to_thread(
            get, "/api/v1/flamegraph?service=shop&operation=checkout&range=2h")
        assert op["tree"]["v"] == (CALLS * 20 + 500) * MS and "d" not in op["tree"]
        # against a range with no calls: per second, everything new
        lo = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW_S - 7200))
        hi = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW_S - 3600))
        diff = await asyncio.to_thread(
            get, f"/api/v1/flamegraph?service=shop&operation=checkout&range=2h"
                 f"&base={lo}..{hi}")
        assert diff["unit_of_diff"] == "per_second" and diff["base_calls"] == 0
        assert diff["tree"]["d"] == diff["tree"]["v"]
        same = await asyncio.to_thread(
            get, "/api/v1/flamegraph?service=shop&operation=checkout&range=2h&base=2h")
        assert same["unit_of_diff"] == "per_call" and same["tree"]["d"] == 0
        # format=nodes (the UI's): the same graphs, compact
        for q in (f"trace_id={tid}&span_id={sid}&measure=wall&method=all",
                  f"service=shop&operation=checkout&range=2h&base={lo}..{hi}"):
            tree = await asyncio.to_thread(get, f"/api/v1/flamegraph?{q}")
            compact = await asyncio.to_thread(get, f"/api/v1/flamegraph?{q}&format=nodes")
            assert "tree" not in compact and as_tree(compact["graph"]) == tree["tree"]
            # a relative range ends at each request's own second: the two may straddle one
            for edge in ("from", "to"):
                assert 0 <= compact.get(edge, 0) - tree.get(edge, 0) <= 1, edge
            assert {k: v for k, v in compact.items() if k not in ("graph", "from", "to")} == \
                {k: v for k, v in tree.items() if k not in ("tree", "from", "to")}

    async def test_ui_files(self, admin: AdminServer) -> None:
        """/ui redirects to /ui/, which is index.html; a file comes with its type, an
        ETag (304 when it still matches) and a policy that loads nothing from elsewhere;
        a path not in the UI is a 404 that never touches the file system."""
        assert admin.port is not None
        port = admin.port
        status, headers, body = await asyncio.to_thread(fetch, port, "/ui")
        assert status == 200 and b"<html" in body  # followed the redirect
        assert headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        status, headers, body = await asyncio.to_thread(fetch, port, "/ui/app.js")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript")
        status, _, body = await asyncio.to_thread(
            fetch, port, "/ui/app.js", {"If-None-Match": headers["ETag"]})
        assert (status, body) == (304, b"")
        for path in ("/ui/../server.py", "/ui/nope.js", "/ui/%2e%2e/server.py"):
            status, _, _ = await asyncio.to_thread(fetch, port, path)
            assert status == 404, path
        assert "vendor/d3.min.js" in StaticUi().files
        assert "vendor/LICENSE-d3-flame-graph" in StaticUi().files

    async def test_ui_files_named_by_version(self, admin: AdminServer) -> None:
        """index.html names boot.js, app.js and the stylesheets with their version (their
        ETag): asked for with it, a file is served as never changing; with another
        version or none, it is revalidated as the others are."""
        assert admin.port is not None
        port = admin.port
        _, headers, index = await asyncio.to_thread(fetch, port, "/ui/")
        assert headers["Cache-Control"] == "no-cache"
        for name in ("boot.js", "app.js", "style.css", "vendor/d3-flamegraph.css"):
            _, headers, body = await asyncio.to_thread(fetch, port, f"/ui/{name}")
            assert headers["Cache-Control"] == "no-cache"
            version = headers["ETag"].strip('"')
            assert f'="{name}?v={version}"'.encode() in index, name
            _, fresh, same = await asyncio.to_thread(fetch, port, f"/ui/{name}?v={version}")
            assert fresh["Cache-Control"] == "max-age=31536000, immutable" and same == body
            _, stale, _ = await asyncio.to_thread(fetch, port, f"/ui/{name}?v=0{version}")
            assert stale["Cache-Control"] == "no-cache"
        # the modules app.js imports: by version through index.html's import map, which
        # the policy allows by its hash (and no other inline script)
        imap = index.split(b'<script type="importmap">')[1].split(b"</script>")[0]
        modules = json.loads(imap)["imports"]
        assert set(modules) >= {"./lib.js", "./flame.js", "./views/span.js"}
        for key, url in modules.items():
            _, headers, _ = await asyncio.to_thread(fetch, port, f"/ui/{key[2:]}")
            assert url == f"{key}?v={headers['ETag'].strip(chr(34))}"
        digest = base64.b64encode(hashlib.sha256(imap).digest()).decode()
        _, headers, _ = await asyncio.to_thread(fetch, port, "/ui/")
        assert f"script-src 'self' 'sha256-{digest}';" in headers["Content-Security-Policy"]

    async def test_ui_files_need_no_token_the_api_does(
            self, store: ClickHouseExporter) -> None:
        """With tokens on, the UI's files are served without one (they hold no data); its
        API calls are not."""
        auth = TokenAuth(AuthConfig(tokens={"token-of-tenant-a-0123456789": "a"}),
                         "tenantauth", None)
        await auth.start()
        graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                      order=["exporter:clickhouse"])
        server = AdminServer("127.0.0.1:0", graph, auth=auth)
        await server.start()
        try:
            assert server.port is not None
            for path in ("/ui/", "/ui/index.html", "/ui/vendor/d3.min.js"):
                status, _, _ = await asyncio.to_thread(fetch, server.port, path)
                assert status == 200, path
            status, _, _ = await asyncio.to_thread(fetch, server.port, "/api/v1/search")
            assert status == 401
            status, _, body = await asyncio.to_thread(
                fetch, server.port, "/api/v1/search?range=2h",
                {"Authorization": "Bearer token-of-tenant-a-0123456789"})
            assert status == 200 and msgspec.json.decode(body)["matched"] == CALLS + 1
        finally:
            await server.shutdown()
            await auth.shutdown()

"""``why`` (issue #21) on the real embedded engine: an operation where 2% of the calls burn
CPU in a function the others never run, and carry an oversized cart; one where 2% of the
calls wait (a lock: wall time in a function, CPU as the others); two tenants with the same
ids. Figures are checked exactly where they are exact (totals, means) and by their marks
where they are statistical (intervals, ``few``)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from pipeline import cli, flamegraph, why_text
from pipeline.admin import queries, why
from pipeline.admin.server import AdminServer
from pipeline.admin.why_attributes import attributes
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
NOW_S = int(time.time()) // 60 * 60 - 1800
T0 = NOW_S * 1_000_000_000
RANGE = (NOW_S - 60, NOW_S + 3600)
CALLS = 200
SLOW = {3, 50, 99, 150}  # 2% of the calls
HANDLE, SLOW_PATH, LOCK = 11, 12, 13  # stack ids: leaf handle / slow_path / lock_wait
STACKS = {HANDLE: Stack(HANDLE, ["handle", "main"], [], []),
          SLOW_PATH: Stack(SLOW_PATH, ["slow_path", "handle", "main"], [], []),
          LOCK: Stack(LOCK, ["lock_wait", "handle", "main"], [], [])}


def ids(i: int, salt: int = 0) -> tuple[bytes, bytes]:
    return (i + 1 + salt * 1000).to_bytes(16, "big"), (i + 1).to_bytes(8, "big")


def row(tid: bytes, sid: bytes, name: str, start: int, dur: int, cpu: dict[int, int],
        wall: dict[int, int], fns: dict[int, str]) -> Attribution:
    c, w = sum(cpu.values()), sum(wall.values())
    return Attribution(tid, sid, "link", "shop", name, b"", start, dur, True, c, w,
                       max(1, c // (10 * MS)),
                       {fns[k]: v for k, v in cpu.items()},
                       {fns[k]: v for k, v in wall.items()}, 1, c,
                       {k: v for k, v in cpu.items()}, {k: v for k, v in wall.items()})


def burning(tenant_salt: int = 0) -> tuple[list[Span], list[Attribution]]:
    """place order: typical calls 150-250 ms with 90-110 ms in handle; the SLOW ones 3 s,
    2.5 s of it in slow_path (plus handle's 100 ms) and a cart of 400 items."""
    rnd = random.Random(7)
    spans, attrs = [], []
    for i in range(CALLS):
        tid, sid = ids(i, tenant_salt)
        start = T0 + i * 10 * MS
        slow = i in SLOW
        dur = 3000 * MS if slow else rnd.randint(150, 250) * MS
        cart = 400 + i % 3 if slow else rnd.randint(1, 5)
        spans.append(Span(tid, sid, b"", "place order", 2, "shop", start, start + dur,
                          attributes={"cart.size": str(cart), "request.id": f"r{i}",
                                      "region": rnd.choice(["eu", "us"])}))
        cpu = {HANDLE: 100 * MS if slow else rnd.randint(90, 110) * MS}
        if slow:
            cpu[SLOW_PATH] = 2500 * MS
        attrs.append(row(tid, sid, "place order", start, dur, cpu, {},
                         {HANDLE: "handle", SLOW_PATH: "slow_path"}))
    return spans, attrs


def waiting() -> tuple[list[Span], list[Attribution]]:
    """get cart: the same CPU in every call (50 ms in handle); the SLOW ones last 2 s,
    1.9 s of it waiting in lock_wait (wall), the others 60 ms (10 ms of wall waiting)."""
    spans, attrs = [], []
    for i in range(CALLS):
        tid, sid = ids(i, 5)
        start = T0 + i * 10 * MS
        slow = i in SLOW
        dur = 2000 * MS if slow else 60 * MS
        spans.append(Span(tid, sid, b"", "get cart", 2, "shop", start, start + dur))
        wait = 1900 * MS if slow else 10 * MS
        attrs.append(row(tid, sid, "get cart", start, dur, {HANDLE: 50 * MS},
                         {HANDLE: 50 * MS, LOCK: wait}, {HANDLE: "handle", LOCK: "lock_wait"}))
    return spans, attrs


def contended() -> tuple[list[Span], list[Attribution]]:
    """reserve stock: 40 ms of CPU in handle in every call; the SLOW ones last 1 s, 900 ms
    of it waiting for a lock (a contention profile: lock wait in Mutex.lock) and
    allocating 8 MiB in make_slice, the others 50 ms with 64 KiB allocated."""
    spans, attrs = [], []
    for i in range(CALLS):
        tid, sid = ids(i, 7)
        start = T0 + i * 10 * MS
        slow = i in SLOW
        dur = 1000 * MS if slow else 50 * MS
        spans.append(Span(tid, sid, b"", "reserve stock", 2, "shop", start, start + dur))
        a = row(tid, sid, "reserve stock", start, dur, {HANDLE: 40 * MS}, {},
                {HANDLE: "handle"})
        a.lock_ns = 900 * MS if slow else 0
        a.self_lock_ns = {"Mutex.lock": a.lock_ns} if slow else {}
        a.alloc_bytes = (8 << 20) if slow else (64 << 10)
        a.self_alloc_bytes = {"make_slice": a.alloc_bytes}
        attrs.append(a)
    return spans, attrs


# every test only reads the store: one store (and one event loop) for the module, shut down
# at its end (chdb takes one engine path per process: the next module opens its own)
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ClickHouseExporter]:
    tmp_path = tmp_path_factory.mktemp("why")
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                   ttl=0),
                            Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
    try:
        await ex.start()
        for tenant, (spans, attrs) in (("default", burning()), ("default", waiting()),
                                       ("default", contended()),
                                       ("other", burning(tenant_salt=0))):
            if tenant == "other":  # same ids, but the tail burns in handle, not slow_path,
                for sp in spans:  # and every cart is of one item
                    sp.attributes = {**sp.attributes, "cart.size": "1"}
                for a in attrs:
                    if SLOW_PATH in a.stack_cpu_ns:
                        a.stack_cpu_ns = {HANDLE: a.cpu_ns}
                        a.self_cpu_ns = {"handle": a.cpu_ns}
            await ex.consume(SpanBatch(spans, tenant=tenant))
            await ex.consume(ProfileBatch([], STACKS, tenant=tenant))
            await ex.consume(AttributionBatch(attrs, tenant=tenant))
        # ping: spans and no profile at all (2% of them slow)
        await ex.consume(SpanBatch([Span(*ids(i, 9), b"", "ping", 2, "shop", T0 + i * MS,
                                         T0 + i * MS + (900 if i in SLOW else 9) * MS)
                                    for i in range(CALLS)]))
        yield ex
    finally:
        await ex.shutdown()


async def ask(db: ClickHouseExporter, operation: str, tenant: str = "default",
              **kw: Any) -> dict[str, Any]:
    kw.setdefault("slowest", 0.02)
    return await why.why(db, "spanprof", "shop", operation, RANGE, tenant=tenant, **kw)


class TestBurning:
    async def test_the_tail_and_its_function(self, store: ClickHouseExporter) -> None:
        got = await ask(store, "place order")
        assert got["calls"] == CALLS
        assert got["tail"]["calls"] == len(SLOW)
        assert got["typical"]["calls"] == CALLS - len(SLOW)
        # the tail is the duration buckets from the threshold's up (9% wide)
        assert 2750 * MS < got["threshold_ns"] <= 3000 * MS
        assert got["bucket"] == why.bucket_of(3000 * MS)
        assert got["tail"]["duration"]["per_call_ns"] == 3000 * MS
        assert got["tail"]["cpu"]["per_call_ns"] == 2600 * MS
        assert got["verdict"] == "burning"
        top = got["functions"][0]
        assert top["name"] == "slow_path"
        assert top["tail"]["per_call_ns"] == 2500 * MS
        assert top["typical"]["per_call_ns"] == 0
        assert top["delta_ns"] == 2500 * MS
        assert 0.8 < top["explains"] < 1.0
        # handle: the same in both groups (a difference under 0.1% of a tail call's
        # duration), left out
        assert [f["name"] for f in got["functions"]] == ["slow_path"]

    async def test_typical_figures_are_the_operations_less_the_tail(
            self, store: ClickHouseExporter) -> None:
        """Exact: the typical group's mean CPU is the operation's CPU less the tail's,
        over the typical calls (not a sample's mean)."""
        got = await ask(store, "place order")
        spans, attrs = burning()
        typical = [a.cpu_ns for a in attrs if int.from_bytes(a.span_id, "big") - 1
                   not in SLOW]
        assert got["typical"]["cpu"]["per_call_ns"] == pytest.approx(
            sum(typical) / len(typical), rel=1e-12)
        durs = [s.end_ns - s.start_ns for i, s in enumerate(spans) if i not in SLOW]
        assert got["typical"]["duration"]["per_call_ns"] == pytest.approx(
            sum(durs) / len(durs), rel=1e-12)
        assert got["extra_ns"] == pytest.approx(3000 * MS - sum(durs) / len(durs))

    async def test_the_distinguishing_attribute(self, store: ClickHouseExporter) -> None:
        """cart.size sets the tail apart completely; region does not; request.id, a value
        per call, is an id and left out."""
        got = await ask(store, "place order")
        keys = [a["key"] for a in got["attributes"]]
        assert keys[0] == "cart.size"
        cart = got["attributes"][0]
        assert cart["kind"] == "numeric" and cart["separation"] == 1.0
        assert cart["tail"]["mean"] > 100 > cart["typical"]["mean"]
        region = next(a for a in got["attributes"] if a["key"] == "region")
        assert region["separation"] < 0.6
        assert "request.id" not in keys

    async def test_few_calls_are_marked(self, store: ClickHouseExporter) -> None:
        """Four tail calls: under FEW_CALLS, every tail figure says so."""
        got = await ask(store, "place order")
        assert got["tail"]["cpu"]["few"] and got["functions"][0]["few"]
        assert not got["typical"]["cpu"]["few"]
        assert got["typical"]["cpu"]["ci_ns"] > 0

    async def test_a_tail_that_cuts_a_bucket(self, store: ClickHouseExporter) -> None:
        """The slowest 1%: two of the four 3 s calls (one duration bucket holds all four):
        exactly those two are the tail, the other two count as typical, in the calls and
        in every sum taken from the bucket's aggregates."""
        got = await ask(store, "place order", slowest=0.01)
        _, attrs = burning()
        assert (got["tail"]["calls"], got["typical"]["calls"]) == (2, CALLS - 2)
        assert got["tail"]["cpu"]["per_call_ns"] == 2600 * MS
        rest = sum(a.cpu_ns for a in attrs) - 2 * 2600 * MS
        assert got["typical"]["cpu"]["per_call_ns"] == pytest.approx(rest / (CALLS - 2))
        top = got["functions"][0]
        assert top["name"] == "slow_path" and top["tail"]["per_call_ns"] == 2500 * MS
        assert top["typical"]["per_call_ns"] == pytest.approx(2 * 2500 * MS / (CALLS - 2))
        assert top["typical"]["calls_with"] == 2
        assert got["threshold_ns"] == 3000 * MS
        svg = await ask(store, "place order", slowest=0.01, stacks=True)
        slow = next(x for x in svg["stacks"] if x["frames"][-1] == "slow_path")
        assert slow["tail_ns"] == 2500 * MS
        assert slow["typical_ns"] == pytest.approx(2 * 2500 * MS / (CALLS - 2))

    async def test_a_boundary_too_long_to_read_by_id(
            self, store: ClickHouseExporter, monkeypatch: pytest.MonkeyPatch) -> None:
        """Beyond MAX_BOUNDARY tail calls in the threshold's bucket, the whole bucket is
        the tail, and the answer says so: here four calls where two were asked for."""
        monkeypatch.setattr(why, "MAX_BOUNDARY", 1)
        got = await ask(store, "place order", slowest=0.01)
        assert (got["tail"]["calls"], got["typical"]["calls"]) == (4, CALLS - 4)
        assert got["tail"]["cpu"]["per_call_ns"] == 2600 * MS
        assert any("bucket's bound" in n for n in got["notes"])
        assert got["threshold_ns"] == why.bucket_floor_ns(why.bucket_of(3000 * MS))

    async def test_slower_than(self, store: ClickHouseExporter) -> None:
        got = await ask(store, "place order", slowest=None, slower_than_ns=1000 * MS)
        assert got["tail"]["calls"] == len(SLOW)
        assert got["functions"][0]["name"] == "slow_path"
        none = await ask(store, "place order", slowest=None, slower_than_ns=5000 * MS)
        assert none["verdict"] == "nothing to compare" and none["functions"] == []


class TestWaiting:
    async def test_waiting_not_burning_and_on_what(self, store: ClickHouseExporter) -> None:
        got = await ask(store, "get cart")
        assert got["verdict"] == "waiting"
        assert got["extra_cpu_ns"] == pytest.approx(0)
        assert got["tail"]["off_cpu"]["per_call_ns"] == 1950 * MS
        assert got["typical"]["off_cpu"]["per_call_ns"] == 10 * MS
        top = got["wall_functions"][0]
        assert top["name"] == "lock_wait"
        assert top["delta_ns"] == 1890 * MS


class TestLockAndAlloc:
    async def test_waiting_on_a_lock_and_allocating(self, store: ClickHouseExporter) -> None:
        """A contention profile says on what the tail waits: the lock's function, with
        the share of the extra duration it explains; bytes allocated per call too."""
        got = await ask(store, "reserve stock")
        assert got["verdict"] == "waiting"
        assert got["tail"]["lock"]["per_call_ns"] == 900 * MS
        # intervals from op_calls' spread (migration 15): every tail call waits 900 ms (4
        # calls: still too few), every typical call allocates 64 KiB
        assert got["tail"]["lock"]["ci_ns"] == 0.0 and got["tail"]["lock"]["few"]
        assert got["typical"]["alloc"]["ci_bytes"] == 0.0
        assert not got["typical"]["alloc"]["few"] and not got["typical"]["lock"]["few"]
        assert got["typical"]["lock"]["per_call_ns"] == 0
        assert got["extra_lock_ns"] == 900 * MS
        (top,) = got["lock_functions"]
        assert (top["name"], top["delta_ns"]) == ("Mutex.lock", 900 * MS)
        assert top["explains"] == pytest.approx(900 / 950)
        assert got["tail"]["alloc"]["per_call_bytes"] == 8 << 20
        assert got["typical"]["alloc"]["per_call_bytes"] == 64 << 10
        (fn,) = got["alloc_functions"]
        assert (fn["name"], fn["delta_bytes"], fn["explains"]) == \
            ("make_slice", (8 << 20) - (64 << 10), None)
        assert got["wall_functions"] == [] and got["functions"] == []
        assert not any("cannot say on what" in n for n in got["notes"])
        text = why_text.text(got)
        assert "lock wait" in text and "Mutex.lock" in text and "8.0 MiB" in text

    async def test_top_and_explain_by_lock_and_bytes(self, store: ClickHouseExporter) -> None:
        """``top --by lock|alloc`` and a trace's spans carry lock wait and bytes, with the
        functions behind them."""
        got = await queries.top_spans(store, "spanprof", order="lock", limit=3,
                                      tenant="default")
        assert [s["lock_ns"] for s in got] == [900 * MS] * 3
        assert got[0]["top_lock_functions"] == [{"name": "Mutex.lock", "self_ns": 900 * MS}]
        assert got[0]["top_alloc_functions"] == [{"name": "make_slice", "bytes": 8 << 20}]
        big = await queries.top_spans(store, "spanprof", order="alloc", limit=1,
                                      tenant="default")
        assert big[0]["alloc_bytes"] == 8 << 20
        tid = got[0]["trace_id"]
        (span,) = (await queries.trace(store, "spanprof", tid, tenant="default"))["spans"]
        assert (span["lock_ns"], span["alloc_bytes"]) == (900 * MS, 8 << 20)

    async def test_no_lock_profile_no_lock_figures(self, store: ClickHouseExporter) -> None:
        got = await ask(store, "get cart")
        assert got["lock_functions"] == [] and got["alloc_functions"] == []
        assert "lock wait" not in why_text.text(got)


class TestNoProfile:
    async def test_neither_burning_nor_waiting(self, store: ClickHouseExporter) -> None:
        """No CPU profile covers ping: its tail is slower, and why says it cannot tell
        burning from waiting rather than calling it waiting."""
        got = await ask(store, "ping")
        assert got["tail"]["calls"] == len(SLOW) and got["extra_ns"] > 800 * MS
        assert got["verdict"] == "unknown" and got["functions"] == []
        assert any("no CPU profile" in n for n in got["notes"])


class TestTenants:
    async def test_each_tenant_its_own_tail(self, store: ClickHouseExporter) -> None:
        """Same ids in tenant other, where the tail burns in handle: each tenant's answer
        names its own function, with its own totals."""
        mine = await ask(store, "place order")
        other = await ask(store, "place order", tenant="other")
        assert mine["functions"][0]["name"] == "slow_path"
        assert other["functions"][0]["name"] == "handle"
        assert "slow_path" not in [f["name"] for f in other["functions"]
                                   if f["tail"]["per_call_ns"]]
        # every cart of one item there: cart.size sets nothing apart, and is not listed
        assert "cart.size" not in [a["key"] for a in other["attributes"]]
        assert (await ask(store, "place order", tenant="nobody"))["calls"] == 0


class TestRefused:
    async def test_one_rule(self, store: ClickHouseExporter) -> None:
        with pytest.raises(ValueError, match="slowest"):
            await ask(store, "place order", slowest=None)
        with pytest.raises(ValueError, match="slowest"):
            await ask(store, "place order", slowest=0.1, slower_than_ns=5)


class TestApiAndCli:
    """``/api/v1/why`` checks its parameters (400 naming the one at fault) and answers;
    ``spanprof why`` prints it as text, JSON or a differential flame graph."""

    async def test_api_cli(self, store: ClickHouseExporter, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
        graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                      order=["exporter:clickhouse"])
        admin = AdminServer("127.0.0.1:0", graph)
        await admin.start()
        base = f"http://127.0.0.1:{admin.port}"
        iso = "..".join(time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(x))
                        for x in (NOW_S - 60, NOW_S + 3600))

        def get(**params: str) -> tuple[int, Any]:
            url = f"{base}/api/v1/why?{urllib.parse.urlencode(params)}"
            try:
                with urllib.request.urlopen(url, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read())

        try:
            ok = {"service": "shop", "operation": "place order", "range": iso}
            for bad, field in (({"slowest": "60%"}, "slowest"), ({"slowest": "x"}, "slowest"),
                               ({"slowest": "0"}, "slowest"),
                               ({"slower_than": "-1s"}, "slower_than"),
                               ({"slowest": "1%", "slower_than": "1s"}, "slowest"),
                               ({"range": "1h..2h"}, "range"), ({"operation": ""}, "operation"),
                               ({"limit": "0"}, "limit"), ({"method": "guess"}, "method")):
                status, body = await asyncio.to_thread(get, **{**ok, **bad})
                assert status == 400, bad
                assert body["error"].startswith(field), (bad, body)
            status, body = await asyncio.to_thread(get, **ok, slowest="2%")
            assert status == 200 and body["functions"][0]["name"] == "slow_path"
            assert "stacks" not in body

            args = ["why", "--admin", base, "--service", "shop", "--operation", "place order",
                    "--range", iso, "--slowest", "2%"]
            assert await asyncio.to_thread(cli.main, args) == 0
            out = capsys.readouterr().out
            (tmp_path / "why.txt").write_text(out)
            assert "burning" in out and "slow_path" in out and "cart.size" in out
            assert await asyncio.to_thread(cli.main, [*args, "--format", "json"]) == 0
            assert json.loads(capsys.readouterr().out)["verdict"] == "burning"
            svg = tmp_path / "why.svg"
            assert await asyncio.to_thread(
                cli.main, [*args, "--format", "svg", "-o", str(svg)]) == 0
            frames = {name: (level, w) for name, level, _, w in
                      flamegraph.parse_svg_frames(svg.read_text())}
            assert "slow_path" in frames  # drawn, and red: more in the tail
            assert 'data-name="slow_path" data-value="2500000000" data-level="3" ' \
                   'data-delta="2500000000"' in svg.read_text()
        finally:
            await admin.shutdown()


async def test_groups_wholly_apart_are_exactly_one_apart() -> None:
    """Every tail call ``central``, no typical one: separation 1.0 exactly, however the
    typical calls share the other values (the shares added as floats made
    0.9999999999999999 of 8 tail calls against 50 typical ones spread over five values)."""
    warehouses = ["north", "south", "east", "west", "dock"]
    rows = [(True, {"warehouse": "central"}, {}) for _ in range(8)]
    rows += [(False, {"warehouse": warehouses[i % 5]}, {}) for i in range(50)]

    class Rows:
        async def query(self, sql: str, parameters: dict[str, Any] | None = None
                        ) -> tuple[list[str], list[tuple[Any, ...]]]:
            return ["is_tail", "attrs", "res"], rows

    got = await attributes(Rows(), "spanprof", [0], {}, 5)
    assert got[0]["key"] == "warehouse" and got[0]["separation"] == 1.0, got
    assert got[0]["value"] == "central"

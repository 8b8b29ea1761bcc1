"""pipeline/backfill/aggregates.py on the real embedded engine: the aggregates rebuilt for a
tenant's minutes equal what the views make of the base tables' rows inserted once, after
a backfill replaced some of them, run twice, or killed after any statement, and nothing
of other tenants or minutes moves.

Tenants ``a`` and ``b`` hold the same spans and rows (same trace and span ids), so a
rebuild that strays across tenants shows; ``fresh`` is given only the rows a backfilled
tenant ends with, once, and its aggregates (made by the views) are the reference."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.backfill import aggregates
from pipeline.errors import ConfigError
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.records import Attribution, AttributionBatch, Span, SpanBatch
from pipeline.registry import Context

MS = 1_000_000
S = 10**9
T0_S = 1_700_000_040  # a minute's start
MINUTES = 6
M = [T0_S + 60 * k for k in range(MINUTES + 1)]  # each minute's start, and the end
ALL = (0, 2**32 - 1)
OPS = ["GET /cart", "POST /order", "render"]
IDLE = "sleep"


def _spans() -> list[Span]:
    """Three spans per trace, a trace starting in each minute in turn; every fifth root
    starts in its minute's last 100 ms, each child 30 s after its root, so that many
    spans start in a later minute than their trace and end in another still. The third
    span of each trace burns no CPU: it has no attribution row (most spans), and is a
    call of its operation through otel_traces alone."""
    out = []
    for t in range(24):
        tid = (t + 1).to_bytes(16, "big")
        start = (T0_S + 60 * (t % MINUTES)) * S + (59_900 * MS if t % 5 == 0 else t * S)
        root = Span(tid, (3 * t + 1).to_bytes(8, "big"), b"", OPS[t % 3], 2,
                    f"svc{t % 2}", start, start + 45 * S)
        child = Span(tid, (3 * t + 2).to_bytes(8, "big"), root.span_id, "query", 3,
                     f"svc{t % 2}", start + 30 * S, start + 32 * S + t * MS)
        idle = Span(tid, (3 * t + 3).to_bytes(8, "big"), root.span_id, IDLE, 3,
                    f"svc{t % 2}", start + 50 * S, start + 70 * S)
        out += [root, child, idle]
    return out


SPANS = _spans()
BUSY = [s for s in SPANS if s.name != IDLE]
# the traces a backfill replaces the rows of: some in every minute
REPLACED = {s.trace_id for s in SPANS if int.from_bytes(s.trace_id, "big") % 4 < 2}
# a replaced span the backfill gives no row at all
DROPPED = next(s.span_id for s in BUSY if s.trace_id in REPLACED and s.parent_span_id)


def row(s: Span, method: str, cpu: int, source: int, fn: str, stack: int,
        known: bool = True, trace_id: bytes | None = None) -> Attribution:
    return Attribution(s.trace_id if trace_id is None else trace_id, s.span_id, method,
                       s.service, s.name if known else "", s.parent_span_id, s.start_ns,
                       s.end_ns - s.start_ns, known, cpu, cpu // 2, cpu // MS,
                       {fn: cpu}, {fn: cpu // 2}, source, 2 * cpu, {stack: cpu},
                       {stack: cpu // 2})


def _old() -> list[Attribution]:
    """What the live correlator wrote: a link row per span, late delta rows (another
    source), thread rows (not calls: op_calls keeps link and link+time), rows of samples
    whose span was never seen (span_known 0: in no aggregate), and a span-only row."""
    out = []
    for i, s in enumerate(BUSY):
        out.append(row(s, "link", (i + 1) * MS, 1, f"fn{i % 4}", i % 5 + 1))
        if i % 3 == 0:
            out.append(row(s, "link", 3 * MS, 2, "late", 7))
        if i % 4 == 0:
            out.append(row(s, "thread", 2 * MS, 1, f"fn{i % 4}", 8))
        if i % 7 == 0:
            out.append(row(s, "link", 5 * MS, 1, "ghost", 9, known=False,
                           trace_id=b"\xee" * 16))
    out.append(row(BUSY[3], "link", 11 * MS, 3, "labelled", 10, trace_id=b""))
    return out


def _new() -> list[Attribution]:
    """A backfill's rows for the replaced traces: other methods, CPU, functions and
    stacks, under one source; one replaced span gets no row at all."""
    out = []
    for i, s in enumerate(BUSY):
        if s.trace_id not in REPLACED or s.span_id == DROPPED:
            continue
        out.append(row(s, "link+time", 3 * (i + 1) * MS, 42, "new_fn", 99))
        if not s.parent_span_id:
            out.append(row(s, "window", MS, 42, "new_fn", 98))
    return out


OLD, NEW = _old(), _new()
FINAL_ROWS = [r for r in OLD if r.trace_id not in REPLACED] + NEW

# each aggregate read whole, per key (AggregateFunction columns merged): what queries see
SNAPSHOT = {
    "op_minute": "service, operation, method, minute, sum(cpu_ns), sum(inclusive_cpu_ns), "
                 "sum(wall_ns), sum(sample_count), uniqExactMerge(calls)",
    "op_calls": "service, operation, minute, trace_id, span_id, sum(cpu_ns), "
                "sum(inclusive_cpu_ns), max(duration_ns)",
    "fn_minute": "service, operation, minute, function, method, sum(self_cpu_ns), "
                 "sum(self_wall_ns)",
    "op_stacks_minute": "service, operation, minute, stack_id, method, sum(cpu_ns), "
                        "sum(wall_ns)",
    "op_tail_spans": "service, operation, minute, bucket, method, sum(cpu_ns), "
                     "sum(inclusive_cpu_ns), sum(wall_ns), sum(sample_count)",
    "op_tail_functions": "service, operation, minute, bucket, function, method, "
                         "sum(self_cpu_ns), sum(self_wall_ns), round(sum(self_cpu_sq)), "
                         "round(sum(self_wall_sq)), sum(rows)",
    "op_tail_stacks": "service, operation, minute, bucket, stack_id, method, sum(cpu_ns), "
                      "sum(wall_ns)",
}


async def snapshot(store: ClickHouseExporter, tenant: str, lo: int = ALL[0],
                   hi: int = ALL[1]) -> dict[str, list[tuple[Any, ...]]]:
    out = {}
    for table, columns in SNAPSHOT.items():
        _, out[table] = await store.query(
            f"SELECT {columns} FROM spanprof.{table} WHERE tenant = {{t:String}} AND "
            "minute >= toDateTime({lo:UInt32}) AND minute < toDateTime({hi:UInt32}) "
            "GROUP BY ALL ORDER BY ALL", {"t": tenant, "lo": lo, "hi": hi})
    return out


async def load(store: ClickHouseExporter, tenant: str, rows: list[Attribution]) -> None:
    await store.consume(SpanBatch(SPANS, tenant=tenant))
    await store.consume(AttributionBatch(rows, tenant=tenant))


async def backfill(store: ClickHouseExporter, tenant: str) -> None:
    """What ``reattribute`` does: the replaced traces' rows deleted, new ones inserted;
    half of them twice (a send retried cut differently: the same keys, one row each once
    read FINAL, twice in what the views added)."""
    for table in ("span_attribution", "span_functions", "span_stacks"):
        await store.command(
            f"DELETE FROM spanprof.{table} WHERE tenant = {{t:String}} AND "
            "trace_id IN {ids:Array(String)}", {"t": tenant, "ids": [t.hex() for t in REPLACED]})
    await store.consume(AttributionBatch(NEW, tenant=tenant))
    await store.consume(AttributionBatch(NEW[::2], tenant=tenant))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ClickHouseExporter]:
    """Tenants a and b as the live pipeline left them, and fresh with the rows a
    backfilled tenant ends with."""
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                   ttl=0),
                            Context("clickhouse", ["attributions"], data_dir=str(tmp_path)))
    try:
        await ex.start()
        for tenant in ("a", "b"):
            await load(ex, tenant, OLD)
        await load(ex, "fresh", FINAL_ROWS)
        yield ex
    finally:
        await ex.shutdown()


def nonempty(snap: dict[str, list[tuple[Any, ...]]]) -> bool:
    return all(snap.values())


class TestRebuild:
    async def test_rebuilding_what_the_views_made_changes_nothing(
            self, store: ClickHouseExporter) -> None:
        """Before any backfill the aggregates are what the views made of every row (some
        spans stored twice: a client's retry); a rebuild of some minutes (spans cross
        their bounds), then of all, leaves each table reading the same."""
        await store.consume(SpanBatch(SPANS[::2], tenant="a"))
        before = await snapshot(store, "a")
        assert nonempty(before)
        await aggregates.rebuild(store, "a", M[1], M[4])
        assert await snapshot(store, "a") == before
        await aggregates.rebuild(store, "a", *ALL)
        assert await snapshot(store, "a") == before

    async def test_after_a_backfill_equals_a_store_fed_the_final_rows(
            self, store: ClickHouseExporter) -> None:
        """Old rows deleted and new ones inserted (some twice): the aggregates hold old
        and new until the rebuild, then what the views make of the final rows, once."""
        await backfill(store, "a")
        want = await snapshot(store, "fresh")
        assert nonempty(want)
        stale = await snapshot(store, "a")
        assert all(stale[t] != want[t] for t in SNAPSHOT)
        await aggregates.rebuild(store, "a", *ALL)
        assert await snapshot(store, "a") == want

    async def test_twice_is_once(self, store: ClickHouseExporter) -> None:
        """A second rebuild of the same range (a job run again) changes nothing."""
        await backfill(store, "a")
        await aggregates.rebuild(store, "a", M[0], M[MINUTES])
        once = await snapshot(store, "a")
        assert once == await snapshot(store, "fresh")
        await aggregates.rebuild(store, "a", M[0], M[MINUTES])
        assert await snapshot(store, "a") == once

    async def test_other_tenants_and_minutes_are_left_alone(
            self, store: ClickHouseExporter) -> None:
        """a and b both backfilled (the same ids): a rebuild of a's minutes 1 and 2 makes
        those right and leaves b and a's other minutes as stale as they were (each of
        which a rebuild would have changed)."""
        for tenant in ("a", "b"):
            await backfill(store, tenant)
        outside = [(ALL[0], M[1]), (M[3], ALL[1])]
        b_before = await snapshot(store, "b")
        a_before = [await snapshot(store, "a", lo, hi) for lo, hi in outside]
        assert b_before != await snapshot(store, "fresh")
        for (lo, hi), snap in zip(outside, a_before, strict=True):
            assert nonempty(snap) and snap != await snapshot(store, "fresh", lo, hi)
        await aggregates.rebuild(store, "a", M[1], M[3])
        assert await snapshot(store, "a", M[1], M[3]) == await snapshot(store, "fresh", M[1],
                                                                        M[3])
        assert await snapshot(store, "b") == b_before
        assert [await snapshot(store, "a", lo, hi) for lo, hi in outside] == a_before

    async def test_killed_after_any_statement_then_run_again(
            self, store: ClickHouseExporter) -> None:
        """A run stopped after any of its statements (after a DELETE: the minutes empty;
        within an aggregate's INSERTs: part of its rows), from stale aggregates, then run
        again whole: the result of one uninterrupted run.

        Each statement writes only its own aggregate and reads only base tables, which the
        plan never writes, and no view reads an aggregate (all asserted below): an
        aggregate's state after a kill is set by how many of its own statements ran, all
        (an aggregate before the kill), the first j (the one killed in) or none (those
        after). So instead of stopping after each statement k in turn, each run stops every
        aggregate after its first d statements, d = 0 .. the longest group (every state of
        every aggregate), and one run stops in plan order after every DELETE and the first
        INSERT (every aggregate emptied, one part-way refilled)."""
        want = await snapshot(store, "fresh")
        db = store.database
        steps = aggregates.plan(db, "a", *ALL)
        # every DELETE first (waited for together), then the INSERTs
        assert [s.split()[0] for s, _ in steps] == ["DELETE"] * 7 + ["INSERT"] * 9
        bases = {*aggregates.REPLACED, "otel_traces"}
        written: list[str] = []  # the aggregate each statement writes
        for sql, _ in steps:
            target = re.match(rf"(?:DELETE FROM|INSERT INTO) {db}\.(\w+)\b", sql)
            assert target and target[1] in aggregates.AGGREGATES, sql
            read = set(re.findall(rf"\b{db}\.(\w+)\b", sql)) - {target[1]}
            assert read <= bases if sql.startswith("INSERT") else not read, sql
            # every table named is named with its database (none read unqualified)
            assert all(t.startswith(f"{db}.") for t in
                       re.findall(r"\b(?:FROM|JOIN|INTO)\s+(?!\()(\S+)", sql)), sql
            written.append(target[1])
        # per aggregate its DELETE first, then its INSERTs
        groups = list(dict.fromkeys(written))
        assert groups == list(aggregates.AGGREGATES)
        assert all(steps[written.index(t)][0].startswith("DELETE") for t in groups)
        nth = [written[:i].count(t) for i, t in enumerate(written)]  # place in its group
        # an INSERT into an aggregate sets off no view (which could write another table)
        _, deps = await store.query(
            "SELECT name, dependencies_table FROM system.tables WHERE database = {d:String} "
            "AND name IN {n:Array(String)}", {"d": db, "n": [*aggregates.AGGREGATES, *bases]})
        assert {str(n) for n, d in deps if d} == bases, deps
        assert {str(n) for n, _ in deps} == {*aggregates.AGGREGATES, *bases}

        in_order = len(groups) + 1  # every DELETE and the first INSERT
        kills = [(f"every aggregate after its first {d} statements",
                  [i for i, j in enumerate(nth) if j < d]) for d in range(max(nth) + 2)]
        kills.append((f"stopped after statement {in_order}", list(range(in_order))))
        for what, ran in kills:
            await backfill(store, "a")  # stale again: the same rows, added to again
            plan = aggregates.plan(db, "a", *ALL)
            for i in ran:
                await store.command(*plan[i])
            await aggregates.rebuild(store, "a", *ALL)
            assert await snapshot(store, "a") == want, what


class TestViews:
    def test_every_view_into_an_aggregate_is_rebuilt(self) -> None:
        """The views read from the migrations are the nine that feed the aggregates, and
        the attribution tables are read FINAL, otel_traces as it is."""
        assert {(v.name, v.target) for v in aggregates.VIEWS} == {
            ("op_minute_mv", "op_minute"), ("op_minute_spans_mv", "op_minute"),
            ("op_calls_mv", "op_calls"), ("op_calls_spans_mv", "op_calls"),
            ("fn_minute_mv", "fn_minute"), ("op_stacks_minute_mv", "op_stacks_minute"),
            ("op_tail_spans_mv", "op_tail_spans"),
            ("op_tail_functions_mv", "op_tail_functions"),
            ("op_tail_stacks_mv", "op_tail_stacks")}
        inserts = [s for s, _ in aggregates.plan("db", "a", 0, 60) if s.startswith("INSERT")]
        assert sum(f"FROM db.{t} FINAL" in s for s in inserts for t in aggregates.REPLACED) == 7
        assert sum("FROM db.otel_traces\n" in s for s in inserts) == 2


class Distributed:
    """A store whose aggregates are Distributed tables (a cluster schema)."""

    database = "spanprof"

    def __init__(self) -> None:
        self.commands: list[str] = []

    async def query(self, sql: str, parameters: dict[str, Any] | None = None
                    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        return ["name"], [("op_minute",)]

    async def insert(self, table: str, data: list[list[Any]], columns: list[str]) -> None:
        raise AssertionError("not written")

    async def command(self, sql: str, parameters: dict[str, Any] | None = None) -> None:
        self.commands.append(sql)


class TestCluster:
    async def test_a_cluster_schema_is_refused_before_any_statement(self) -> None:
        """On Distributed aggregates a DELETE of the plain name cannot reach the shards'
        rows: refused, naming the table, nothing run."""
        store = Distributed()
        with pytest.raises(ConfigError, match=r"cluster: .*spanprof\.op_minute is a Distributed"):
            await aggregates.rebuild(store, "a", 0, 60)
        assert store.commands == []


async def test_a_delete_that_never_finishes_is_an_error_naming_it() -> None:
    """The DELETEs are waited for at the end of ``rebuild``: one ClickHouse keeps failing
    is reported with its table and reason, not waited for forever."""

    class Stuck:
        database = "spanprof"
        polls = 0

        async def query(self, sql: str, parameters: Any = None) -> tuple[Any, Any]:
            assert "system.mutations" in sql and parameters["names"] == ["op_minute"]
            self.polls += 1
            return None, [("op_minute", "mutation_7.txt", "Memory limit exceeded")]

    stuck: Any = Stuck()
    with pytest.raises(RuntimeError, match=r"spanprof\.op_minute mutation_7\.txt: Memory limit"):
        await aggregates.mutations_done(stuck, ["op_minute"], timeout_s=0.1, poll_s=0.01)
    assert stuck.polls > 1

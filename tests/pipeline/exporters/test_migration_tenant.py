"""Migration 11 (tenants) on the real embedded engine: a store at migration 10 holding rows is
upgraded with every row kept as tenant 'default' and every aggregate answering the same, and
the migration applied again after a kill at any point leaves the same rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.exporters.clickhouse import rows
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config, apply_step
from pipeline.exporters.clickhouse.migrate import bootstrap, plan
from pipeline.exporters.clickhouse.schema import MIGRATIONS, SchemaOptions
from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Sample,
    Span,
    SpanBatch,
    Stack,
    Unattributed,
)
from pipeline.registry import Context
from tests.conftest import clickhouse

OPTS = SchemaOptions(ttl_seconds=0)
DB = OPTS.database
T0 = 1_700_000_000_000_000_000
# every table migration 11 rebuilds (the plain and materialized views are made anew)
TABLES = ["otel_traces", "otel_traces_trace_id_ts", "profile_samples", "profile_stacks",
          "span_attribution", "span_functions", "unattributed_cpu", "span_index",
          "span_stacks", "op_minute", "op_calls", "fn_minute", "op_stacks_minute", "quarantine"]
MIGRATION_11 = dict(plan(OPTS))[11]

# what the aggregates and views answer: the same before and after the migration
ANSWERS = {
    "op_minute": "SELECT service, operation, method, sum(cpu_ns), sum(inclusive_cpu_ns), "
                 "sum(wall_ns), sum(sample_count), uniqExactMerge(calls) FROM {db}.op_minute "
                 "GROUP BY service, operation, method ORDER BY ALL",
    "op_calls": "SELECT service, operation, trace_id, span_id, sum(cpu_ns), max(duration_ns) "
                "FROM {db}.op_calls GROUP BY ALL ORDER BY ALL",
    "fn_minute": "SELECT operation, function, method, sum(self_cpu_ns) FROM {db}.fn_minute "
                 "GROUP BY ALL ORDER BY ALL",
    "op_stacks_minute": "SELECT operation, stack_id, sum(cpu_ns) FROM {db}.op_stacks_minute "
                        "GROUP BY ALL ORDER BY ALL",
    "totals": "SELECT trace_id, span_id, method, cpu_ns, inclusive_cpu_ns, off_cpu_ns "
              "FROM {db}.span_attribution_totals ORDER BY ALL",
    "trace_ts": "SELECT TraceId, min(Start), max(End) FROM {db}.otel_traces_trace_id_ts "
                "GROUP BY TraceId ORDER BY ALL",
    "stacks": "SELECT stack_id, any(functions), any(leaf) FROM {db}.profile_stacks "
              "GROUP BY stack_id ORDER BY ALL",
}


def _batches() -> tuple[SpanBatch, ProfileBatch, AttributionBatch]:
    """Two traces: a root and its child in one, a span in the other; their samples, stacks,
    attribution (one row span-only), unattributed CPU."""
    t1, t2 = b"\x01" * 16, b"\x02" * 16
    s1, s2, s3 = b"\x11" * 8, b"\x12" * 8, b"\x21" * 8
    spans = [Span(t1, s1, b"", "GET /", 2, "api", T0, T0 + 50_000_000,
                  attributes={"http.method": "GET"}),
             Span(t1, s2, s1, "query", 3, "api", T0 + 10_000_000, T0 + 30_000_000),
             Span(t2, s3, b"", "POST /", 2, "api", T0 + 60 * 10**9, T0 + 61 * 10**9)]
    stacks = {7: Stack(7, ["leaf", "root"], ["a.py", "a.py"], [1, 2]),
              8: Stack(8, ["scan", "root"], ["b.py", "a.py"], [3, 2])}
    samples = [Sample(t1, s1, "api", T0 + 5_000_000, 7, "cpu", 10_000_000, 1, "cpu", "ns"),
               Sample(t1, s2, "api", T0 + 15_000_000, 8, "cpu", 20_000_000, 2, "cpu", "ns"),
               Sample(b"", b"", "api", T0 + 70 * 10**9, 7, "cpu", 5_000_000, 1, "cpu", "ns")]
    attrs = [Attribution(t1, s1, "link", "api", "GET /", b"", T0, 50_000_000, True,
                         10_000_000, 0, 1, {"leaf": 10_000_000}, {}, 1, 30_000_000,
                         {7: 10_000_000}),
             Attribution(t1, s2, "link", "api", "query", s1, T0 + 10_000_000, 20_000_000, True,
                         20_000_000, 0, 2, {"scan": 20_000_000}, {}, 2, 20_000_000,
                         {8: 20_000_000}),
             Attribution(b"", s3, "link", "api", "", b"", 0, 0, False, 3_000_000, 0, 1,
                         {"leaf": 3_000_000}, {}, 3, 0, {7: 3_000_000})]
    unattributed = [Unattributed("api", T0 + 60 * 10**9, 5_000_000, 0, 1, 4)]
    return (SpanBatch(spans), ProfileBatch(samples, stacks),
            AttributionBatch(attrs, unattributed))


def _insert_untenanted(ch: Any, tables: dict[str, rows.Columns]) -> None:
    """Insert rows as a store at migration 10 took them: without a tenant column (nor the
    span's duration of span_functions and span_stacks rows, migration 13, nor lock and
    allocation columns, migration 14)."""
    later = {"lock_ns", "alloc_bytes", "self_lock_ns", "self_alloc_bytes"}
    for table, cols in tables.items():
        names = [c for c in cols if c != "tenant" and c not in later and not (
            c == "duration_ns" and table in ("span_functions", "span_stacks"))]
        ch.insert(f"{DB}.{table}", [cols[c] for c in names], column_names=names,
                  column_oriented=True)


def _store_at_10(path: Path) -> None:
    """A store made by migrations 1..10, holding the rows of ``_batches`` and a quarantined
    row."""
    with clickhouse(path) as ch:
        for sql in bootstrap(OPTS):
            ch.command(sql)
        for version, steps in plan(OPTS)[:10]:
            for step in steps:
                apply_step(ch, OPTS, step)
            ch.insert(f"{DB}.schema_migrations", [[version]], column_names=["version"])
        spans, profiles, attrs = _batches()
        for tables in (rows.traces(spans), rows.profiles(profiles), rows.attributions(attrs)):
            _insert_untenanted(ch, tables)
        ch.command(f"INSERT INTO {DB}.quarantine (component, table, reason, row) VALUES "
                   "('clickhouse', 'profile_samples', 'Value is out of range', '{}')")


def _state(ch: Any) -> dict[str, Any]:
    """Rows per table, and what the aggregates and views answer."""
    out: dict[str, Any] = {t: ch.query(f"SELECT count() FROM {DB}.{t}").result_rows[0][0]
                           for t in TABLES}
    for name, sql in ANSWERS.items():
        out[name] = ch.query(sql.format(db=DB)).result_rows
    return out


def _tenants(ch: Any) -> dict[str, list[str]]:
    return {t: [r[0] for r in ch.query(f"SELECT DISTINCT tenant FROM {DB}.{t}").result_rows]
            for t in TABLES}


def _leftovers(ch: Any) -> list[str]:
    return [r[0] for r in ch.query(
        "SELECT name FROM system.tables WHERE database = {db:String} AND name LIKE '%\\_\\_new'",
        parameters={"db": DB}).result_rows]


async def _start(path: Path, tmp_path: Path) -> ClickHouseExporter:
    cfg = Config(endpoint=f"chdb://{path}", flush_interval=0.05, ttl=0)
    ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
    try:
        await ex.start()
    except BaseException:
        await ex.shutdown()  # the engine is one per process: free it for the next test
        raise
    return ex


class TestUpgradeTo11:
    async def test_rows_stay_as_tenant_default_and_aggregates_answer_the_same(
            self, tmp_path: Path) -> None:
        """A store at migration 10 holding spans, samples, stacks, attribution, aggregates
        and a quarantined row is brought to 11 on start: every row is kept, as tenant
        'default', every aggregate and view answers as before, no staging table is left,
        and rows written afterwards reach the aggregates under their own tenant."""
        path = tmp_path / "ch"
        _store_at_10(path)
        with clickhouse(path) as ch:
            before = _state(ch)
        assert all(before[t] for t in TABLES), before  # every table holds rows
        ex = await _start(path, tmp_path)
        await ex.shutdown()
        with clickhouse(path) as ch:
            assert _state(ch) == before
            assert _tenants(ch) == {t: ["default"] for t in TABLES}
            assert _leftovers(ch) == []
            versions = ch.query(f"SELECT version FROM {DB}.schema_migrations ORDER BY 1")
            assert [r[0] for r in versions.result_rows] == [m.version for m in MIGRATIONS]
            # the views feed the aggregates again, tenant and all
            ch.command(f"INSERT INTO {DB}.otel_traces (tenant, Timestamp, TraceId, SpanId, "
                       "ServiceName, SpanName, Duration) VALUES ('acme', now64(9), "
                       f"'{'03' * 16}', '{'31' * 8}', 'api', 'GET /', 5)")
            got = ch.query(f"SELECT tenant, uniqExactMerge(calls) FROM {DB}.op_minute "
                           "GROUP BY tenant ORDER BY tenant").result_rows
            assert got == [("acme", 1), ("default", 3)]
            got = ch.query(f"SELECT tenant, trace_id FROM {DB}.span_index "
                           "WHERE tenant = 'acme'").result_rows
            assert got == [("acme", "03" * 16)]

    def test_every_data_table_has_tenant_first_in_its_key(self, tmp_path: Path) -> None:
        """After 11, every table of tenant data orders by tenant first; the system tables
        (schema_migrations, correlator_checkpoint, backfill_ledger) have no tenant in
        their keys."""
        path = tmp_path / "ch"
        with clickhouse(path) as ch:
            for sql in bootstrap(OPTS):
                ch.command(sql)
            for _, steps in plan(OPTS):
                for step in steps:
                    apply_step(ch, OPTS, step)
            keys = dict(ch.query("SELECT name, sorting_key FROM system.tables WHERE database "
                                 "= {db:String} AND engine LIKE '%MergeTree'",
                                 parameters={"db": DB}).result_rows)
        system = ("schema_migrations", "correlator_checkpoint", "backfill_ledger")
        later = ("op_tail_spans", "op_tail_functions", "op_tail_stacks")  # migration 13
        assert set(keys) == {*TABLES, *system, *later}
        for t in (*TABLES, *later):
            assert keys[t].startswith("tenant, "), (t, keys[t])
        assert not [t for t in system if "tenant" in keys[t]]


# stop points: after the views are dropped; in the first table (its staging table made,
# emptied, filled, exchanged, dropped); in the middle; before the views are made again;
# after the last statement (its version not yet recorded)
_FIRST = next(i for i, s in enumerate(MIGRATION_11) if s.lacks is not None)
STOPS = [_FIRST, _FIRST + 1, _FIRST + 2, _FIRST + 3, _FIRST + 4, _FIRST + 5,
         len(MIGRATION_11) // 2 + 1, len(MIGRATION_11) - 10, len(MIGRATION_11)]


class TestKilledPartWay:
    @pytest.mark.parametrize("stop", STOPS)
    async def test_applied_again_after_a_kill_keeps_every_row_once(
            self, tmp_path: Path, stop: int) -> None:
        """Migration 11 killed after ``stop`` statements (and, inside a copy, with part of
        the rows copied) is applied again whole on the next start: the same rows, once
        each, as tenant 'default', and the same answers as a migration never killed."""
        path = tmp_path / "ch"
        _store_at_10(path)
        with clickhouse(path) as ch:
            before = _state(ch)
            for step in MIGRATION_11[:stop]:
                apply_step(ch, OPTS, step)
            nxt = MIGRATION_11[stop] if stop < len(MIGRATION_11) else None
            if nxt is not None and nxt.sql[0].startswith("EXCHANGE"):
                # and a row more in the staging table than the copy put there: the next
                # start must empty it before copying again
                staging = nxt.sql[0].split(" AND ")[1].split(".")[1]
                ch.command(f"INSERT INTO {DB}.{staging} SETTINGS insert_deduplicate = 0 "
                           f"SELECT * FROM {DB}.{staging} LIMIT 1")
        ex = await _start(path, tmp_path)
        await ex.shutdown()
        with clickhouse(path) as ch:
            assert _state(ch) == before
            assert _tenants(ch) == {t: ["default"] for t in TABLES}
            assert _leftovers(ch) == []
        # and a start after a complete migration changes nothing
        ex = await _start(path, tmp_path)
        await ex.shutdown()
        with clickhouse(path) as ch:
            assert _state(ch) == before

    async def test_applied_again_once_done_leaves_every_tenant_as_it_is(
            self, tmp_path: Path) -> None:
        """Killed after its last statement, before its version was recorded, with rows of
        another tenant written since (another process): applied again, it changes nothing,
        the other tenant's rows stay that tenant's."""
        path = tmp_path / "ch"
        _store_at_10(path)
        with clickhouse(path) as ch:
            for step in MIGRATION_11:
                apply_step(ch, OPTS, step)
            spans, profiles, attrs = _batches()
            for batch in (spans, profiles, attrs):
                batch.tenant = "acme"
            for tables in (rows.traces(spans), rows.profiles(profiles),
                           rows.attributions(attrs)):
                for table, cols in tables.items():
                    cols["tenant"] = ["acme"] * len(next(iter(cols.values())))
                    if table in ("span_functions", "span_stacks"):
                        cols.pop("duration_ns")  # migration 13's
                    for later in ("lock_ns", "alloc_bytes", "self_lock_ns", "self_alloc_bytes"):
                        cols.pop(later, None)  # migration 14's
                    ch.insert(f"{DB}.{table}", list(cols.values()), column_names=list(cols),
                              column_oriented=True)
            before = _state(ch)
            tenants = _tenants(ch)
        assert sorted(tenants["span_attribution"]) == ["acme", "default"]
        ex = await _start(path, tmp_path)
        await ex.shutdown()
        with clickhouse(path) as ch:
            assert _state(ch) == before
            assert {t: sorted(v) for t, v in _tenants(ch).items()} == \
                {t: sorted(v) for t, v in tenants.items()}

    async def test_a_copy_cut_short_is_started_over(self, tmp_path: Path) -> None:
        """Killed during a table's copy (part of its rows in the staging table, not yet
        exchanged): the next start empties the staging table and copies every row once."""
        path = tmp_path / "ch"
        _store_at_10(path)
        copy = next(i for i, s in enumerate(MIGRATION_11)
                    if s.sql[0].startswith("INSERT INTO") and "span_attribution__new" in s.sql[0])
        with clickhouse(path) as ch:
            before = _state(ch)
            for step in MIGRATION_11[:copy]:
                apply_step(ch, OPTS, step)
            # half a copy: the rows of one trace only
            ch.command(MIGRATION_11[copy].sql[0] + f" WHERE trace_id = '{'01' * 16}'")
            assert 0 < ch.query(f"SELECT count() FROM {DB}.span_attribution__new"
                                ).result_rows[0][0] < before["span_attribution"]
        ex = await _start(path, tmp_path)
        await ex.shutdown()
        with clickhouse(path) as ch:
            assert _state(ch) == before
            assert _leftovers(ch) == []


def test_the_migration_rebuilds_every_data_table() -> None:
    """Each data table is rebuilt under NAME__new, and only while NAME lacks tenant; the
    later migrations' data tables have tenant first in their keys (checked above)."""
    assert [m.name for m in MIGRATIONS[11:]] == ["backfill_ledger", "tail_aggregates",
                                              "lock_alloc", "call_waits"]
    guarded = {s.lacks.table for s in MIGRATION_11 if s.lacks is not None}
    assert guarded == set(TABLES)
    assert all(s.lacks is not None and s.lacks.column == "tenant" for s in MIGRATION_11
               if s.sql[0].startswith(("EXCHANGE", "TRUNCATE", "INSERT", "CREATE TABLE")))

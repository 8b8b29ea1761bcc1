"""ClickHouse exporter: the batched writer's acknowledgements and retries (the in-memory
client, ``memory.MemoryClient``), and schema/migrations/inserts on the real embedded engine."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pipeline.errors import Retryable
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config, RetryConfig
from pipeline.exporters.clickhouse.memory import MemoryClient, reset
from pipeline.exporters.clickhouse.migrate import render
from pipeline.exporters.clickhouse.rows import COLUMNS
from pipeline.exporters.clickhouse.schema import MIGRATIONS, SchemaOptions
from pipeline.exporters.clickhouse.writer import Writer
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

FAST_RETRY = RetryConfig(initial_interval=0.01, max_interval=0.02, max_elapsed_time=5.0)


def writer(client: MemoryClient, **kw: Any) -> Writer:
    import structlog

    opts: dict[str, Any] = dict(batch_rows=10, flush_interval=0.05, max_pending_rows=100,
                                retry=FAST_RETRY)
    opts.update(kw)
    return Writer(client=client, executor=ThreadPoolExecutor(1), database="db",
                  log=structlog.get_logger(), metrics=lambda n, v: None, **opts)


def cols(n: int) -> dict[str, dict[str, list[object]]]:
    from pipeline.exporters.clickhouse.rows import COLUMNS

    return {"otel_traces": {c: [0] * n for c in COLUMNS["otel_traces"]}}


class TestWriter:
    async def test_ack_only_after_insert_and_retry_reuses_token(self) -> None:
        """A failed insert is retried with backoff; the sender's await returns only once the
        insert succeeded, and every attempt carries the same deduplication token."""
        client = MemoryClient()
        client.fail(reset(), times=3)  # the connection lost mid-request: maybe stored
        w = writer(client)
        w.start()
        await asyncio.wait_for(w.submit(cols(5), 5, set()), timeout=5)
        assert client.succeeded() == [("db.otel_traces", 5)]
        assert len(client.inserts) == 4 and len({i.token for i in client.inserts}) == 1
        await w.close()

    async def test_gives_up_with_retryable_never_success(self) -> None:
        """When retries run out the sender gets Retryable, not a success."""
        client = MemoryClient()
        client.fail(reset())
        w = writer(client, retry=RetryConfig(initial_interval=0.01, max_interval=0.01,
                                             max_elapsed_time=0.1))
        w.start()
        with pytest.raises(Retryable, match="clickhouse insert failed"):
            await asyncio.wait_for(w.submit(cols(5), 5, set()), timeout=5)
        assert client.succeeded() == []
        await w.close()

    async def test_full_queue_refuses_at_once(self) -> None:
        """Beyond max_pending_rows, submit raises Retryable immediately (no unbounded queue)."""
        client = MemoryClient()
        w = writer(client, batch_rows=1000, flush_interval=10.0, max_pending_rows=20)
        w.start()
        first = asyncio.create_task(w.submit(cols(15), 15, set()))
        await asyncio.sleep(0)
        with pytest.raises(Retryable, match="queue is full"):
            await w.submit(cols(10), 10, set())
        await w.close()  # close flushes what was accepted
        await first
        assert client.succeeded() == [("db.otel_traces", 15)]

    async def test_a_block_sent_again_takes_no_room(self) -> None:
        """A named block (a Kafka block) that this writer inserted is acknowledged at once
        when sent again, even with the queue full, and one sent again while it waits joins
        it: a sender re-sending a refused round is not refused by its own rows again. The
        same name on another table's rows is another block."""
        client = MemoryClient()
        w = writer(client, batch_rows=1000, flush_interval=0.05, max_pending_rows=20)
        w.start()
        first = asyncio.create_task(w.submit(cols(15), 15, set(), token="b1"))
        await asyncio.sleep(0)
        again = asyncio.create_task(w.submit(cols(15), 15, set(), token="b1"))  # joins
        with pytest.raises(Retryable, match="queue is full"):
            await w.submit(cols(10), 10, set(), token="b2")
        await asyncio.wait_for(asyncio.gather(first, again), timeout=5)
        assert client.succeeded() == [("db.otel_traces", 15)]
        blocker = asyncio.create_task(w.submit(cols(15), 15, set(), token="b3"))
        await asyncio.sleep(0)
        await asyncio.wait_for(w.submit(cols(15), 15, set(), token="b1"), timeout=1)
        other = {"span_stacks": {c: [0] * 10 for c in COLUMNS["span_stacks"]}}
        with pytest.raises(Retryable, match="queue is full"):  # b1 of another table: new
            await w.submit(other, 10, set(), token="b1")
        await blocker
        assert client.succeeded() == [("db.otel_traces", 15), ("db.otel_traces", 15)]
        await w.close()

    async def test_small_batches_merge_into_one_insert(self) -> None:
        """Concurrent small submissions become one insert of all their rows."""
        client = MemoryClient()
        w = writer(client, batch_rows=30, flush_interval=1.0)
        w.start()
        await asyncio.wait_for(asyncio.gather(*(w.submit(cols(10), 10, set())
                                                for _ in range(3))), timeout=5)
        assert client.succeeded() == [("db.otel_traces", 30)]
        await w.close()


def _records() -> tuple[SpanBatch, ProfileBatch, AttributionBatch]:
    tid, sid = bytes(range(16)), bytes(range(1, 9))
    span = Span(tid, sid, b"", "GET /", 2, "api", 1_700_000_000_000_000_000,
                1_700_000_000_050_000_000, attributes={"http.method": "GET"})
    stack = Stack(7, ["leaf", "root"], ["a.py", "a.py"], [1, 2])
    sample = Sample(tid, sid, "api", 1_700_000_000_010_000_000, 7, "cpu", 10_000_000, 1,
                    "cpu", "nanoseconds")
    attr = Attribution(tid, sid, "link", "api", "GET /", b"", span.start_ns, 50_000_000, True,
                       10_000_000, 0, 1, {"leaf": 10_000_000}, {})
    return SpanBatch([span]), ProfileBatch([sample], {7: stack}), AttributionBatch([attr])


class TestExporterOnEmbeddedEngine:
    async def test_schema_then_rows_then_restart(self, tmp_path: Path) -> None:
        """The exporter creates its schema, writes spans, samples with stacks and attribution,
        and a restart on the same data applies no migration twice."""
        cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
        for round_ in range(2):
            ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
            await ex.start()
            if round_ == 0:
                for batch in _records():
                    await ex.consume(batch)
            _, rows = await ex.query("SELECT version FROM spanprof.schema_migrations ORDER BY 1")
            assert rows == [(v,) for v in range(1, len(MIGRATIONS) + 1)]
            await ex.shutdown()
            await ex.shutdown()  # idempotent
        with clickhouse(tmp_path / "ch") as ch:
            assert ch.query("SELECT SpanName, SpanKind, Duration, SpanAttributes FROM "
                            "spanprof.otel_traces").result_rows == \
                [("GET /", "Server", 50_000_000, {"http.method": "GET"})]
            assert ch.query("SELECT functions, leaf FROM spanprof.profile_stacks").result_rows \
                == [(["leaf", "root"], "leaf")]
            assert ch.query("SELECT cpu_ns, off_cpu_ns FROM spanprof.span_attribution_totals"
                            ).result_rows == [(10_000_000, 40_000_000)]
            assert ch.query("SELECT function, self_cpu_ns FROM spanprof.span_functions"
                            ).result_rows == [("leaf", 10_000_000)]

    async def test_events_and_links_stored_whether_an_insert_has_any(
            self, tmp_path: Path) -> None:
        """An insert whose spans have no events (or no links) leaves those nested columns
        out (the driver's loop over them was 3-4 us a span) and the engine fills the same
        empty arrays; an insert with some keeps every value, in its row."""
        from pipeline.records import SpanEvent, SpanLink

        trace_a, trace_b, t0 = bytes(range(1, 17)), bytes(range(2, 18)), 1_700_000_000 * 10**9
        cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
        ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
        await ex.start()

        def span(n: int, **kw: Any) -> Span:
            return Span(trace_a, n.to_bytes(8, "big"), b"", f"op{n}", 2, "api",
                        t0, t0 + 1_000, **kw)

        await ex.consume(SpanBatch([span(1), span(2)]))  # neither events nor links
        await ex.consume(SpanBatch([  # events in one row, a link in another
            span(3, events=[SpanEvent(t0 + 5, "retry", {"attempt": "2"})]),
            span(4, links=[SpanLink(trace_b, b"\x07" * 8, "k=v", {"why": "fanout"})]),
            span(5)]))
        await ex.shutdown()
        with clickhouse(tmp_path / "ch") as ch:
            got = ch.query("SELECT SpanName, Events.Name, Events.Attributes, Links.TraceId, "
                           "Links.TraceState, Links.Attributes FROM spanprof.otel_traces "
                           "ORDER BY SpanName").result_rows
        assert got == [
            ("op1", [], [], [], [], []),
            ("op2", [], [], [], [], []),
            ("op3", ["retry"], [{"attempt": "2"}], [], [], []),
            ("op4", [], [], [trace_b.hex()], ["k=v"], [{"why": "fanout"}]),
            ("op5", [], [], [], [], []),
        ]

    async def test_stacks_in_use_are_written_again_and_unused_ones_expire(
            self, tmp_path: Path) -> None:
        """A stack the exporter keeps seeing is written again once ``stack_refresh`` has
        passed (renewing its last_seen); a stack not seen for ttl plus the margin is removed
        by the table's TTL, one seen since stays."""
        from pipeline.exporters.clickhouse.schema import STACK_TTL_MARGIN_S

        cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=3600)
        ex = ClickHouseExporter(cfg, Context("clickhouse", ["profiles"], data_dir=str(tmp_path)))
        await ex.start()
        assert ex.writer is not None
        _, profiles, _ = _records()
        await ex.consume(profiles)
        await ex.consume(profiles)  # written moments ago: no new row
        _, rows = await ex.query("SELECT count() FROM spanprof.profile_stacks")
        assert rows == [(1,)]
        ex.writer.stack_refresh = 0.0
        await ex.consume(profiles)
        _, rows = await ex.query("SELECT count() FROM spanprof.profile_stacks")
        assert rows == [(2,)]
        old = 3600 + STACK_TTL_MARGIN_S + 60
        await ex.query(f"INSERT INTO spanprof.profile_stacks (stack_id, functions, files, lines,"
                       f" last_seen) VALUES (99, ['gone'], [''], [0], now() - {old}), "
                       f"(7, ['leaf', 'root'], ['a.py', 'a.py'], [1, 2], now() - {old})")
        await ex.query("OPTIMIZE TABLE spanprof.profile_stacks FINAL")
        _, rows = await ex.query("SELECT stack_id, count() FROM spanprof.profile_stacks "
                                 "GROUP BY stack_id")
        assert rows == [(7, 1)]
        await ex.shutdown()

    async def test_a_changed_ttl_applies_on_start_without_a_manual_alter(
            self, tmp_path: Path) -> None:
        """Tables made with ttl 7d, then started with 1d, then with 0 (for ever): each start
        brings every table's TTL to the config's, and a start with nothing changed alters
        nothing."""
        from pipeline.exporters.clickhouse.migrate import ttl_changes, ttl_plan
        from pipeline.exporters.clickhouse.schema import STACK_TTL_MARGIN_S, SchemaOptions

        async def start(ttl: int) -> dict[str, str]:
            cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                         ttl=ttl)  # type: ignore[arg-type]
            ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"],
                                                 data_dir=str(tmp_path)))
            await ex.start()
            _, rows = await ex.query("SELECT name, create_table_query FROM system.tables "
                                     "WHERE database = 'spanprof'")
            await ex.shutdown()
            return dict(rows)  # type: ignore[arg-type]

        tables = set(ttl_plan(SchemaOptions()))
        assert len(tables) >= 12
        for ttl in (7 * 86400, 86400, 0):
            ddl = await start(ttl)
            for t in tables:
                keep = ttl + (STACK_TTL_MARGIN_S if t == "profile_stacks" else 0)
                if ttl:
                    assert f"toIntervalSecond({keep})" in ddl[t], (t, ddl[t][-200:])
                else:
                    assert " TTL " not in ddl[t], (t, ddl[t][-200:])
            assert ttl_changes(SchemaOptions(ttl_seconds=ttl), ddl) == []

    async def test_upgrade_from_migration_1_keeps_old_rows(self, tmp_path: Path) -> None:
        """A database made by the first schema is brought up to date on start, without a
        manual ALTER: old rows stay, new columns read their defaults, new rows fill them."""
        from pipeline.exporters.clickhouse.migrate import bootstrap
        with clickhouse(tmp_path / "ch") as ch:
            o = SchemaOptions(ttl_seconds=0)
            for sql in bootstrap(o) + MIGRATIONS[0].render(o):
                ch.command(sql)
            ch.insert("spanprof.schema_migrations", [[1]], column_names=["version"])
            ch.command("INSERT INTO spanprof.profile_samples (time, service, stack_id, measure,"
                       " value, count) VALUES (now64(9), 'old', 7, 'cpu', 5, 1)")
        cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
        ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
        await ex.start()
        _, profiles, _ = _records()
        profiles.samples[0] = msgspec.structs.replace(
            profiles.samples[0], thread_id=42, thread_name="worker-1", span_name="GET /", pid=9,
            host="h")
        await ex.consume(profiles)
        _, got = await ex.query("SELECT version FROM spanprof.schema_migrations ORDER BY 1")
        assert got == [(v,) for v in range(1, len(MIGRATIONS) + 1)]
        _, got = await ex.query("SELECT service, thread_id, thread_name, span_name, pid, host "
                                "FROM spanprof.profile_samples ORDER BY service")
        assert got == [("api", 42, "worker-1", "GET /", 9, "h"), ("old", 0, "", "", 0, "")]
        await ex.shutdown()

    async def test_unreachable_server_is_a_config_error_naming_the_key(self) -> None:
        """A server that cannot be reached fails start-up with the endpoint key in the text."""
        from pipeline.errors import ConfigError

        cfg = Config(endpoint="http://127.0.0.1:9", timeout=1.0)
        ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"]))
        with pytest.raises(ConfigError, match=r"^exporters\.clickhouse\.endpoint: cannot use"):
            await ex.start()
        await ex.shutdown()

    def test_schema_print_has_every_table(self) -> None:
        """`spanprof schema print` output names every table spanprof writes."""
        ddl = render(SchemaOptions(database="x", ttl_seconds=3600))
        for table in ("otel_traces", "otel_traces_trace_id_ts", "profile_stacks",
                      "profile_samples", "span_attribution", "span_functions",
                      "unattributed_cpu", "span_attribution_totals"):
            assert f"x.{table}" in ddl
        assert "toIntervalSecond(3600)" in ddl


class TestSpanOnlyRows:
    async def test_span_only_rows_find_their_trace_through_span_index(
            self, tmp_path: Path) -> None:
        """A row written with trace_id '' (a sample labelled with a span id alone, joined on
        another worker) is read back under its span's trace; rows of other traces are not
        touched, and a span-only row whose span never came stays under ''."""
        cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
        ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
        await ex.start()
        spans, _, _ = _records()
        await ex.consume(spans)
        tid, sid = spans.spans[0].trace_id, spans.spans[0].span_id
        rows = [Attribution(b"", sid, "link", "api", "", b"", 0, 0, False, 7, 0, 1,
                            {"leaf": 7}, {}, 1),
                Attribution(b"", b"\x09" * 8, "link", "api", "", b"", 0, 0, False, 3, 0, 1,
                            {}, {}, 2),
                Attribution(tid, sid, "link", "api", "GET /", b"", spans.spans[0].start_ns,
                            50_000_000, True, 5, 0, 1, {"leaf": 5}, {}, 3)]
        await ex.consume(AttributionBatch(rows))
        _, got = await ex.query(
            "SELECT trace_id, span_id, sum(cpu_ns) FROM spanprof.span_attribution_totals "
            "GROUP BY trace_id, span_id ORDER BY trace_id, span_id")
        assert got == [("", "09" * 8, 3), (tid.hex(), sid.hex(), 12)]
        _, got = await ex.query(
            "SELECT sum(cpu_ns) FROM spanprof.span_attribution_totals WHERE trace_id = "
            "{t:String}", {"t": tid.hex()})
        assert got == [(12,)]
        await ex.shutdown()


def _as(tenant: str, *batches: Any) -> list[Any]:
    return [msgspec.structs.replace(b, tenant=tenant) for b in batches]


class TestTenantColumns:
    def test_every_row_carries_its_batch_tenant(self) -> None:
        """Each table rows.py fills has its full column list, tenant first, and every row
        the batch's tenant (the default tenant's when the batch names none)."""
        from pipeline.exporters.clickhouse import rows

        spans, profiles, attrs = _records()
        attrs.attributions[0].stack_cpu_ns = {7: 10_000_000}
        attrs.unattributed.append(Unattributed("api", 1_700_000_000_000_000_000, 5, 0, 1, 9))
        for tenant, batches in (("acme", _as("acme", spans, profiles, attrs)),
                                ("default", [spans, profiles, attrs])):
            s, p, a = batches
            tables = {**rows.traces(s), **rows.profiles(p), **rows.attributions(a)}
            assert set(tables) == set(COLUMNS)
            for table, cols in tables.items():
                assert list(cols)[0] == "tenant" == COLUMNS[table][0], table
                assert set(cols) == set(COLUMNS[table]), table
                n = len(cols[COLUMNS[table][1]])
                assert n and cols["tenant"] == [tenant] * n, table

    async def test_a_stack_written_for_one_tenant_is_written_again_for_another(self) -> None:
        """The writer remembers the stacks it wrote per (tenant, stack id): profile_stacks is
        per tenant, so tenant b's stack 7 is written though tenant a's was."""
        client = MemoryClient()
        w = writer(client, batch_rows=1)
        w.start()
        _, profiles, _ = _records()
        a, b = _as("a", profiles) + _as("b", profiles)
        for batch in (a, b, a):
            skip = w.known_stacks(batch.tenant, batch.stacks)
            tables = rows_profiles(batch, skip)
            await w.submit(tables, 1, {(batch.tenant, s) for s in batch.stacks
                                       if s not in skip})
        assert w.known_stacks("a", [7, 8]) == {7}
        assert w.known_stacks("b", [7]) == {7}
        assert w.known_stacks("c", [7]) == set()
        got = client.columns("db.profile_stacks")
        assert list(zip(got["tenant"], got["stack_id"], strict=True)) == [("a", 7), ("b", 7)]
        await w.close()

    async def test_two_tenants_same_ids_are_two_rows_each_on_the_engine(
            self, tmp_path: Path) -> None:
        """Two tenants' batches with the very same trace, span and stack ids: each tenant's
        rows are stored, none collapses into the other's (FINAL), each under its tenant."""
        cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
        ex = ClickHouseExporter(cfg, Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
        try:
            await ex.start()
            for tenant in ("a", "b"):
                for batch in _as(tenant, *_records()):
                    await ex.consume(batch)
            for table in ("otel_traces", "profile_samples", "profile_stacks",
                          "span_attribution", "span_functions", "span_index",
                          "otel_traces_trace_id_ts"):
                final = "" if table in ("profile_samples", "otel_traces_trace_id_ts") \
                    else " FINAL"  # plain MergeTree: no FINAL
                _, got = await ex.query(f"SELECT tenant, count() FROM spanprof.{table}{final} "
                                        "GROUP BY tenant ORDER BY tenant")
                assert got == [("a", 1), ("b", 1)], table
            # the aggregates: one call of GET / per tenant, each with its own CPU
            _, got = await ex.query("SELECT tenant, sum(cpu_ns), uniqExactMerge(calls) FROM "
                                    "spanprof.op_minute GROUP BY tenant ORDER BY tenant")
            assert got == [("a", 10_000_000, 1), ("b", 10_000_000, 1)]
        finally:
            await ex.shutdown()


def rows_profiles(batch: ProfileBatch, skip: set[int]) -> dict[str, dict[str, list[object]]]:
    from pipeline.exporters.clickhouse import rows

    return rows.profiles(batch, skip)


class TestQueueLoggedBeforeTenants:
    def test_a_record_logged_before_tenants_is_the_default_tenants(self) -> None:
        """A sending-queue record written before migration 11 (bare stack ids, rows with no
        tenant column) is replayed as the default tenant's; a new one as logged."""
        from pipeline.exporters.clickhouse.queue_replay import _stack_keys, with_tenant

        assert _stack_keys([7, 8]) == {("default", 7), ("default", 8)}
        assert _stack_keys([["a", 7]]) == {("a", 7)}
        old = with_tenant({"profile_stacks": {"stack_id": [7, 8]}})
        assert old["profile_stacks"]["tenant"] == ["default", "default"]
        new = with_tenant({"profile_stacks": {"tenant": ["a"], "stack_id": [7]}})
        assert new["profile_stacks"]["tenant"] == ["a"]


class TestInsertReleasesColumns:
    def test_the_library_keeps_its_insert_context_in_a_cycle(self) -> None:
        """The fact the writer works around: clickhouse-connect's InsertContext refers to
        itself through a bound method, so what it holds waits for the garbage collector."""
        import gc

        from clickhouse_connect.datatypes.registry import get_from_name
        from clickhouse_connect.driver.insert import InsertContext

        data = [[1, 2, 3]]
        ctx = InsertContext("t", ["x"], [get_from_name("UInt64")], data,
                            column_oriented=True)
        assert any(ctx in gc.get_referents(v) for v in vars(ctx).values()
                   if callable(v) and hasattr(v, "__self__"))

    async def test_columns_are_freed_once_inserted(self) -> None:
        """After an insert (and after a failed one), the writer holds no reference to the
        columns through the client's insert context: only the caller's remain."""
        import sys

        from pipeline.exporters.clickhouse.rows import COLUMNS

        class CyclicClient(MemoryClient):
            """Keeps what it is given in a reference cycle, as clickhouse-connect does."""

            def insert(self, table: str, data: Any, **kw: Any) -> Any:
                ctx: dict[str, Any] = {"data": data}
                ctx["self"] = ctx
                self.kept.append(ctx)
                return super().insert(table, data, **kw)

        client = CyclicClient()
        client.kept = []  # type: ignore[attr-defined]
        w = writer(client)
        block = {c: [0] * 5 for c in COLUMNS["otel_traces"]}
        column = block["TraceId"]
        before = sys.getrefcount(column)
        await w._insert("otel_traces", "tok-1", block)
        assert sys.getrefcount(column) == before
        client.fail(reset(), times=1)
        with pytest.raises(Exception):  # noqa: B017 - any failure: the columns are let go
            await w._insert("otel_traces", "tok-2", block)
        assert sys.getrefcount(column) == before

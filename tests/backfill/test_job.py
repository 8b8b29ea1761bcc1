"""Backfill jobs on the real embedded engine (issue #15): attribution recomputed from the
store equals what the live correlator writes for the same data; a job run twice, or
killed and run again, leaves every table as one run does; a unit whose CPU does not add
up fails with its figures.

One engine per process (chdb), so "live" and "backfilled" are two databases of it."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.backfill import reattribute
from pipeline.backfill.job import Job, Progress, job_id
from pipeline.config import Duration
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.registry import Context
from processors.correlate.connector import Config as CorrelatorConfig
from processors.correlate.connector import SpanCorrelator
from tests.backfill.dataset import T0, Data, generate

TABLES = ("otel_traces", "profile_samples", "span_attribution", "span_functions",
          "span_stacks", "unattributed_cpu", "span_index", "op_minute", "op_calls",
          "fn_minute", "op_stacks_minute", "profile_stacks")
RANGE = (T0 - 3600 * 10**9, T0 + 3600 * 10**9)


@pytest.fixture(scope="module")
def data() -> Data:
    return generate(600)


async def open_store(root: Path, database: str) -> ClickHouseExporter:
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{root}/ch", database=database,
                                   flush_interval=0.02, ttl=0),
                            Context("clickhouse", ["traces"], data_dir=str(root)))
    await ex.start()
    return ex


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[ClickHouseExporter, ...]]:
    opened = [await open_store(tmp_path, db) for db in ("live", "bf")]
    try:
        yield tuple(opened)
    finally:
        for ex in opened:
            await ex.shutdown()


async def live(store: ClickHouseExporter, data: Data, tenant: str = "default") -> None:
    """The data through the live correlator (a frozen clock: it holds everything), its
    rows and the raw rows into ``store``."""
    c = SpanCorrelator(CorrelatorConfig(grace=Duration(10.0), recover=False),
                       Context("spancorrelator", ["traces"],
                               next={"attributions": store}), clock=lambda: 1000.0)
    for batch in data.batches(tenant):
        await store.consume(batch)
        await c.consume(batch)
    await c.shutdown()


async def per_span(store: ClickHouseExporter, tenant: str = "default"
                   ) -> dict[tuple[str, str, str], tuple[int, int, int]]:
    _, rows = await store.query(
        f"SELECT trace_id, span_id, method, sum(cpu_ns), sum(inclusive_cpu_ns), "
        f"sum(sample_count) FROM {store.database}.span_attribution_totals "
        "WHERE tenant = {t:String} GROUP BY trace_id, span_id, method", {"t": tenant})
    return {(r[0], r[1], r[2]): (int(r[3]), int(r[4]), int(r[5])) for r in rows}


async def unattributed(store: ClickHouseExporter) -> dict[tuple[str, Any], int]:
    _, rows = await store.query(
        f"SELECT service, minute, sum(cpu_ns) FROM {store.database}.unattributed_cpu FINAL "
        "GROUP BY service, minute")
    return {(r[0], r[1]): int(r[2]) for r in rows}


async def snapshot(store: ClickHouseExporter) -> dict[str, Any]:
    """Every table, canonically: merged (``OPTIMIZE FINAL``: what reads see), then its rows
    as a sorted multiset, aggregate states finalized; a doubled raw row or a sum that
    grew shows."""
    out = {}
    for t in TABLES:
        await store.command(f"OPTIMIZE TABLE {store.database}.{t} FINAL")
        _, cols = await store.query(
            "SELECT name, type FROM system.columns WHERE database = {d:String} AND "
            "table = {t:String} AND name NOT IN ('updated_at', 'ingested_at', 'last_seen')",
            {"d": store.database, "t": t})
        exprs = [f"finalizeAggregation({n})" if ty.startswith("AggregateFunction") else n
                 for n, ty in cols]
        _, rows = await store.query(
            f"SELECT {', '.join(exprs)} FROM {store.database}.{t} ORDER BY ALL")
        out[t] = rows
    return out


async def reattribute_job(store: ClickHouseExporter, **kw: Any) -> dict[str, Any]:
    return await Job(store, store.consume, job_id("reattribute", [RANGE, kw]),
                     **kw).run(None, RANGE)


class TestReattribute:
    async def test_same_as_live(self, stores: tuple[ClickHouseExporter, ...],
                                data: Data) -> None:
        live_db, bf = stores
        await live(live_db, data)
        for batch in data.batches():
            await bf.consume(batch)
        summary = await reattribute_job(bf, workers=2)
        assert not summary["failed"], summary["failed"]
        want = await per_span(live_db)
        assert {k[2] for k in want} >= {"link", "link+time", "thread", "window"}
        assert await per_span(bf) == want
        assert await unattributed(bf) == await unattributed(live_db)
        cpu = sum(s.value for s in data.samples)
        assert summary["cpu_in_ns"] == cpu
        assert summary["cpu_attributed_ns"] + summary["cpu_unattributed_ns"] == cpu
        # the aggregates the queries read agree too (nothing is written between the
        # tables compared: one snapshot of each store serves them all)
        a, b = await snapshot(live_db), await snapshot(bf)
        for t in ("op_minute", "fn_minute", "op_calls", "op_stacks_minute"):
            assert a[t] == b[t], t

    async def test_replaces_live_rows(self, stores: tuple[ClickHouseExporter, ...],
                                      data: Data) -> None:
        """Over a store the live correlator filled, the job rewrites its rows: CPU per span
        is unchanged, never doubled, whatever ran before."""
        live_db, _ = stores
        await live(live_db, data)
        before = await per_span(live_db)
        first = await snapshot(live_db)
        await reattribute_job(live_db)
        assert await per_span(live_db) == before
        again = await snapshot(live_db)
        await reattribute_job(live_db, workers=3)  # another job id: really runs again
        assert await snapshot(live_db) == again
        for t in ("otel_traces", "profile_samples", "op_minute", "fn_minute"):
            assert again[t] == first[t], t

    async def test_twice_is_once(self, stores: tuple[ClickHouseExporter, ...],
                                 data: Data) -> None:
        _, bf = stores
        for batch in data.batches():
            await bf.consume(batch)
        s1 = await reattribute_job(bf)
        once = await snapshot(bf)
        s2 = await reattribute_job(bf)  # the same job: the ledger says it is done
        assert s2["already_done"] == s2["units"] == s1["units"] and s2["done"] == 0
        assert await snapshot(bf) == once
        await Job(bf, bf.consume, "other-id").run(None, RANGE)  # run again for real
        assert await snapshot(bf) == once

    async def test_method_subset(self, stores: tuple[ClickHouseExporter, ...],
                                 data: Data) -> None:
        """``--method window`` rewrites window rows only; the others stay as they were."""
        live_db, _ = stores
        await live(live_db, data)
        before = await per_span(live_db)
        await live_db.command(f"DELETE FROM {live_db.database}.span_attribution "
                              "WHERE method IN ('window', 'thread')")
        await reattribute_job(live_db, methods=("window",))
        after = await per_span(live_db)
        assert {k: v for k, v in after.items() if k[2] != "thread"} == \
            {k: v for k, v in before.items() if k[2] != "thread"}
        assert not [k for k in after if k[2] == "thread"]

    async def test_tenants_apart(self, stores: tuple[ClickHouseExporter, ...]) -> None:
        """Two tenants with the very same ids: each gets its own CPU back."""
        live_db, bf = stores
        a, b = generate(60, seed=3), generate(60, seed=3)
        b = Data(b.spans, [s.__copy__() for s in b.samples], b.stacks)
        for s in b.samples:
            s.value *= 3
        await live(live_db, a, "team-a")
        await live(live_db, b, "team-b")
        for d, t in ((a, "team-a"), (b, "team-b")):
            for batch in d.batches(t):
                await bf.consume(batch)
        await reattribute_job(bf)
        for t in ("team-a", "team-b"):
            assert await per_span(bf, t) == await per_span(live_db, t)


class TestConservation:
    async def test_unbalanced_unit_fails_with_figures(
            self, stores: tuple[ClickHouseExporter, ...], data: Data,
            monkeypatch: pytest.MonkeyPatch) -> None:
        """A replay that loses CPU (a broken correlator) fails its unit, names the figures,
        and the other units still run."""
        _, bf = stores
        for batch in data.batches():
            await bf.consume(batch)
        real = reattribute.expected

        def lossy(spans: Any, samples: Any, stacks: Any) -> Any:
            rows = real(spans, samples, stacks)
            if rows and any(r.method == "window" for r in rows):
                rows[0].cpu_ns += 1
            return rows

        monkeypatch.setattr(reattribute, "expected", lossy)
        summary = await reattribute_job(bf)
        assert summary["failed"]
        assert all("CPU in" in f["message"] for f in summary["failed"])
        assert summary["done"] > 0


def test_dataset_crosses_a_bucket() -> None:
    d = generate(600)
    bucket = {s.start_ns // reattribute.BUCKET_NS for s in d.spans}
    assert len(bucket) == 2  # so units meet at a boundary
    assert time.time() > 0


class TestProgress:
    def test_bar_on_a_terminal_lines_otherwise(self) -> None:
        class Tty(io.StringIO):
            def isatty(self) -> bool:
                return True

        for out, bar in ((Tty(), True), (io.StringIO(), False)):
            p = Progress(out, True)
            p.phase("attribute", 3, 1)
            p.step("labelled/default/0of2", 5_000, "done")
            p.close()
            text = out.getvalue()
            assert "rows/s" in text
            assert ("it/s" in text or "unit/s" in text or "%" in text) == bar
            assert ("eta" in text) != bar  # tqdm prints its own remaining time

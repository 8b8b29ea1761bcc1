"""The ClickHouse exporter on the embedded engine under hostile data and a failing server:
poison rows quarantined while the rest is stored, and a disk-full / server-down episode
(``memory.FaultyClient`` over the engine injecting the errors) that ends with every row
stored exactly once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import Retryable
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config, RetryConfig
from pipeline.exporters.clickhouse.memory import FaultyClient, server_error
from pipeline.records import Attribution, AttributionBatch, Span, SpanBatch, Unattributed
from pipeline.registry import Context

NOW_NS = 1_700_000_000_000_000_000
MAX_I64 = 2**63 - 1


def exporter(tmp_path: Path, **kw: Any) -> ClickHouseExporter:
    opts: dict[str, Any] = dict(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
    opts.update(kw)
    return ClickHouseExporter(Config(**opts), Context("clickhouse", ["traces"],
                                                      data_dir=str(tmp_path)))


def attribution(n: int, cpu_ns: int, start_ns: int = NOW_NS) -> Attribution:
    return Attribution(n.to_bytes(16, "big"), n.to_bytes(8, "big"), "link", "api", "GET /",
                       b"", start_ns, 1_000, True, cpu_ns, 0, 3, {"leaf": 1}, {}, n)


def span_batch(worker: int, n: int, size: int = 5) -> SpanBatch:
    return SpanBatch([Span(worker.to_bytes(8, "big") + n.to_bytes(8, "big"),
                           worker.to_bytes(4, "big") + (n * size + i).to_bytes(4, "big"), b"",
                           "work", 1, "api", NOW_NS, NOW_NS + 1_000) for i in range(size)])


class TestPoison:
    async def test_out_of_range_rows_are_quarantined_and_ingestion_goes_on(
            self, tmp_path: Path) -> None:
        """An attribution summing three samples of 2**63-1 ns (beyond UInt64) and a span
        starting after 2262 (beyond DateTime64(9)), each among good rows, and unattributed
        CPU in a minute after 2106 (beyond DateTime): the good rows are stored, the bad
        ones are in ``quarantine`` with a reason, the next batch is accepted at once, and
        shutdown completes."""
        ex = exporter(tmp_path)
        await ex.start()
        good = [attribution(i, 10) for i in (1, 2, 4)]
        poison = attribution(3, 3 * MAX_I64)
        late = Unattributed("api", 4_400_000_000 * 10**9, 5, 0, 1)
        await asyncio.wait_for(ex.consume(AttributionBatch(
            good[:2] + [poison] + good[2:], [Unattributed("api", NOW_NS, 5, 0, 1), late])),
            timeout=10)
        spans = span_batch(0, 0, 4)
        spans.spans[2].start_ns = MAX_I64 + 1
        await asyncio.wait_for(ex.consume(spans), timeout=10)
        t0 = time.monotonic()
        await asyncio.wait_for(ex.consume(span_batch(0, 1)), timeout=10)
        assert time.monotonic() - t0 < 2
        _, rows = await ex.query("SELECT span_id, cpu_ns FROM spanprof.span_attribution "
                                 "ORDER BY span_id")
        assert rows == [(a.span_id.hex(), 10) for a in good]
        _, rows = await ex.query("SELECT count() FROM spanprof.otel_traces")
        assert rows == [(3 + 5,)]
        _, rows = await ex.query("SELECT count() FROM spanprof.unattributed_cpu")
        assert rows == [(1,)]
        _, rows = await ex.query("SELECT component, table, reason, row FROM "
                                 "spanprof.quarantine ORDER BY table")
        assert [r[:2] for r in rows] == [("clickhouse", "otel_traces"),
                                         ("clickhouse", "span_attribution"),
                                         ("clickhouse", "unattributed_cpu")]
        assert all("Unable to create native array" in r[2] for r in rows)
        assert json.loads(rows[1][3])["cpu_ns"] == 3 * MAX_I64
        assert json.loads(rows[0][3])["Timestamp"] == MAX_I64 + 1
        assert ex.metrics["quarantined_rows.span_attribution"] == 1
        assert ex.failed is None
        await asyncio.wait_for(ex.shutdown(), timeout=10)

    async def test_a_poison_kafka_block_delivered_twice_is_quarantined_once(
            self, tmp_path: Path) -> None:
        """A named block (Kafka) with a bad row, delivered again after a restart: its good
        rows and its quarantined row are each stored once (tokens derived from the
        block's)."""
        for _ in range(2):
            ex = exporter(tmp_path)
            await ex.start()
            batch = AttributionBatch([attribution(1, 5), attribution(2, 2**64)], origin="p0o7")
            await asyncio.wait_for(ex.consume(batch), timeout=10)
            await ex.shutdown()
        ex = exporter(tmp_path)
        await ex.start()
        _, rows = await ex.query("SELECT (SELECT count() FROM spanprof.span_attribution), "
                                 "(SELECT count() FROM spanprof.quarantine)")
        assert rows == [(1, 1)]
        await ex.shutdown()


async def _load(ex: ClickHouseExporter, workers: int, batches: int
                ) -> tuple[list[float], list[str | None]]:
    """``workers`` clients each send ``batches`` span batches, resending a refused one
    (as an OTLP client does, after a short pause); returns how long refusals took and
    what /health's ``failed`` said along the way."""
    refusals: list[float] = []
    health: list[str | None] = []
    done = asyncio.Event()

    async def client(w: int) -> None:
        await asyncio.sleep(0.3 * w)  # not all in the first generation
        for n in range(batches):
            batch = span_batch(w, n)
            while True:
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(ex.consume(batch), timeout=30)
                    break
                except Retryable:
                    refusals.append(time.monotonic() - t0)
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.02)

    async def watch() -> None:
        while not done.is_set():
            health.append(ex.failed)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(client(w) for w in range(workers)))
    done.set()
    await watcher
    return refusals, health


class TestServerFailing:
    @pytest.mark.parametrize("lands", [False, True], ids=["disk-full", "timeout-after-write"])
    async def test_refused_fast_unhealthy_then_every_row_once(self, tmp_path: Path,
                                                              lands: bool) -> None:
        """For 2 s every insert fails: disk full (nothing stored), or a timeout after the
        engine stored the block. Clients arriving meanwhile are refused quickly with
        Retryable (no waiting until a timeout; those whose rows may be in wait for them),
        ``failed`` names the exporter once ``unhealthy_after`` has passed and clears
        after recovery, and in the end every span is stored exactly once."""
        ex = exporter(tmp_path, unhealthy_after=0.5, retry_on_failure=RetryConfig(
            initial_interval=0.05, max_interval=0.2, max_elapsed_time=20.0))
        await ex.start()
        assert ex.writer is not None and ex.client is not None
        fault = (server_error(159, "TIMEOUT_EXCEEDED") if lands
                 else server_error(243, "NOT_ENOUGH_SPACE"))
        # the writer's inserts only: the engine itself stores and deduplicates what passes
        faulty = FaultyClient(ex.client)
        ex.writer.client = faulty
        faulty.fail(fault, lands=lands, seconds=2.0)
        refusals, health = await _load(ex, workers=4, batches=40)
        assert refusals, "no client was refused while inserts failed"
        assert max(refusals) < 1.0, max(refusals)
        failed = [h for h in health if h]
        assert failed and failed[0].startswith("exporters.clickhouse: inserts failing for ")
        assert ("NOT_ENOUGH_SPACE" if not lands else "TIMEOUT_EXCEEDED") in failed[0]
        assert health[-1] is None and ex.failed is None
        _, rows = await ex.query("SELECT count(), uniqExact(SpanId) FROM spanprof.otel_traces")
        assert rows == [(4 * 40 * 5, 4 * 40 * 5)]
        await asyncio.wait_for(ex.shutdown(), timeout=10)

"""Lock wait and allocated bytes stored per span (migration 14, issue #21): the
correlator's rows reach span_attribution and span_functions, the per-span totals view and
the per-call aggregates by duration bucket (op_tail_spans, op_tail_functions)."""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.records import Attribution, AttributionBatch
from pipeline.registry import Context
from tests.conftest import clickhouse

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
TRACE, SPAN = bytes(range(1, 17)), bytes(range(1, 9))


def row(source: int, method: str = "link", lock: int = 0, alloc: int = 0,
        fn_lock: dict[str, int] | None = None, fn_alloc: dict[str, int] | None = None,
        cpu: int = 0) -> Attribution:
    return Attribution(TRACE, SPAN, method, "cart", "update_cart", b"", T0, 900 * MS, True,
                       cpu, 0, cpu // (10 * MS), {"work": cpu} if cpu else {}, {}, source,
                       cpu, lock_ns=lock, alloc_bytes=alloc, self_lock_ns=fn_lock or {},
                       self_alloc_bytes=fn_alloc or {})


async def test_lock_and_bytes_reach_totals_functions_and_tail_aggregates(
        tmp_path: Path) -> None:
    """Two delta rows of one span (one with CPU, one with only lock and bytes): the totals
    add them up, each function keeps its own figures, and the aggregates by duration
    bucket hold the same sums."""
    cfg = Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05, ttl=0)
    ex = ClickHouseExporter(cfg, Context("clickhouse", ["attributions"], data_dir=str(tmp_path)))
    await ex.start()
    await ex.consume(AttributionBatch([
        row(1, cpu=20 * MS, lock=300 * MS, fn_lock={"Mutex.lock": 300 * MS}),
        row(2, lock=200 * MS, alloc=4096, fn_lock={"Mutex.lock": 150 * MS, "park": 50 * MS},
            fn_alloc={"make_slice": 4096}),
    ]))
    await ex.shutdown()
    with clickhouse(tmp_path / "ch") as ch:
        q = ch.query
        assert q("SELECT cpu_ns, lock_ns, alloc_bytes, sample_count FROM "
                 "spanprof.span_attribution_totals").result_rows == \
            [(20 * MS, 500 * MS, 4096, 2)]
        assert q("SELECT function, sum(self_cpu_ns), sum(self_lock_ns), sum(self_alloc_bytes) "
                 "FROM spanprof.span_functions GROUP BY function ORDER BY function"
                 ).result_rows == [("Mutex.lock", 0, 450 * MS, 0), ("make_slice", 0, 0, 4096),
                                   ("park", 0, 50 * MS, 0), ("work", 20 * MS, 0, 0)]
        bucket = int(8 * math.log2(900 * MS))
        assert q("SELECT bucket, sum(cpu_ns), sum(lock_ns), sum(alloc_bytes) "
                 "FROM spanprof.op_tail_spans GROUP BY bucket").result_rows == \
            [(bucket, 20 * MS, 500 * MS, 4096)]
        assert q("SELECT function, sum(self_lock_ns), sum(self_lock_sq), sum(self_alloc_bytes), "
                 "sum(rows) FROM spanprof.op_tail_functions WHERE function = 'Mutex.lock' "
                 "GROUP BY function").result_rows == \
            [("Mutex.lock", 450 * MS, float((300 * MS) ** 2 + (150 * MS) ** 2), 0, 2)]

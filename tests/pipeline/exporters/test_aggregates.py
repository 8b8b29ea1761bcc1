"""The aggregates ClickHouse maintains (materialized views into AggregatingMergeTree tables)
against a GROUP BY over the raw rows: 200 k samples through the correlator into the
embedded engine, then late samples for spans already reported; equal both times (the
property does not depend on the size: ``SPANPROF_AGGREGATE_SAMPLES=1000000`` runs it on a
million)."""

from __future__ import annotations

import os
import random
from pathlib import Path

from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.records import ProfileBatch, Sample, Span, SpanBatch, Stack
from pipeline.registry import Context
from processors.correlate.messages import SpanLookup, attribute_block, source_id, span_lookup_add
from processors.correlate.state import CorrelatorState

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
N_SPANS = 20_000
N_SAMPLES = int(os.environ.get("SPANPROF_AGGREGATE_SAMPLES", "200000"))
OPERATIONS = ["GET /cart", "POST /order", "GET /item", "render"]

# (aggregate query, the same question over raw rows); both sorted, compared exactly
PAIRS = {
    "op_minute": (
        "SELECT service, operation, method, minute, sum(cpu_ns), sum(inclusive_cpu_ns), "
        "sum(wall_ns), sum(sample_count), uniqExactMerge(calls) FROM spanprof.op_minute "
        "GROUP BY ALL ORDER BY ALL",
        # every stored span is a call (migration 10), with or without CPU rows
        "SELECT service, name, method, m, sum(cpu), sum(incl), sum(wall), sum(n), "
        "uniqExact(tid, sid) FROM ("
        " SELECT service, name, method, toStartOfMinute(start_time) AS m, cpu_ns AS cpu,"
        " inclusive_cpu_ns AS incl, wall_ns AS wall, sample_count AS n, trace_id AS tid,"
        " span_id AS sid FROM spanprof.span_attribution WHERE span_known = 1"
        " UNION ALL SELECT ServiceName, SpanName, 'link', toStartOfMinute(Timestamp), 0, 0,"
        " 0, 0, TraceId, SpanId FROM spanprof.otel_traces) GROUP BY ALL ORDER BY ALL"),
    "op_calls": (
        "SELECT service, operation, minute, trace_id, span_id, sum(cpu_ns), "
        "sum(inclusive_cpu_ns), max(duration_ns) FROM spanprof.op_calls GROUP BY ALL "
        "ORDER BY ALL",
        "SELECT service, name, m, tid, sid, sum(cpu), sum(incl), max(d) FROM ("
        " SELECT service, name, toStartOfMinute(start_time) AS m, trace_id AS tid,"
        " span_id AS sid, cpu_ns AS cpu, inclusive_cpu_ns AS incl, duration_ns AS d"
        " FROM spanprof.span_attribution"
        " WHERE span_known = 1 AND method IN ('link', 'link+time')"
        " UNION ALL SELECT ServiceName, SpanName, toStartOfMinute(Timestamp), TraceId,"
        " SpanId, 0, 0, Duration FROM spanprof.otel_traces) GROUP BY ALL ORDER BY ALL"),
    "fn_minute": (
        "SELECT service, operation, minute, function, method, sum(self_cpu_ns), "
        "sum(self_wall_ns) FROM spanprof.fn_minute GROUP BY ALL ORDER BY ALL",
        "SELECT service, operation, minute, function, method, sum(self_cpu_ns), "
        "sum(self_wall_ns) FROM spanprof.span_functions WHERE span_known = 1 GROUP BY ALL "
        "ORDER BY ALL"),
    "op_stacks_minute": (
        "SELECT service, operation, minute, stack_id, method, sum(cpu_ns), sum(wall_ns) "
        "FROM spanprof.op_stacks_minute GROUP BY ALL ORDER BY ALL",
        "SELECT service, operation, minute, stack_id, method, sum(cpu_ns), sum(wall_ns) "
        "FROM spanprof.span_stacks WHERE span_known = 1 GROUP BY ALL ORDER BY ALL"),
}


def workload(rng: random.Random) -> tuple[list[Span], list[Sample], dict[int, Stack]]:
    stacks = {i: Stack(i, [f"fn{i % 37}", f"caller{i % 5}", "main"], ["a.py"] * 3, [i, 2, 1])
              for i in range(1, 301)}
    spans = []
    for i in range(N_SPANS):
        tid = (i // 4 + 1).to_bytes(16, "big")  # four spans per trace
        start = T0 + rng.randrange(0, 30 * 60_000) * MS  # spread over 30 minutes
        spans.append(Span(tid, (i + 1).to_bytes(8, "big"), b"", OPERATIONS[i % 4], 2,
                          f"svc{i % 3}", start, start + rng.randrange(1, 500) * MS))
    samples = []
    for _ in range(N_SAMPLES):
        s = spans[rng.randrange(N_SPANS)]
        measure = "cpu" if rng.random() < 0.8 else "wall"
        samples.append(Sample(s.trace_id, s.span_id, s.service, s.start_ns, rng.randrange(1, 301),
                              measure, 10 * MS, 1, measure, "nanoseconds"))  # type: ignore[arg-type]
    return spans, samples, stacks


async def _compare(ex: ClickHouseExporter) -> dict[str, int]:
    sizes = {}
    for name, (agg, raw) in PAIRS.items():
        _, a = await ex.query(agg)
        _, r = await ex.query(raw)
        assert a == r, f"{name}: aggregate differs from the raw rows"
        assert a, name
        sizes[name] = len(a)
    return sizes


class TestAggregatesEqualRawRows:
    async def test_one_million_samples_then_late_ones(self, tmp_path: Path) -> None:
        rng = random.Random(11)
        spans, samples, stacks = workload(rng)
        ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                       ttl=0, batch_rows=50_000),  # type: ignore[arg-type]
                                Context("clickhouse", ["attributions"], data_dir=str(tmp_path)))
        await ex.start()
        await ex.consume(SpanBatch(spans))  # stored, as the traces pipeline does
        state = CorrelatorState(grace=1.0, max_entries=1_000_000)
        state.add_spans(spans, now=0.0)
        for i in range(0, N_SAMPLES, 100_000):
            state.add_samples(ProfileBatch(samples[i:i + 100_000], stacks), now=0.5)
        first = state.take_due(now=10.0)
        # a row per span with CPU or wall time only (each of these has some)
        assert len(first.attributions) >= len({(x.trace_id, x.span_id) for x in samples})
        await ex.consume(first)  # one batch bigger than max_pending_rows: still taken
        sizes = await _compare(ex)
        _, total = await ex.query("SELECT sum(cpu_ns) FROM spanprof.op_minute")
        assert total[0][0] == sum(s.value for s in samples if s.measure == "cpu")

        # late samples: spans already reported get more CPU, in new delta rows
        late = [Sample(s.trace_id, s.span_id, s.service, s.start_ns, rng.randrange(1, 301),
                       "cpu", 7 * MS, 1, "cpu", "nanoseconds")
                for s in rng.sample(spans, 5_000)]
        state.add_samples(ProfileBatch(late, stacks), now=11.0)
        second = state.take_due(now=12.0)
        assert second.attributions and state.stats.late_reported >= 5_000
        await ex.consume(second)
        after = await _compare(ex)
        assert after["op_calls"] == sizes["op_calls"]  # no new calls, more CPU in them
        _, total = await ex.query("SELECT sum(cpu_ns) FROM spanprof.op_minute")
        assert total[0][0] == sum(s.value for s in samples + late if s.measure == "cpu")
        # merges change nothing: force them and compare again
        for table in PAIRS:
            await ex.query(f"OPTIMIZE TABLE spanprof.{table} FINAL")
        await _compare(ex)
        await ex.shutdown()


def _final(sql: str) -> str:
    for t in ("span_attribution", "span_functions", "span_stacks", "otel_traces"):
        sql = sql.replace(f"FROM spanprof.{t} ", f"FROM spanprof.{t} FINAL ")
    return sql


class TestKafkaBlockDeliveredTwice:
    async def test_redelivered_block_reaches_the_aggregates_once(self, tmp_path: Path) -> None:
        """A Kafka worker's block (many messages, one token) written, then written again
        after a crash: the aggregates equal the deduplicated raw rows. The same rows without
        the block's name (a fresh insert each time) count twice, which is what the token
        prevents."""
        rng = random.Random(5)
        spans, samples, stacks = workload(rng)
        spans, samples = spans[:600], [s for s in samples if int.from_bytes(s.span_id, "big")
                                       <= 600][:4_000]
        ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                       ttl=0),  # type: ignore[arg-type]
                                Context("clickhouse", ["attributions"], data_dir=str(tmp_path)))
        await ex.start()
        seen: SpanLookup = {}
        span_block = SpanBatch(spans, origin="spans/0/0-3/aa", parts=[
            (f"spans/0/{i}", 150) for i in range(4)])
        await ex.consume(span_block)  # stored, as the traces pipeline does
        assert attribute_block(span_block, seen).attributions == []
        span_lookup_add(seen, span_block, 10_000)
        block = ProfileBatch(samples, stacks, origin="profiles/0/0-4/bb",
                             parts=[(f"profiles/0/{i}", 1_000) for i in range(4)])
        rows = attribute_block(block, seen)
        assert rows.origin == block.origin and {a.source for a in rows.attributions} == {
            source_id(f"profiles/0/{i}") for i in range(4)}
        for _ in range(2):  # delivered, then delivered again
            await ex.consume(attribute_block(block, seen))
        pairs = {k: (a, _final(r)) for k, (a, r) in PAIRS.items()}
        for name, (agg, raw) in pairs.items():
            _, a = await ex.query(agg)
            _, r = await ex.query(raw)
            assert a and a == r, name
        _, total = await ex.query("SELECT sum(cpu_ns) FROM spanprof.op_minute")
        assert total[0][0] == sum(s.value for s in samples if s.measure == "cpu")
        unnamed = attribute_block(block, seen)
        unnamed.origin = ""
        await ex.consume(unnamed)
        _, total = await ex.query("SELECT sum(cpu_ns) FROM spanprof.op_minute")
        assert total[0][0] == 2 * sum(s.value for s in samples if s.measure == "cpu")
        await ex.shutdown()

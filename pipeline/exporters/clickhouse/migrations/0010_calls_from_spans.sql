-- Migration 10: a span's calls and duration come from otel_traces, so that the correlator
-- writes an attribution row only where there is CPU or wall time (most spans have none:
-- at 100 Hz a 10 ms span has one sample in ten). Before this, every span had a `link`
-- row of zeros carrying its name and duration: as many attribution rows as spans, most
-- of the correlator's inserts. Queries read name, duration and off-CPU time of spans
-- without CPU from otel_traces (pipeline/admin/queries.py).
--
-- Both views add zeros to the sums and the span to the set of calls (op_minute, under
-- method `link`, the row a span used to have) or its duration (op_calls): a span with
-- CPU is counted once whichever of its rows arrive, because `calls` is a set and
-- `duration_ns` a max. A block of spans inserted twice (a client's retry under the same
-- insert_deduplication_token) reaches them once (migration 6). Rows stored before this
-- migration keep their zero `link` rows, which add nothing more.

-- statement
-- every span is a call of its operation in the minute it started
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_minute_spans_mv TO {db}.op_minute AS
SELECT ServiceName AS service, SpanName AS operation, 'link' AS method,
       toStartOfMinute(Timestamp) AS minute, toUInt64(0) AS cpu_ns,
       toUInt64(0) AS inclusive_cpu_ns, toUInt64(0) AS wall_ns, toUInt64(0) AS sample_count,
       uniqExactState(TraceId, SpanId) AS calls
FROM {db}.otel_traces
GROUP BY service, operation, minute

-- statement
-- every span is a row of op_calls with its duration, CPU or not (quantiles over calls)
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_spans_mv TO {db}.op_calls AS
SELECT ServiceName AS service, SpanName AS operation, toStartOfMinute(Timestamp) AS minute,
       TraceId AS trace_id, SpanId AS span_id, toUInt64(0) AS cpu_ns,
       toUInt64(0) AS inclusive_cpu_ns, max(Duration) AS duration_ns
FROM {db}.otel_traces
GROUP BY service, operation, minute, trace_id, span_id

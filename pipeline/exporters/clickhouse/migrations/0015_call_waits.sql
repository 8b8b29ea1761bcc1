-- Migration 15: wall time, lock wait and allocated bytes per call in op_calls (issue #21).
--
-- `why` gives every figure an interval from the spread of its per-call values; op_calls,
-- one row per call, held the spread of duration and CPU only, so its wall, lock and
-- allocation figures per group had none (marked too few to trust whatever the calls).
-- These columns give them one. Rows written before this migration have 0 here: `why`
-- uses a group's spread only where op_calls' sum agrees with the aggregates' (else no
-- interval, marked), and a backfill's rebuild of the minutes fills them.

-- statement
ALTER TABLE {db}.op_calls
    ADD COLUMN IF NOT EXISTS wall_ns SimpleAggregateFunction(sum, UInt64)

-- statement
ALTER TABLE {db}.op_calls
    ADD COLUMN IF NOT EXISTS lock_ns SimpleAggregateFunction(sum, UInt64)

-- statement
ALTER TABLE {db}.op_calls
    ADD COLUMN IF NOT EXISTS alloc_bytes SimpleAggregateFunction(sum, UInt64)

-- statement
-- the views again, with the new columns (the tables are only read while they are away:
-- migrations run before the pipeline writes)
DROP VIEW IF EXISTS {db}.op_calls_mv

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_mv TO {db}.op_calls AS
SELECT tenant, service, name AS operation, toStartOfMinute(start_time) AS minute, trace_id,
       span_id, sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       max(duration_ns) AS duration_ns, sum(wall_ns) AS wall_ns, sum(lock_ns) AS lock_ns,
       sum(alloc_bytes) AS alloc_bytes
FROM {db}.span_attribution WHERE span_known = 1 AND method IN ('link', 'link+time')
GROUP BY tenant, service, operation, minute, trace_id, span_id

-- statement
DROP VIEW IF EXISTS {db}.op_calls_spans_mv

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_spans_mv TO {db}.op_calls AS
SELECT tenant, ServiceName AS service, SpanName AS operation,
       toStartOfMinute(Timestamp) AS minute, TraceId AS trace_id, SpanId AS span_id,
       toUInt64(0) AS cpu_ns, toUInt64(0) AS inclusive_cpu_ns, max(Duration) AS duration_ns,
       toUInt64(0) AS wall_ns, toUInt64(0) AS lock_ns, toUInt64(0) AS alloc_bytes
FROM {db}.otel_traces
GROUP BY tenant, service, operation, minute, trace_id, span_id

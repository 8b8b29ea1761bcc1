-- Migration 4: flame graphs per span and the aggregates ClickHouse maintains itself.
--
-- Attribution rows are deltas, so every aggregate is a sum (or a set, for calls) that
-- merges the same whatever the order rows arrive in: a late sample's row adds to its
-- minute, and each aggregate stays equal to a GROUP BY over the raw rows. The views
-- take only rows of known spans (span_known = 1): CPU whose span never came has no
-- operation. A redelivered Kafka block re-inserts under the same
-- insert_deduplication_token; ClickHouse drops it, and drops the views' output in
-- their targets once those keep a deduplication window (migration 6).

-- statement
-- where each function's CPU was burnt, so the per-operation views need no join
ALTER TABLE {db}.span_functions
    ADD COLUMN IF NOT EXISTS service LowCardinality(String),
    ADD COLUMN IF NOT EXISTS operation LowCardinality(String),
    ADD COLUMN IF NOT EXISTS minute DateTime CODEC(Delta, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS span_known UInt8

-- statement
-- per span and stack: the span's flame graph (stacks resolved through
-- profile_stacks); keyed like span_attribution, one trace is one narrow range
CREATE TABLE IF NOT EXISTS {db}.span_stacks (
    trace_id String CODEC(ZSTD(1)),
    span_id String CODEC(ZSTD(1)),
    method LowCardinality(String),
    stack_id UInt64 CODEC(ZSTD(1)),
    source UInt64 CODEC(ZSTD(1)),
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    span_known UInt8,
    cpu_ns UInt64 CODEC(T64, ZSTD(1)),
    wall_ns UInt64 CODEC(T64, ZSTD(1)),
    updated_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree
ORDER BY (trace_id, span_id, method, stack_id, source)
{ttl:updated_at}
SETTINGS {dedup}

-- statement
-- CPU per (service, operation, minute): sums, and the set of spans seen (calls), so
-- CPU per call = cpu_ns / calls. Ordered for "one operation over a time range".
CREATE TABLE IF NOT EXISTS {db}.op_minute (
    service LowCardinality(String),
    operation LowCardinality(String),
    method LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    cpu_ns SimpleAggregateFunction(sum, UInt64),
    inclusive_cpu_ns SimpleAggregateFunction(sum, UInt64),
    wall_ns SimpleAggregateFunction(sum, UInt64),
    sample_count SimpleAggregateFunction(sum, UInt64),
    calls AggregateFunction(uniqExact, String, String)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (service, operation, method, minute)
{ttl:minute}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_minute_mv TO {db}.op_minute AS
SELECT service, name AS operation, method, toStartOfMinute(start_time) AS minute,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       uniqExactState(trace_id, span_id) AS calls
FROM {db}.span_attribution WHERE span_known = 1
GROUP BY service, operation, method, minute

-- statement
-- per call: one row per span once merged (the sum of its deltas), under its
-- operation and minute: quantiles of CPU per call over any range come from here
-- (a 20 ms span has one or two samples; its operation has thousands). Exact
-- methods only, as the default figures.
CREATE TABLE IF NOT EXISTS {db}.op_calls (
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    trace_id String CODEC(ZSTD(1)),
    span_id String CODEC(ZSTD(1)),
    cpu_ns SimpleAggregateFunction(sum, UInt64),
    inclusive_cpu_ns SimpleAggregateFunction(sum, UInt64),
    duration_ns SimpleAggregateFunction(max, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (service, operation, minute, trace_id, span_id)
{ttl:minute}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_mv TO {db}.op_calls AS
SELECT service, name AS operation, toStartOfMinute(start_time) AS minute, trace_id, span_id,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       max(duration_ns) AS duration_ns
FROM {db}.span_attribution WHERE span_known = 1 AND method IN ('link', 'link+time')
GROUP BY service, operation, minute, trace_id, span_id

-- statement
-- self CPU per (service, operation, function, minute): "which functions burn the
-- CPU of this operation", over any range, without touching per-span rows
CREATE TABLE IF NOT EXISTS {db}.fn_minute (
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    function String CODEC(ZSTD(1)),
    method LowCardinality(String),
    self_cpu_ns SimpleAggregateFunction(sum, UInt64),
    self_wall_ns SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (service, operation, minute, function, method)
{ttl:minute}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.fn_minute_mv TO {db}.fn_minute AS
SELECT service, operation, minute, function, method, sum(self_cpu_ns) AS self_cpu_ns,
       sum(self_wall_ns) AS self_wall_ns
FROM {db}.span_functions WHERE span_known = 1
GROUP BY service, operation, minute, function, method

-- statement
-- CPU per (service, operation, stack, minute): an operation's flame graph
CREATE TABLE IF NOT EXISTS {db}.op_stacks_minute (
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    stack_id UInt64 CODEC(ZSTD(1)),
    method LowCardinality(String),
    cpu_ns SimpleAggregateFunction(sum, UInt64),
    wall_ns SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (service, operation, minute, stack_id, method)
{ttl:minute}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_stacks_minute_mv
TO {db}.op_stacks_minute AS
SELECT service, operation, minute, stack_id, method, sum(cpu_ns) AS cpu_ns,
       sum(wall_ns) AS wall_ns
FROM {db}.span_stacks WHERE span_known = 1
GROUP BY service, operation, minute, stack_id, method

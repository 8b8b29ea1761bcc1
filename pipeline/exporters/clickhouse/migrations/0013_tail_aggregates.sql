-- Migration 13: aggregates by call duration, so that `spanprof why` (issue #21) compares an
-- operation's slowest calls with its typical ones without reading rows call by call.
--
-- Each is keyed by the span's duration bucket: floor(8 * log2(duration in ns)), eight
-- buckets per doubling (each about 9% wide; 0 for a duration of 0). A question picks the
-- tail as the buckets from some bucket up, and the typical calls as the buckets below it.
-- span_functions and span_stacks rows carry their span's duration from now on (the
-- correlator knows it: span_attribution has always carried it); rows written before this
-- migration have 0 and fall in bucket 0, and the views start empty: re-attribute a range
-- (`spanprof backfill reattribute`) to have its rows written again with durations, and
-- these aggregates rebuilt from them.
--
-- Sums over delta rows, like the aggregates of migration 4: they merge the same whatever
-- the order rows arrive in. The squares of op_tail_functions are of each row's value: a
-- span with one row per function (the usual case) gives the exact spread of per-call
-- values; a span whose CPU came in several delta rows counts them as several smaller
-- values (the spread is then underestimated, never the sums). `rows` counts the rows
-- summed: the calls behind a function's figure.

-- statement
ALTER TABLE {db}.span_functions
    ADD COLUMN IF NOT EXISTS duration_ns UInt64 CODEC(T64, ZSTD(1))

-- statement
ALTER TABLE {db}.span_stacks
    ADD COLUMN IF NOT EXISTS duration_ns UInt64 CODEC(T64, ZSTD(1))

-- statement
-- per operation, minute, duration bucket and method: CPU, inclusive CPU, wall, samples
CREATE TABLE IF NOT EXISTS {db}.op_tail_spans (
    tenant LowCardinality(String) DEFAULT 'default',
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    bucket UInt16,
    method LowCardinality(String),
    cpu_ns SimpleAggregateFunction(sum, UInt64),
    inclusive_cpu_ns SimpleAggregateFunction(sum, UInt64),
    wall_ns SimpleAggregateFunction(sum, UInt64),
    sample_count SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (tenant, service, operation, minute, bucket, method)
{ttl:minute}
SETTINGS {dedup}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_tail_spans_mv TO {db}.op_tail_spans AS
SELECT tenant, service, name AS operation, toStartOfMinute(start_time) AS minute,
       toUInt16(if(duration_ns = 0, 0, floor(8 * log2(duration_ns)))) AS bucket, method,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count
FROM {db}.span_attribution WHERE span_known = 1
GROUP BY tenant, service, operation, minute, bucket, method

-- statement
-- per operation, minute, duration bucket, function and method: self CPU and wall, their
-- squares per row (the spread of per-call values) and the rows summed
CREATE TABLE IF NOT EXISTS {db}.op_tail_functions (
    tenant LowCardinality(String) DEFAULT 'default',
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    bucket UInt16,
    function String CODEC(ZSTD(1)),
    method LowCardinality(String),
    self_cpu_ns SimpleAggregateFunction(sum, UInt64),
    self_wall_ns SimpleAggregateFunction(sum, UInt64),
    self_cpu_sq SimpleAggregateFunction(sum, Float64),
    self_wall_sq SimpleAggregateFunction(sum, Float64),
    rows SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (tenant, service, operation, minute, bucket, function, method)
{ttl:minute}
SETTINGS {dedup}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_tail_functions_mv TO {db}.op_tail_functions AS
SELECT tenant, service, operation, minute, bucket, function, method,
       sum(c) AS self_cpu_ns, sum(w) AS self_wall_ns, sum(cf * cf) AS self_cpu_sq,
       sum(wf * wf) AS self_wall_sq, count() AS rows
FROM (SELECT tenant, service, operation, minute,
             toUInt16(if(duration_ns = 0, 0, floor(8 * log2(duration_ns)))) AS bucket,
             function, method, self_cpu_ns AS c, self_wall_ns AS w,
             toFloat64(self_cpu_ns) AS cf, toFloat64(self_wall_ns) AS wf
      FROM {db}.span_functions WHERE span_known = 1)
GROUP BY tenant, service, operation, minute, bucket, function, method

-- statement
-- per operation, minute, duration bucket, stack and method: a differential flame graph
CREATE TABLE IF NOT EXISTS {db}.op_tail_stacks (
    tenant LowCardinality(String) DEFAULT 'default',
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    bucket UInt16,
    stack_id UInt64,
    method LowCardinality(String),
    cpu_ns SimpleAggregateFunction(sum, UInt64),
    wall_ns SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (tenant, service, operation, minute, bucket, stack_id, method)
{ttl:minute}
SETTINGS {dedup}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_tail_stacks_mv TO {db}.op_tail_stacks AS
SELECT tenant, service, operation, minute,
       toUInt16(if(duration_ns = 0, 0, floor(8 * log2(duration_ns)))) AS bucket, stack_id,
       method, sum(cpu_ns) AS cpu_ns, sum(wall_ns) AS wall_ns
FROM {db}.span_stacks WHERE span_known = 1
GROUP BY tenant, service, operation, minute, bucket, stack_id, method

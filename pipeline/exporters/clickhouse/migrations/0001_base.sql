-- Migration 1: the tables spanprof writes, and the views its queries read.
--
-- Ids are lowercase hex strings, as in the OpenTelemetry Collector's ClickHouse exporter, so
-- spanprof's tables join otel_traces on TraceId/SpanId without conversion.

-- statement
-- The Collector exporter's traces table, same names and types, so Grafana's ClickHouse
-- data source and existing queries run unchanged on spanprof's data.
-- {dedup}: a retried insert with the same insert_deduplication_token is a no-op.
CREATE TABLE IF NOT EXISTS {db}.otel_traces (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),      -- span start; Delta: sorted times
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(Timestamp)
-- the Collector's key: "spans of a service/operation over time" reads a narrow range;
-- TraceId, SpanId appended so that a span delivered twice (Kafka redelivery after a
-- worker crash, a client's retry) collapses to one row (read FINAL for exact counts)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), TraceId, SpanId)
{ttl:Timestamp}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1, {dedup}

-- statement
-- trace id -> time range, so "one trace" reads one partition range of otel_traces
CREATE TABLE IF NOT EXISTS {db}.otel_traces_trace_id_ts (
    TraceId String CODEC(ZSTD(1)),
    Start DateTime CODEC(Delta, ZSTD(1)),
    End DateTime CODEC(Delta, ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(Start)
ORDER BY (TraceId, Start)
{ttl:Start}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.otel_traces_trace_id_ts_mv
TO {db}.otel_traces_trace_id_ts AS
SELECT TraceId, min(toDateTime(Timestamp)) AS Start, max(toDateTime(Timestamp)) AS End
FROM {db}.otel_traces WHERE TraceId != '' GROUP BY TraceId

-- statement
-- Stacks stored once: samples carry only a 64-bit stack id. Replacing: the same stack
-- written by two requests (or two workers) collapses to one row.
CREATE TABLE IF NOT EXISTS {db}.profile_stacks (
    stack_id UInt64,
    functions Array(String) CODEC(ZSTD(3)),            -- leaf first
    files Array(String) CODEC(ZSTD(3)),
    lines Array(Int64) CODEC(ZSTD(1)),
    leaf String MATERIALIZED functions[1],
    last_seen DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree(last_seen)
ORDER BY stack_id
SETTINGS {dedup}

-- statement
CREATE TABLE IF NOT EXISTS {db}.profile_samples (
    time DateTime64(9) CODEC(Delta, ZSTD(1)),
    service LowCardinality(String),
    trace_id String CODEC(ZSTD(1)),                    -- '' when the sample has no link
    span_id String CODEC(ZSTD(1)),
    stack_id UInt64 CODEC(ZSTD(1)),
    measure LowCardinality(String),                    -- cpu | wall | off_cpu | other
    sample_type LowCardinality(String),
    unit LowCardinality(String),
    value UInt64 CODEC(T64, ZSTD(1)),                  -- ns for time measures
    count UInt32 CODEC(T64, ZSTD(1)),                  -- profiler ticks it stands for
    INDEX idx_trace_id trace_id TYPE bloom_filter(0.001) GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(time)
-- "functions of a service over a time range" is the common scan; trace lookups use the index
ORDER BY (service, measure, toStartOfMinute(time), stack_id)
{ttl:time}
SETTINGS ttl_only_drop_parts = 1, {dedup}

-- statement
-- Attribution rows are deltas (processors/correlate/state.py): a span's totals are the
-- sum of its rows. Each row names its source: a hash of the Kafka message it came
-- from, or a random id for in-memory summaries. Replacing on the source makes a
-- redelivered message (after a worker crash) rewrite, not add: queries read FINAL.
CREATE TABLE IF NOT EXISTS {db}.span_attribution (
    trace_id String,                                   -- '' : sample labelled by span only
    span_id String,
    method LowCardinality(String),                     -- link | link+time | thread | window
    source UInt64,
    service LowCardinality(String),
    name String,                                       -- '' on rows from samples
    parent_span_id String,
    start_time DateTime64(9),
    duration_ns UInt64,
    span_known UInt8,
    cpu_ns UInt64 CODEC(T64, ZSTD(1)),
    wall_ns UInt64 CODEC(T64, ZSTD(1)),
    sample_count UInt64 CODEC(T64, ZSTD(1)),
    updated_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree
-- one trace's attribution is one narrow range; method keeps exact and approximate apart
ORDER BY (trace_id, span_id, method, source)
{ttl:updated_at}
SETTINGS {dedup}

-- statement
CREATE TABLE IF NOT EXISTS {db}.span_functions (
    trace_id String,
    span_id String,
    method LowCardinality(String),
    function String,
    source UInt64,
    self_cpu_ns UInt64 CODEC(T64, ZSTD(1)),
    self_wall_ns UInt64 CODEC(T64, ZSTD(1)),
    updated_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree
ORDER BY (trace_id, span_id, method, function, source)
{ttl:updated_at}
SETTINGS {dedup}

-- statement
CREATE TABLE IF NOT EXISTS {db}.unattributed_cpu (
    service LowCardinality(String),
    minute DateTime,
    source UInt64,
    cpu_ns UInt64,
    wall_ns UInt64,
    sample_count UInt64
) ENGINE = ReplacingMergeTree
ORDER BY (service, minute, source)
{ttl:minute}
SETTINGS {dedup}

-- statement
-- span id -> trace id, for samples that carry only a span id (some Pyroscope SDKs):
-- resolved here, in ClickHouse, whichever worker saw the sample or the span
CREATE TABLE IF NOT EXISTS {db}.span_index (
    span_id String,
    trace_id String,
    time DateTime
) ENGINE = ReplacingMergeTree
ORDER BY span_id
{ttl:time}

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.span_index_mv TO {db}.span_index AS
SELECT SpanId AS span_id, TraceId AS trace_id, toDateTime(Timestamp) AS time
FROM {db}.otel_traces

-- statement
-- Rows with the span's trace resolved (span-only rows through span_index), one per
-- (trace, span, method, source) thanks to FINAL.
CREATE VIEW IF NOT EXISTS {db}.span_attribution_rows AS
SELECT if(a.trace_id = '' AND ix.trace_id != '', ix.trace_id, a.trace_id) AS trace_id,
       a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service,
       a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time,
       a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns,
       a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {db}.span_index GROUP BY span_id)
    AS ix ON a.span_id = ix.span_id
SETTINGS join_use_nulls = 0

-- statement
-- Totals per span, whatever the state of background merges.
CREATE VIEW IF NOT EXISTS {db}.span_attribution_totals AS
SELECT trace_id, span_id, method,
       max(service) AS service, max(name) AS name, max(parent_span_id) AS parent_span_id,
       max(start_time) AS start_time, max(duration_ns) AS duration_ns,
       max(span_known) AS span_known,
       sum(cpu_ns) AS cpu_ns, sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       toUInt64(greatest(0, toInt64(duration_ns) - toInt64(cpu_ns))) AS off_cpu_ns  -- aliases
FROM {db}.span_attribution_rows
GROUP BY trace_id, span_id, method

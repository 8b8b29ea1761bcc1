-- Migration 11: tenants (issue #17). Every data table gets a `tenant` column, first in its
-- ordering key: each query names its tenant and reads one range of the key, and rows of
-- two tenants never collapse into one (the Replacing tables replace on the whole key), even
-- with the same trace and span ids. The aggregates group by tenant; the views carry it.
-- schema_migrations and correlator_checkpoint are not tenant data and stay as they are.
--
-- ClickHouse cannot change an ordering key in place (MODIFY ORDER BY only appends a column
-- added in the same ALTER), so each table is rebuilt (schema.py's docstring): made anew as
-- NAME__new, emptied (a copy cut short by a kill left rows there), filled with every row of
-- NAME as tenant 'default', and exchanged with NAME (EXCHANGE TABLES: atomic), each step
-- only while NAME lacks `tenant`; then NAME__new, the old rows by then, is dropped. A
-- migration is recorded only once all of it is applied, and a kill anywhere makes the next
-- start apply it again whole: the steps already done then do nothing, a copy cut short is
-- started over (insert_deduplicate = 0: the copy's blocks are the same as the previous
-- attempt's, and must not be dropped as repeats), and no row is doubled or lost.
--
-- The views are dropped first and made again last, carrying tenant: nothing feeds the
-- aggregates from the copies (the aggregates are copied themselves), and a materialized
-- view follows a table's name through an exchange, not its data. A migration runs before
-- the exporter writes; rows written to a table by another process (a gateway not yet
-- upgraded) between its copy and its exchange are lost with the old table: upgrade with
-- the other writers stopped. Rows they write after the exchange go to tenant 'default'
-- (every `tenant` column DEFAULTs to it, as does the Collector's exporter's otel_traces).
-- The copy reads and writes every row once: on a large store this migration takes as long
-- as copying the store, and needs its size again in free disk until the old tables go.

-- statement
-- the views are made again, with tenant, at the end of this migration
DROP VIEW IF EXISTS {db}.otel_traces_trace_id_ts_mv

-- statement
DROP VIEW IF EXISTS {db}.span_index_mv

-- statement
DROP VIEW IF EXISTS {db}.op_minute_mv

-- statement
DROP VIEW IF EXISTS {db}.op_calls_mv

-- statement
DROP VIEW IF EXISTS {db}.fn_minute_mv

-- statement
DROP VIEW IF EXISTS {db}.op_stacks_minute_mv

-- statement
DROP VIEW IF EXISTS {db}.op_minute_spans_mv

-- statement
DROP VIEW IF EXISTS {db}.op_calls_spans_mv

-- statement when otel_traces lacks tenant
-- The Collector's key with tenant first: "spans of a service/operation over time" is asked
-- within one tenant; TraceId, SpanId appended so that a span delivered twice collapses to
-- one row (read FINAL for exact counts), and two tenants' spans with the same ids do not.
-- tenant DEFAULT 'default': a Collector exporter writing this table (or a gateway not yet
-- upgraded) names no tenant, and its rows are the default tenant's.
CREATE TABLE IF NOT EXISTS {db}.otel_traces__new (
    tenant LowCardinality(String) DEFAULT 'default',
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
    ingested_at DateTime DEFAULT now() CODEC(Delta, ZSTD(1)),
    request UInt64 DEFAULT 0 CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1,
    INDEX ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(Timestamp)
ORDER BY (tenant, ServiceName, SpanName, toDateTime(Timestamp), TraceId, SpanId)
{ttl:Timestamp}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1, {dedup}

-- statement when otel_traces lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.otel_traces__new

-- statement when otel_traces lacks tenant
INSERT INTO {db}.otel_traces__new (tenant, Timestamp, TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName, ResourceAttributes, ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage, Events.Timestamp, Events.Name, Events.Attributes, Links.TraceId, Links.SpanId, Links.TraceState, Links.Attributes, ingested_at, request)
SETTINGS insert_deduplicate = 0
SELECT 'default', Timestamp, TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName, ResourceAttributes, ScopeName, ScopeVersion, SpanAttributes, Duration, StatusCode, StatusMessage, Events.Timestamp, Events.Name, Events.Attributes, Links.TraceId, Links.SpanId, Links.TraceState, Links.Attributes, ingested_at, request
FROM {db}.otel_traces

-- statement when otel_traces lacks tenant
EXCHANGE TABLES {db}.otel_traces AND {db}.otel_traces__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.otel_traces__new

-- statement when otel_traces_trace_id_ts lacks tenant
-- (tenant, trace id) -> time range, so "one trace" reads one partition range of otel_traces
CREATE TABLE IF NOT EXISTS {db}.otel_traces_trace_id_ts__new (
    tenant LowCardinality(String) DEFAULT 'default',
    TraceId String CODEC(ZSTD(1)),
    Start DateTime CODEC(Delta, ZSTD(1)),
    End DateTime CODEC(Delta, ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(Start)
ORDER BY (tenant, TraceId, Start)
{ttl:Start}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1

-- statement when otel_traces_trace_id_ts lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.otel_traces_trace_id_ts__new

-- statement when otel_traces_trace_id_ts lacks tenant
INSERT INTO {db}.otel_traces_trace_id_ts__new (tenant, TraceId, Start, End)
SETTINGS insert_deduplicate = 0
SELECT 'default', TraceId, Start, End
FROM {db}.otel_traces_trace_id_ts

-- statement when otel_traces_trace_id_ts lacks tenant
EXCHANGE TABLES {db}.otel_traces_trace_id_ts AND {db}.otel_traces_trace_id_ts__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.otel_traces_trace_id_ts__new

-- statement when profile_stacks lacks tenant
-- Stacks stored once per tenant (function and file names are the tenant's): samples carry
-- only a 64-bit stack id, read with their own tenant's. Replacing on (tenant, stack_id):
-- the same stack written by two requests (or two workers) collapses to one row, the
-- newest last_seen (migration 7's TTL counts from it).
CREATE TABLE IF NOT EXISTS {db}.profile_stacks__new (
    tenant LowCardinality(String) DEFAULT 'default',
    stack_id UInt64,
    functions Array(String) CODEC(ZSTD(3)),            -- leaf first
    files Array(String) CODEC(ZSTD(3)),
    lines Array(Int64) CODEC(ZSTD(1)),
    leaf String MATERIALIZED functions[1],
    last_seen DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree(last_seen)
ORDER BY (tenant, stack_id)
{stack_ttl:last_seen}
SETTINGS {dedup}

-- statement when profile_stacks lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.profile_stacks__new

-- statement when profile_stacks lacks tenant
INSERT INTO {db}.profile_stacks__new (tenant, stack_id, functions, files, lines, last_seen)
SETTINGS insert_deduplicate = 0
SELECT 'default', stack_id, functions, files, lines, last_seen
FROM {db}.profile_stacks

-- statement when profile_stacks lacks tenant
EXCHANGE TABLES {db}.profile_stacks AND {db}.profile_stacks__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.profile_stacks__new

-- statement when profile_samples lacks tenant
-- "functions of a service over a time range", within one tenant, is the common scan;
-- trace lookups use the index
CREATE TABLE IF NOT EXISTS {db}.profile_samples__new (
    tenant LowCardinality(String) DEFAULT 'default',
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
    thread_id UInt64 CODEC(T64, ZSTD(1)),              -- 0: not known
    thread_name LowCardinality(String),
    span_name LowCardinality(String),
    pid UInt32 CODEC(T64, ZSTD(1)),
    host LowCardinality(String),
    ingested_at DateTime DEFAULT now() CODEC(Delta, ZSTD(1)),
    timed UInt8 DEFAULT 0,                             -- time is the sample's own instant
    request UInt64 DEFAULT 0 CODEC(ZSTD(1)),           -- client request id
    INDEX idx_trace_id trace_id TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(time)
ORDER BY (tenant, service, measure, toStartOfMinute(time), stack_id)
{ttl:time}
SETTINGS ttl_only_drop_parts = 1, {dedup}

-- statement when profile_samples lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.profile_samples__new

-- statement when profile_samples lacks tenant
INSERT INTO {db}.profile_samples__new (tenant, time, service, trace_id, span_id, stack_id, measure, sample_type, unit, value, count, thread_id, thread_name, span_name, pid, host, ingested_at, timed, request)
SETTINGS insert_deduplicate = 0
SELECT 'default', time, service, trace_id, span_id, stack_id, measure, sample_type, unit, value, count, thread_id, thread_name, span_name, pid, host, ingested_at, timed, request
FROM {db}.profile_samples

-- statement when profile_samples lacks tenant
EXCHANGE TABLES {db}.profile_samples AND {db}.profile_samples__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.profile_samples__new

-- statement when span_attribution lacks tenant
-- one trace's attribution is one narrow range of its tenant; method keeps exact and
-- approximate apart; source makes a redelivered message rewrite, not add (read FINAL)
CREATE TABLE IF NOT EXISTS {db}.span_attribution__new (
    tenant LowCardinality(String) DEFAULT 'default',
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
    updated_at DateTime DEFAULT now(),
    inclusive_cpu_ns UInt64 CODEC(T64, ZSTD(1))
) ENGINE = ReplacingMergeTree
ORDER BY (tenant, trace_id, span_id, method, source)
{ttl:updated_at}
SETTINGS {dedup}

-- statement when span_attribution lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.span_attribution__new

-- statement when span_attribution lacks tenant
INSERT INTO {db}.span_attribution__new (tenant, trace_id, span_id, method, source, service, name, parent_span_id, start_time, duration_ns, span_known, cpu_ns, wall_ns, sample_count, updated_at, inclusive_cpu_ns)
SETTINGS insert_deduplicate = 0
SELECT 'default', trace_id, span_id, method, source, service, name, parent_span_id, start_time, duration_ns, span_known, cpu_ns, wall_ns, sample_count, updated_at, inclusive_cpu_ns
FROM {db}.span_attribution

-- statement when span_attribution lacks tenant
EXCHANGE TABLES {db}.span_attribution AND {db}.span_attribution__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.span_attribution__new

-- statement when span_functions lacks tenant
-- keyed like span_attribution: one trace of one tenant is one narrow range
CREATE TABLE IF NOT EXISTS {db}.span_functions__new (
    tenant LowCardinality(String) DEFAULT 'default',
    trace_id String,
    span_id String,
    method LowCardinality(String),
    function String,
    source UInt64,
    self_cpu_ns UInt64 CODEC(T64, ZSTD(1)),
    self_wall_ns UInt64 CODEC(T64, ZSTD(1)),
    updated_at DateTime DEFAULT now(),
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    span_known UInt8
) ENGINE = ReplacingMergeTree
ORDER BY (tenant, trace_id, span_id, method, function, source)
{ttl:updated_at}
SETTINGS {dedup}

-- statement when span_functions lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.span_functions__new

-- statement when span_functions lacks tenant
INSERT INTO {db}.span_functions__new (tenant, trace_id, span_id, method, function, source, self_cpu_ns, self_wall_ns, updated_at, service, operation, minute, span_known)
SETTINGS insert_deduplicate = 0
SELECT 'default', trace_id, span_id, method, function, source, self_cpu_ns, self_wall_ns, updated_at, service, operation, minute, span_known
FROM {db}.span_functions

-- statement when span_functions lacks tenant
EXCHANGE TABLES {db}.span_functions AND {db}.span_functions__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.span_functions__new

-- statement when unattributed_cpu lacks tenant
-- a tenant's service over a range of minutes; source as in span_attribution
CREATE TABLE IF NOT EXISTS {db}.unattributed_cpu__new (
    tenant LowCardinality(String) DEFAULT 'default',
    service LowCardinality(String),
    minute DateTime,
    source UInt64,
    cpu_ns UInt64,
    wall_ns UInt64,
    sample_count UInt64
) ENGINE = ReplacingMergeTree
ORDER BY (tenant, service, minute, source)
{ttl:minute}
SETTINGS {dedup}

-- statement when unattributed_cpu lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.unattributed_cpu__new

-- statement when unattributed_cpu lacks tenant
INSERT INTO {db}.unattributed_cpu__new (tenant, service, minute, source, cpu_ns, wall_ns, sample_count)
SETTINGS insert_deduplicate = 0
SELECT 'default', service, minute, source, cpu_ns, wall_ns, sample_count
FROM {db}.unattributed_cpu

-- statement when unattributed_cpu lacks tenant
EXCHANGE TABLES {db}.unattributed_cpu AND {db}.unattributed_cpu__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.unattributed_cpu__new

-- statement when span_index lacks tenant
-- (tenant, span id) -> trace id, for samples that carry only a span id: a span-only
-- sample is resolved among its own tenant's spans only
CREATE TABLE IF NOT EXISTS {db}.span_index__new (
    tenant LowCardinality(String) DEFAULT 'default',
    span_id String,
    trace_id String,
    time DateTime
) ENGINE = ReplacingMergeTree
ORDER BY (tenant, span_id)
{ttl:time}

-- statement when span_index lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.span_index__new

-- statement when span_index lacks tenant
INSERT INTO {db}.span_index__new (tenant, span_id, trace_id, time)
SETTINGS insert_deduplicate = 0
SELECT 'default', span_id, trace_id, time
FROM {db}.span_index

-- statement when span_index lacks tenant
EXCHANGE TABLES {db}.span_index AND {db}.span_index__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.span_index__new

-- statement when span_stacks lacks tenant
-- per span and stack: the span's flame graph (stacks resolved through its tenant's
-- profile_stacks); keyed like span_attribution
CREATE TABLE IF NOT EXISTS {db}.span_stacks__new (
    tenant LowCardinality(String) DEFAULT 'default',
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
ORDER BY (tenant, trace_id, span_id, method, stack_id, source)
{ttl:updated_at}
SETTINGS {dedup}

-- statement when span_stacks lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.span_stacks__new

-- statement when span_stacks lacks tenant
INSERT INTO {db}.span_stacks__new (tenant, trace_id, span_id, method, stack_id, source, service, operation, minute, span_known, cpu_ns, wall_ns, updated_at)
SETTINGS insert_deduplicate = 0
SELECT 'default', trace_id, span_id, method, stack_id, source, service, operation, minute, span_known, cpu_ns, wall_ns, updated_at
FROM {db}.span_stacks

-- statement when span_stacks lacks tenant
EXCHANGE TABLES {db}.span_stacks AND {db}.span_stacks__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.span_stacks__new

-- statement when op_minute lacks tenant
-- CPU per (tenant, service, operation, minute): sums, and the set of spans seen (calls);
-- ordered for "one operation of one tenant over a time range"
CREATE TABLE IF NOT EXISTS {db}.op_minute__new (
    tenant LowCardinality(String) DEFAULT 'default',
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
ORDER BY (tenant, service, operation, method, minute)
{ttl:minute}
SETTINGS {dedup}

-- statement when op_minute lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.op_minute__new

-- statement when op_minute lacks tenant
INSERT INTO {db}.op_minute__new (tenant, service, operation, method, minute, cpu_ns, inclusive_cpu_ns, wall_ns, sample_count, calls)
SETTINGS insert_deduplicate = 0
SELECT 'default', service, operation, method, minute, cpu_ns, inclusive_cpu_ns, wall_ns, sample_count, calls
FROM {db}.op_minute

-- statement when op_minute lacks tenant
EXCHANGE TABLES {db}.op_minute AND {db}.op_minute__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.op_minute__new

-- statement when op_calls lacks tenant
-- per call of a tenant's operation: one row per span once merged (quantiles of CPU per
-- call over any range)
CREATE TABLE IF NOT EXISTS {db}.op_calls__new (
    tenant LowCardinality(String) DEFAULT 'default',
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
ORDER BY (tenant, service, operation, minute, trace_id, span_id)
{ttl:minute}
SETTINGS {dedup}

-- statement when op_calls lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.op_calls__new

-- statement when op_calls lacks tenant
INSERT INTO {db}.op_calls__new (tenant, service, operation, minute, trace_id, span_id, cpu_ns, inclusive_cpu_ns, duration_ns)
SETTINGS insert_deduplicate = 0
SELECT 'default', service, operation, minute, trace_id, span_id, cpu_ns, inclusive_cpu_ns, duration_ns
FROM {db}.op_calls

-- statement when op_calls lacks tenant
EXCHANGE TABLES {db}.op_calls AND {db}.op_calls__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.op_calls__new

-- statement when fn_minute lacks tenant
-- self CPU per (tenant, service, operation, function, minute): "which functions burn the
-- CPU of this operation", over any range
CREATE TABLE IF NOT EXISTS {db}.fn_minute__new (
    tenant LowCardinality(String) DEFAULT 'default',
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    function String CODEC(ZSTD(1)),
    method LowCardinality(String),
    self_cpu_ns SimpleAggregateFunction(sum, UInt64),
    self_wall_ns SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (tenant, service, operation, minute, function, method)
{ttl:minute}
SETTINGS {dedup}

-- statement when fn_minute lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.fn_minute__new

-- statement when fn_minute lacks tenant
INSERT INTO {db}.fn_minute__new (tenant, service, operation, minute, function, method, self_cpu_ns, self_wall_ns)
SETTINGS insert_deduplicate = 0
SELECT 'default', service, operation, minute, function, method, self_cpu_ns, self_wall_ns
FROM {db}.fn_minute

-- statement when fn_minute lacks tenant
EXCHANGE TABLES {db}.fn_minute AND {db}.fn_minute__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.fn_minute__new

-- statement when op_stacks_minute lacks tenant
-- CPU per (tenant, service, operation, stack, minute): an operation's flame graph
CREATE TABLE IF NOT EXISTS {db}.op_stacks_minute__new (
    tenant LowCardinality(String) DEFAULT 'default',
    service LowCardinality(String),
    operation LowCardinality(String),
    minute DateTime CODEC(Delta, ZSTD(1)),
    stack_id UInt64 CODEC(ZSTD(1)),
    method LowCardinality(String),
    cpu_ns SimpleAggregateFunction(sum, UInt64),
    wall_ns SimpleAggregateFunction(sum, UInt64)
) ENGINE = AggregatingMergeTree
PARTITION BY toDate(minute)
ORDER BY (tenant, service, operation, minute, stack_id, method)
{ttl:minute}
SETTINGS {dedup}

-- statement when op_stacks_minute lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.op_stacks_minute__new

-- statement when op_stacks_minute lacks tenant
INSERT INTO {db}.op_stacks_minute__new (tenant, service, operation, minute, stack_id, method, cpu_ns, wall_ns)
SETTINGS insert_deduplicate = 0
SELECT 'default', service, operation, minute, stack_id, method, cpu_ns, wall_ns
FROM {db}.op_stacks_minute

-- statement when op_stacks_minute lacks tenant
EXCHANGE TABLES {db}.op_stacks_minute AND {db}.op_stacks_minute__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.op_stacks_minute__new

-- statement when quarantine lacks tenant
-- "what was refused for this tenant's table lately" is the question; few rows, one narrow
-- range
CREATE TABLE IF NOT EXISTS {db}.quarantine__new (
    tenant LowCardinality(String) DEFAULT 'default',
    time DateTime64(3) DEFAULT now64(3) CODEC(Delta, ZSTD(1)),
    component LowCardinality(String),                  -- the exporter's id
    table LowCardinality(String),                      -- the table the row was meant for
    reason String CODEC(ZSTD(1)),
    row String CODEC(ZSTD(3))                          -- JSON, every value printable
) ENGINE = MergeTree
PARTITION BY toDate(time)
ORDER BY (tenant, table, time)
{ttl:time}
SETTINGS ttl_only_drop_parts = 1, {dedup}

-- statement when quarantine lacks tenant
-- a copy cut short by a kill starts over
TRUNCATE TABLE IF EXISTS {db}.quarantine__new

-- statement when quarantine lacks tenant
INSERT INTO {db}.quarantine__new (tenant, time, component, table, reason, row)
SETTINGS insert_deduplicate = 0
SELECT 'default', time, component, table, reason, row
FROM {db}.quarantine

-- statement when quarantine lacks tenant
EXCHANGE TABLES {db}.quarantine AND {db}.quarantine__new

-- statement
-- the old rows, copied
DROP TABLE IF EXISTS {db}.quarantine__new

-- statement
-- a span-only row finds its trace among its own tenant's spans only
CREATE OR REPLACE VIEW {db}.span_attribution_rows AS
SELECT a.tenant AS tenant, a.trace_id AS trace_id, a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time, a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns, greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
WHERE a.trace_id != ''
UNION ALL
SELECT a.tenant AS tenant, ix.trace_id AS trace_id, a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time, a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns, greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT tenant, span_id, any(trace_id) AS trace_id FROM {db}.span_index
           WHERE (tenant, span_id) IN (SELECT tenant, span_id FROM {db}.span_attribution
                                       WHERE trace_id = '')
           GROUP BY tenant, span_id) AS ix ON a.tenant = ix.tenant AND a.span_id = ix.span_id
WHERE a.trace_id = ''
SETTINGS join_use_nulls = 0

-- statement
-- per tenant, span and method; queries add up the methods they want
CREATE OR REPLACE VIEW {db}.span_attribution_totals AS
SELECT tenant, trace_id, span_id, method,
       max(service) AS service, max(name) AS name, max(parent_span_id) AS parent_span_id,
       max(start_time) AS start_time, max(duration_ns) AS duration_ns,
       max(span_known) AS span_known,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       toUInt64(greatest(0, toInt64(duration_ns) - toInt64(inclusive_cpu_ns))) AS off_cpu_ns
FROM {db}.span_attribution_rows
GROUP BY tenant, trace_id, span_id, method

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.otel_traces_trace_id_ts_mv
TO {db}.otel_traces_trace_id_ts AS
SELECT tenant, TraceId, min(toDateTime(Timestamp)) AS Start, max(toDateTime(Timestamp)) AS End
FROM {db}.otel_traces WHERE TraceId != '' GROUP BY tenant, TraceId

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.span_index_mv TO {db}.span_index AS
SELECT tenant, SpanId AS span_id, TraceId AS trace_id, toDateTime(Timestamp) AS time
FROM {db}.otel_traces

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_minute_mv TO {db}.op_minute AS
SELECT tenant, service, name AS operation, method, toStartOfMinute(start_time) AS minute,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       uniqExactState(trace_id, span_id) AS calls
FROM {db}.span_attribution WHERE span_known = 1
GROUP BY tenant, service, operation, method, minute

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_mv TO {db}.op_calls AS
SELECT tenant, service, name AS operation, toStartOfMinute(start_time) AS minute, trace_id,
       span_id, sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       max(duration_ns) AS duration_ns
FROM {db}.span_attribution WHERE span_known = 1 AND method IN ('link', 'link+time')
GROUP BY tenant, service, operation, minute, trace_id, span_id

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.fn_minute_mv TO {db}.fn_minute AS
SELECT tenant, service, operation, minute, function, method, sum(self_cpu_ns) AS self_cpu_ns,
       sum(self_wall_ns) AS self_wall_ns
FROM {db}.span_functions WHERE span_known = 1
GROUP BY tenant, service, operation, minute, function, method

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_stacks_minute_mv
TO {db}.op_stacks_minute AS
SELECT tenant, service, operation, minute, stack_id, method, sum(cpu_ns) AS cpu_ns,
       sum(wall_ns) AS wall_ns
FROM {db}.span_stacks WHERE span_known = 1
GROUP BY tenant, service, operation, minute, stack_id, method

-- statement
-- every span is a call of its operation in the minute it started (migration 10)
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_minute_spans_mv TO {db}.op_minute AS
SELECT tenant, ServiceName AS service, SpanName AS operation, 'link' AS method,
       toStartOfMinute(Timestamp) AS minute, toUInt64(0) AS cpu_ns,
       toUInt64(0) AS inclusive_cpu_ns, toUInt64(0) AS wall_ns, toUInt64(0) AS sample_count,
       uniqExactState(TraceId, SpanId) AS calls
FROM {db}.otel_traces
GROUP BY tenant, service, operation, minute

-- statement
-- every span is a row of op_calls with its duration, CPU or not (migration 10)
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_spans_mv TO {db}.op_calls AS
SELECT tenant, ServiceName AS service, SpanName AS operation,
       toStartOfMinute(Timestamp) AS minute, TraceId AS trace_id, SpanId AS span_id,
       toUInt64(0) AS cpu_ns, toUInt64(0) AS inclusive_cpu_ns, max(Duration) AS duration_ns
FROM {db}.otel_traces
GROUP BY tenant, service, operation, minute, trace_id, span_id

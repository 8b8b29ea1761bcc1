"""DDL is data: every table spanprof writes, kept here, versioned, printed by
``spanprof schema print``. Each ordering key and codec says why in a comment.

Ids are lowercase hex strings, as in the OpenTelemetry Collector's ClickHouse exporter, so
spanprof's tables join ``otel_traces`` on ``TraceId``/``SpanId`` without conversion.

Migrations are applied in order on start; each statement is idempotent (``IF NOT EXISTS``)
and the applied version is recorded in ``schema_migrations``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SchemaOptions:
    database: str = "spanprof"
    ttl_seconds: int = 7 * 86400  # 0 keeps data forever
    # a ClickHouse cluster (remote_servers): every table becomes a Replicated* table
    # ``NAME_local`` on each node plus a Distributed table ``NAME`` over them, so inserts
    # and queries keep using the plain names (see ``on_cluster``)
    cluster: str = ""


def _ttl_expr(column: str, seconds: int) -> str:
    return f"toDateTime({column}) + toIntervalSecond({seconds})"


def _ttl(expr: str, o: SchemaOptions) -> str:
    if o.ttl_seconds <= 0:
        return ""
    return f"TTL {_ttl_expr(expr, o.ttl_seconds)}"


def migration_1(o: SchemaOptions) -> list[str]:
    db = o.database
    # dedup window: a retried insert with the same insert_deduplication_token is a no-op
    dedup = "non_replicated_deduplication_window = 10000"
    return [
        # The Collector exporter's traces table, same names and types, so Grafana's ClickHouse
        # data source and existing queries run unchanged on spanprof's data.
        f"""CREATE TABLE IF NOT EXISTS {db}.otel_traces (
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
{_ttl("Timestamp", o)}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1, {dedup}""",
        # trace id -> time range, so "one trace" reads one partition range of otel_traces
        f"""CREATE TABLE IF NOT EXISTS {db}.otel_traces_trace_id_ts (
    TraceId String CODEC(ZSTD(1)),
    Start DateTime CODEC(Delta, ZSTD(1)),
    End DateTime CODEC(Delta, ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = MergeTree
PARTITION BY toDate(Start)
ORDER BY (TraceId, Start)
{_ttl("Start", o)}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.otel_traces_trace_id_ts_mv
TO {db}.otel_traces_trace_id_ts AS
SELECT TraceId, min(toDateTime(Timestamp)) AS Start, max(toDateTime(Timestamp)) AS End
FROM {db}.otel_traces WHERE TraceId != '' GROUP BY TraceId""",
        # Stacks stored once: samples carry only a 64-bit stack id. Replacing: the same stack
        # written by two requests (or two workers) collapses to one row.
        f"""CREATE TABLE IF NOT EXISTS {db}.profile_stacks (
    stack_id UInt64,
    functions Array(String) CODEC(ZSTD(3)),            -- leaf first
    files Array(String) CODEC(ZSTD(3)),
    lines Array(Int64) CODEC(ZSTD(1)),
    leaf String MATERIALIZED functions[1],
    last_seen DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree(last_seen)
ORDER BY stack_id
SETTINGS {dedup}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.profile_samples (
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
{_ttl("time", o)}
SETTINGS ttl_only_drop_parts = 1, {dedup}""",
        # Attribution rows are deltas (processors/correlate/state.py): a span's totals are the
        # sum of its rows. Each row names its source: a hash of the Kafka message it came
        # from, or a random id for in-memory summaries. Replacing on the source makes a
        # redelivered message (after a worker crash) rewrite, not add: queries read FINAL.
        f"""CREATE TABLE IF NOT EXISTS {db}.span_attribution (
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
{_ttl("updated_at", o)}
SETTINGS {dedup}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.span_functions (
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
{_ttl("updated_at", o)}
SETTINGS {dedup}""",
        f"""CREATE TABLE IF NOT EXISTS {db}.unattributed_cpu (
    service LowCardinality(String),
    minute DateTime,
    source UInt64,
    cpu_ns UInt64,
    wall_ns UInt64,
    sample_count UInt64
) ENGINE = ReplacingMergeTree
ORDER BY (service, minute, source)
{_ttl("minute", o)}
SETTINGS {dedup}""",
        # span id -> trace id, for samples that carry only a span id (some Pyroscope SDKs):
        # resolved here, in ClickHouse, whichever worker saw the sample or the span
        f"""CREATE TABLE IF NOT EXISTS {db}.span_index (
    span_id String,
    trace_id String,
    time DateTime
) ENGINE = ReplacingMergeTree
ORDER BY span_id
{_ttl("time", o)}""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.span_index_mv TO {db}.span_index AS
SELECT SpanId AS span_id, TraceId AS trace_id, toDateTime(Timestamp) AS time
FROM {db}.otel_traces""",
        # Rows with the span's trace resolved (span-only rows through span_index), one per
        # (trace, span, method, source) thanks to FINAL.
        f"""CREATE VIEW IF NOT EXISTS {db}.span_attribution_rows AS
SELECT if(a.trace_id = '' AND ix.trace_id != '', ix.trace_id, a.trace_id) AS trace_id,
       a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service,
       a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time,
       a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns,
       a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {db}.span_index GROUP BY span_id)
    AS ix ON a.span_id = ix.span_id
SETTINGS join_use_nulls = 0""",
        # Totals per span, whatever the state of background merges.
        f"""CREATE VIEW IF NOT EXISTS {db}.span_attribution_totals AS
SELECT trace_id, span_id, method,
       max(service) AS service, max(name) AS name, max(parent_span_id) AS parent_span_id,
       max(start_time) AS start_time, max(duration_ns) AS duration_ns,
       max(span_known) AS span_known,
       sum(cpu_ns) AS cpu_ns, sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       toUInt64(greatest(0, toInt64(duration_ns) - toInt64(cpu_ns))) AS off_cpu_ns  -- aliases
FROM {db}.span_attribution_rows
GROUP BY trace_id, span_id, method""",
    ]


def migration_2(o: SchemaOptions) -> list[str]:
    """Where a sample was taken: thread (for child-span and thread attribution), the span
    name Pyroscope SDKs label samples with, and the process (pid, host)."""
    db = o.database
    return [
        f"""ALTER TABLE {db}.profile_samples
    ADD COLUMN IF NOT EXISTS thread_id UInt64 CODEC(T64, ZSTD(1)),  -- 0: not known
    ADD COLUMN IF NOT EXISTS thread_name LowCardinality(String),
    ADD COLUMN IF NOT EXISTS span_name LowCardinality(String),
    ADD COLUMN IF NOT EXISTS pid UInt32 CODEC(T64, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS host LowCardinality(String)""",
    ]


def migration_3(o: SchemaOptions) -> list[str]:
    """Inclusive CPU per span (self plus descendants in the same service, placed by the
    correlator), and off-CPU measured against it: a span's duration covers its children."""
    db = o.database
    return [
        f"""ALTER TABLE {db}.span_attribution
    ADD COLUMN IF NOT EXISTS inclusive_cpu_ns UInt64 CODEC(T64, ZSTD(1))""",
        # rows written before this migration had no children placed: inclusive = self
        f"""CREATE OR REPLACE VIEW {db}.span_attribution_rows AS
SELECT if(a.trace_id = '' AND ix.trace_id != '', ix.trace_id, a.trace_id) AS trace_id,
       a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service,
       a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time,
       a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns,
       greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns,
       a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {db}.span_index GROUP BY span_id)
    AS ix ON a.span_id = ix.span_id
SETTINGS join_use_nulls = 0""",
        # per method; queries add up the methods they want (exact: link + link+time)
        f"""CREATE OR REPLACE VIEW {db}.span_attribution_totals AS
SELECT trace_id, span_id, method,
       max(service) AS service, max(name) AS name, max(parent_span_id) AS parent_span_id,
       max(start_time) AS start_time, max(duration_ns) AS duration_ns,
       max(span_known) AS span_known,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       toUInt64(greatest(0, toInt64(duration_ns) - toInt64(inclusive_cpu_ns))) AS off_cpu_ns
FROM {db}.span_attribution_rows
GROUP BY trace_id, span_id, method""",
    ]


def migration_4(o: SchemaOptions) -> list[str]:
    """Flame graphs per span and the aggregates ClickHouse maintains itself.

    Attribution rows are deltas, so every aggregate is a sum (or a set, for calls) that
    merges the same whatever the order rows arrive in: a late sample's row adds to its
    minute, and each aggregate stays equal to a GROUP BY over the raw rows. The views
    take only rows of known spans (``span_known = 1``): CPU whose span never came has no
    operation. A redelivered Kafka block re-inserts under the same
    ``insert_deduplication_token``; ClickHouse drops it, and drops the views' output in
    their targets once those keep a deduplication window (migration 6).
    """
    db = o.database
    dedup = "non_replicated_deduplication_window = 10000"
    known = "span_known = 1"
    return [
        # where each function's CPU was burnt, so the per-operation views need no join
        f"""ALTER TABLE {db}.span_functions
    ADD COLUMN IF NOT EXISTS service LowCardinality(String),
    ADD COLUMN IF NOT EXISTS operation LowCardinality(String),
    ADD COLUMN IF NOT EXISTS minute DateTime CODEC(Delta, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS span_known UInt8""",
        # per span and stack: the span's flame graph (stacks resolved through
        # profile_stacks); keyed like span_attribution, one trace is one narrow range
        f"""CREATE TABLE IF NOT EXISTS {db}.span_stacks (
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
{_ttl("updated_at", o)}
SETTINGS {dedup}""",
        # CPU per (service, operation, minute): sums, and the set of spans seen (calls), so
        # CPU per call = cpu_ns / calls. Ordered for "one operation over a time range".
        f"""CREATE TABLE IF NOT EXISTS {db}.op_minute (
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
{_ttl("minute", o)}""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_minute_mv TO {db}.op_minute AS
SELECT service, name AS operation, method, toStartOfMinute(start_time) AS minute,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       uniqExactState(trace_id, span_id) AS calls
FROM {db}.span_attribution WHERE {known}
GROUP BY service, operation, method, minute""",
        # per call: one row per span once merged (the sum of its deltas), under its
        # operation and minute: quantiles of CPU per call over any range come from here
        # (a 20 ms span has one or two samples; its operation has thousands). Exact
        # methods only, as the default figures.
        f"""CREATE TABLE IF NOT EXISTS {db}.op_calls (
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
{_ttl("minute", o)}""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_calls_mv TO {db}.op_calls AS
SELECT service, name AS operation, toStartOfMinute(start_time) AS minute, trace_id, span_id,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       max(duration_ns) AS duration_ns
FROM {db}.span_attribution WHERE {known} AND method IN ('link', 'link+time')
GROUP BY service, operation, minute, trace_id, span_id""",
        # self CPU per (service, operation, function, minute): "which functions burn the
        # CPU of this operation", over any range, without touching per-span rows
        f"""CREATE TABLE IF NOT EXISTS {db}.fn_minute (
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
{_ttl("minute", o)}""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.fn_minute_mv TO {db}.fn_minute AS
SELECT service, operation, minute, function, method, sum(self_cpu_ns) AS self_cpu_ns,
       sum(self_wall_ns) AS self_wall_ns
FROM {db}.span_functions WHERE {known}
GROUP BY service, operation, minute, function, method""",
        # CPU per (service, operation, stack, minute): an operation's flame graph
        f"""CREATE TABLE IF NOT EXISTS {db}.op_stacks_minute (
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
{_ttl("minute", o)}""",
        f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_stacks_minute_mv
TO {db}.op_stacks_minute AS
SELECT service, operation, minute, stack_id, method, sum(cpu_ns) AS cpu_ns,
       sum(wall_ns) AS wall_ns
FROM {db}.span_stacks WHERE {known}
GROUP BY service, operation, minute, stack_id, method""",
    ]


def migration_5(o: SchemaOptions) -> list[str]:
    """One trace reads one narrow range again: the rows view is two branches, rows that
    have their trace (the filter ``trace_id = X`` reaches span_attribution's primary key)
    and span-only rows (few: the correlator resolves most in memory), resolved through
    span_index for their own span ids only, not the whole index."""
    db = o.database
    cols = ("a.span_id AS span_id, a.method AS method, a.source AS source, "
            "a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, "
            "a.start_time AS start_time, a.duration_ns AS duration_ns, "
            "a.span_known AS span_known, a.cpu_ns AS cpu_ns, "
            "greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, "
            "a.wall_ns AS wall_ns, a.sample_count AS sample_count")
    return [
        f"""CREATE OR REPLACE VIEW {db}.span_attribution_rows AS
SELECT a.trace_id AS trace_id, {cols}
FROM {db}.span_attribution AS a FINAL
WHERE a.trace_id != ''
UNION ALL
SELECT ix.trace_id AS trace_id, {cols}
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {db}.span_index
           WHERE span_id IN (SELECT span_id FROM {db}.span_attribution WHERE trace_id = '')
           GROUP BY span_id) AS ix ON a.span_id = ix.span_id
WHERE a.trace_id = ''
SETTINGS join_use_nulls = 0""",
    ]


def migration_6(o: SchemaOptions) -> list[str]:
    """A Kafka block delivered twice reaches the aggregates once. ClickHouse deduplicates a
    materialized view's output in its *target* table (under a token derived from the
    source block's), and only when that table keeps a deduplication window: plain
    MergeTree tables keep none by default, so the aggregates get one. (Observed on 26.9:
    a block dropped as a duplicate by ``span_attribution`` still fed ``op_minute`` until
    ``op_minute`` had a window; tests/pipeline/exporters/test_aggregates.py.)"""
    db = o.database
    return [f"ALTER TABLE {db}.{t} MODIFY SETTING non_replicated_deduplication_window = 10000"
            for t in ("op_minute", "op_calls", "fn_minute", "op_stacks_minute")]


# profile_stacks outlives the samples by this much (clock skew, the writer's refresh)
STACK_TTL_MARGIN_S = 86_400


def _stack_ttl_seconds(o: SchemaOptions) -> int:
    return o.ttl_seconds + STACK_TTL_MARGIN_S if o.ttl_seconds > 0 else 0


def migration_7(o: SchemaOptions) -> list[str]:
    """Stacks expire too: one not seen for ``ttl`` plus a day goes. Each writer writes a
    stack it keeps seeing again every few hours (``writer.STACK_REFRESH_S``), renewing its
    ``last_seen`` (``ReplacingMergeTree(last_seen)`` keeps the newest row), so a stack
    outlives every sample that references it: a sample expires ``ttl`` after its time,
    and its stack was written at most the refresh before. Without this, profilers that
    mint new stacks all day (JIT addresses, generated code) grew the table for ever."""
    if o.ttl_seconds <= 0:
        return []
    return [f"ALTER TABLE {o.database}.profile_stacks MODIFY TTL last_seen + "
            f"toIntervalSecond({_stack_ttl_seconds(o)})"]


def migration_8(o: SchemaOptions) -> list[str]:
    """Rows ClickHouse refused for their values (a number beyond its column, a time beyond
    ``DateTime``'s 2106): the writer splits them out of their block and keeps them here,
    with the reason, instead of retrying the block for ever (writer.py). ``row`` is the
    row as JSON; read them with ``SELECT * FROM quarantine ORDER BY time DESC``."""
    db = o.database
    return [f"""CREATE TABLE IF NOT EXISTS {db}.quarantine (
    time DateTime64(3) DEFAULT now64(3) CODEC(Delta, ZSTD(1)),
    component LowCardinality(String),                  -- the exporter's id
    table LowCardinality(String),                      -- the table the row was meant for
    reason String CODEC(ZSTD(1)),
    row String CODEC(ZSTD(3))                          -- JSON, every value printable
) ENGINE = MergeTree
PARTITION BY toDate(time)
-- "what was refused for this table lately" is the question; few rows, one narrow range
ORDER BY (table, time)
{_ttl("time", o)}
SETTINGS ttl_only_drop_parts = 1, non_replicated_deduplication_window = 10000"""]


def migration_9(o: SchemaOptions) -> list[str]:
    """What the correlator needs to recover after a crash (processors/correlate/recovery.py).

    ``ingested_at`` says when a raw row was stored, so that a restarted correlator finds
    the traces it may have been holding in memory: those with a row stored since its last
    checkpoint's ``held_since`` (the arrival of the oldest input it still held unreported).
    A column with a DEFAULT leaves the Collector's queries on ``otel_traces`` unchanged, and
    the writer names its columns, so the default fills it. ``timed`` says a sample carried its
    own instant (``Sample.timed``), which decides how a replay places it (``link+time``).
    ``request`` is the id of the client request a row came in (a hash of it, 0 when not
    known): a restarted receiver reads the ids of the last minutes and answers a resend of
    a request it had stored, but not acknowledged, without storing it twice
    (``pipeline/receivers/idempotency.py``). The minmax index on ``ingested_at`` lets both
    read only recent granules.
    ``correlator_checkpoint`` keeps
    the newest checkpoint per correlator id (``ReplacingMergeTree(updated)``)."""
    db = o.database
    return [
        f"""ALTER TABLE {db}.profile_samples
    ADD COLUMN IF NOT EXISTS ingested_at DateTime DEFAULT now() CODEC(Delta, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS timed UInt8 DEFAULT 0,  -- time is the sample's own instant
    ADD COLUMN IF NOT EXISTS request UInt64 DEFAULT 0 CODEC(ZSTD(1)),  -- client request id
    ADD INDEX IF NOT EXISTS ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1""",
        f"""ALTER TABLE {db}.otel_traces
    ADD COLUMN IF NOT EXISTS ingested_at DateTime DEFAULT now() CODEC(Delta, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS request UInt64 DEFAULT 0 CODEC(ZSTD(1)),
    ADD INDEX IF NOT EXISTS ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1""",
        f"""CREATE TABLE IF NOT EXISTS {db}.correlator_checkpoint (
    component String,                                  -- the connector's id
    held_since DateTime,                               -- oldest input held unreported
    alive_at DateTime,                                 -- when this checkpoint was taken
    updated DateTime64(3)
) ENGINE = ReplacingMergeTree(updated)
-- the newest checkpoint per correlator: argMax(held_since, updated) (also across shards)
ORDER BY component""",
    ]


MIGRATIONS = [migration_1, migration_2, migration_3, migration_4, migration_5, migration_6,
              migration_7, migration_8, migration_9]


_TTL_OF = re.compile(r"CREATE TABLE IF NOT EXISTS \w+\.(\w+) \(.*?TTL toDateTime\((\w+)\)",
                     re.S)
_INTERVAL = re.compile(r"\bTTL\b.*?toIntervalSecond\((\d+)\)", re.S)


def ttl_plan(o: SchemaOptions) -> dict[str, tuple[str, int]]:
    """Per table: the column its TTL counts from and the seconds it should keep rows for
    (0: for ever), as the migrations would create it with these options today."""
    probe = SchemaOptions(database=o.database, ttl_seconds=1)  # every TTL written out
    plan = {table: (column, o.ttl_seconds)
            for migration in MIGRATIONS for sql in migration(probe)
            for table, column in _TTL_OF.findall(sql)}
    plan["profile_stacks"] = ("last_seen", _stack_ttl_seconds(o))  # migration 7
    return plan


def ttl_changes(o: SchemaOptions, current: dict[str, str]) -> list[str]:
    """The ALTERs that bring each table's TTL to what ``ttl`` says now, given each table's
    ``create_table_query`` (a ``ttl:`` changed after the tables were made takes effect
    without a manual ALTER; ClickHouse then applies it to the rows already there)."""
    out = []
    for table, (column, seconds) in sorted(ttl_plan(o).items()):
        name = f"{table}_local" if o.cluster else table
        ddl = current.get(name)
        if ddl is None:
            continue
        m = _INTERVAL.search(ddl)
        have = int(m[1]) if m else 0
        if have == seconds:
            continue
        where = f"{o.database}.{name}" + (f" ON CLUSTER {o.cluster}" if o.cluster else "")
        out.append(f"ALTER TABLE {where} REMOVE TTL" if seconds == 0 else
                   f"ALTER TABLE {where} MODIFY TTL {_ttl_expr(column, seconds)}")
    return out


def bootstrap(o: SchemaOptions) -> list[str]:
    """The database and the record of applied migrations, created before anything else."""
    return [
        f"CREATE DATABASE IF NOT EXISTS {o.database}",
        f"""CREATE TABLE IF NOT EXISTS {o.database}.schema_migrations (
    version UInt32,
    applied_at DateTime DEFAULT now()
) ENGINE = MergeTree ORDER BY version""",
    ]


def statements(o: SchemaOptions) -> list[tuple[int, list[str]]]:
    if o.cluster:
        return [(i + 1, on_cluster(m(o), o)) for i, m in enumerate(MIGRATIONS)]
    return [(i + 1, m(o)) for i, m in enumerate(MIGRATIONS)]


_CREATE_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+)\.(\w+) \(")
_ENGINE = re.compile(r"ENGINE = (\w*)MergeTree(\(([^)]*)\))?")
_CREATE_VIEW = re.compile(r"^CREATE (OR REPLACE VIEW|VIEW IF NOT EXISTS) (\w+)\.(\w+) AS")
_CREATE_MV = re.compile(r"^CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+)\.(\w+)\s+TO (\w+)\.(\w+)")
_ALTER = re.compile(r"^ALTER TABLE (\w+)\.(\w+)")


def _shard_key(ddl: str) -> str:
    """Rows of one trace on one shard (one-trace queries read one shard); others spread."""
    if re.search(r"^\s+TraceId String", ddl, re.M):
        return "cityHash64(TraceId)"
    if re.search(r"^\s+trace_id String", ddl, re.M):
        return "cityHash64(trace_id)"
    return "rand()"


def on_cluster(stmts: list[str], o: SchemaOptions) -> list[str]:
    """The same schema for a cluster: ``ON CLUSTER``, ``Replicated*MergeTree`` local tables
    (``NAME_local``, replicated through Keeper under /clickhouse/tables/{shard}/...), and a
    ``Distributed`` table under each plain name. Materialized views hang off the local
    tables (each node aggregates what it stores; queries re-aggregate across shards, which
    sums and uniqExact states allow); views read the Distributed tables, with GLOBAL joins.
    Inserts must be synchronous (``insert_distributed_sync``) for deduplication tokens to
    reach the shards: the exporter sets it when ``cluster`` is configured."""
    c = o.cluster
    out: list[str] = []
    for stmt in stmts:
        s = stmt.strip()
        if m := _CREATE_TABLE.match(s):
            db, name = m.groups()
            local = f"{name}_local"

            def engine(e: re.Match[str], db: str = db, local: str = local) -> str:
                args = e.group(3)
                path = f"'/clickhouse/tables/{{shard}}/{db}/{local}', '{{replica}}'"
                return f"ENGINE = Replicated{e.group(1)}MergeTree({path}" + \
                    (f", {args})" if args else ")")
            body = _ENGINE.sub(engine, s[m.end():], count=1).replace(
                "non_replicated_deduplication_window", "replicated_deduplication_window")
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{local} ON CLUSTER {c} (" + body)
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{name} ON CLUSTER {c} AS {db}.{local}\n"
                       f"ENGINE = Distributed({c}, {db}, {local}, {_shard_key(s)})")
        elif m := _CREATE_MV.match(s):
            db, name, tdb, target = m.groups()
            rest = re.sub(rf"\bFROM {db}\.(\w+)", rf"FROM {db}.\1_local", s[m.end():])
            out.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{name} ON CLUSTER {c}\n"
                       f"TO {tdb}.{target}_local{rest}")
        elif m := _CREATE_VIEW.match(s):
            kind, db, name = m.groups()
            body = s[m.end():].replace("LEFT JOIN (", "GLOBAL LEFT JOIN (")
            out.append(f"CREATE {kind} {db}.{name} ON CLUSTER {c} AS{body}")
        elif m := _ALTER.match(s):
            db, name = m.groups()
            rest = s[m.end():]
            # a MergeTree setting or TTL: the local tables only (a Distributed table has
            # neither, and refuses the ALTER)
            if "MODIFY SETTING" in rest or "MODIFY TTL" in rest:
                out.append(f"ALTER TABLE {db}.{name}_local ON CLUSTER {c}" + rest.replace(
                    "non_replicated_deduplication_window", "replicated_deduplication_window"))
                continue
            out.append(f"ALTER TABLE {db}.{name}_local ON CLUSTER {c}{rest}")
            out.append(f"ALTER TABLE {db}.{name} ON CLUSTER {c}{rest}")
        elif s.startswith("CREATE DATABASE IF NOT EXISTS "):
            out.append(f"{s} ON CLUSTER {c}")
        else:
            raise ValueError(f"on_cluster: no rule for statement: {s[:80]}")
    return out


def render(o: SchemaOptions) -> str:
    boot = on_cluster(bootstrap(o), o) if o.cluster else bootstrap(o)
    out = ["-- bootstrap"] + [s.strip() + ";\n" for s in boot]
    for version, stmts in statements(o):
        out.append(f"-- migration {version}")
        out.extend(s.strip() + ";\n" for s in stmts)
    return "\n".join(out)

-- Migration 14: lock wait and allocated bytes per span (issue #21), attributed like CPU.
--
-- Samples of measure `lock` (nanoseconds waited for a lock: Go's mutex and block delay,
-- JFR monitor-enter and park events, OTLP contention types) and `alloc` (bytes: Go's
-- alloc_space, JFR allocation events) are joined to spans by the correlator as CPU is
-- (label, then child / thread / window placement, each row under its method). A span's
-- rows carry them in all and per leaf function; the per-call aggregates of migration 13
-- carry them by duration bucket, so that `why` can say what the tail waits on and
-- allocates. Rows written before this migration have 0.

-- statement
ALTER TABLE {db}.span_attribution
    ADD COLUMN IF NOT EXISTS lock_ns UInt64 CODEC(T64, ZSTD(1))

-- statement
ALTER TABLE {db}.span_attribution
    ADD COLUMN IF NOT EXISTS alloc_bytes UInt64 CODEC(T64, ZSTD(1))

-- statement
ALTER TABLE {db}.span_functions
    ADD COLUMN IF NOT EXISTS self_lock_ns UInt64 CODEC(T64, ZSTD(1))

-- statement
ALTER TABLE {db}.span_functions
    ADD COLUMN IF NOT EXISTS self_alloc_bytes UInt64 CODEC(T64, ZSTD(1))

-- statement
CREATE OR REPLACE VIEW {db}.span_attribution_rows AS
SELECT a.tenant AS tenant, a.trace_id AS trace_id, a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time, a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns, greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, a.wall_ns AS wall_ns, a.sample_count AS sample_count, a.lock_ns AS lock_ns, a.alloc_bytes AS alloc_bytes
FROM {db}.span_attribution AS a FINAL
WHERE a.trace_id != ''
UNION ALL
SELECT a.tenant AS tenant, ix.trace_id AS trace_id, a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time, a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns, greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, a.wall_ns AS wall_ns, a.sample_count AS sample_count, a.lock_ns AS lock_ns, a.alloc_bytes AS alloc_bytes
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT tenant, span_id, any(trace_id) AS trace_id FROM {db}.span_index
           WHERE (tenant, span_id) IN (SELECT tenant, span_id FROM {db}.span_attribution
                                       WHERE trace_id = '')
           GROUP BY tenant, span_id) AS ix ON a.tenant = ix.tenant AND a.span_id = ix.span_id
WHERE a.trace_id = ''
SETTINGS join_use_nulls = 0

-- statement
CREATE OR REPLACE VIEW {db}.span_attribution_totals AS
SELECT tenant, trace_id, span_id, method,
       max(service) AS service, max(name) AS name, max(parent_span_id) AS parent_span_id,
       max(start_time) AS start_time, max(duration_ns) AS duration_ns,
       max(span_known) AS span_known,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       sum(lock_ns) AS lock_ns, sum(alloc_bytes) AS alloc_bytes,
       toUInt64(greatest(0, toInt64(duration_ns) - toInt64(inclusive_cpu_ns))) AS off_cpu_ns
FROM {db}.span_attribution_rows
GROUP BY tenant, trace_id, span_id, method

-- statement
ALTER TABLE {db}.op_tail_spans
    ADD COLUMN IF NOT EXISTS lock_ns SimpleAggregateFunction(sum, UInt64)

-- statement
ALTER TABLE {db}.op_tail_spans
    ADD COLUMN IF NOT EXISTS alloc_bytes SimpleAggregateFunction(sum, UInt64)

-- statement
ALTER TABLE {db}.op_tail_functions
    ADD COLUMN IF NOT EXISTS self_lock_ns SimpleAggregateFunction(sum, UInt64)

-- statement
ALTER TABLE {db}.op_tail_functions
    ADD COLUMN IF NOT EXISTS self_alloc_bytes SimpleAggregateFunction(sum, UInt64)

-- statement
ALTER TABLE {db}.op_tail_functions
    ADD COLUMN IF NOT EXISTS self_lock_sq SimpleAggregateFunction(sum, Float64)

-- statement
ALTER TABLE {db}.op_tail_functions
    ADD COLUMN IF NOT EXISTS self_alloc_sq SimpleAggregateFunction(sum, Float64)

-- statement
-- the views again, with the new columns (the tables are only read while they are away:
-- migrations run before the pipeline writes)
DROP VIEW IF EXISTS {db}.op_tail_spans_mv

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_tail_spans_mv TO {db}.op_tail_spans AS
SELECT tenant, service, name AS operation, toStartOfMinute(start_time) AS minute,
       toUInt16(if(duration_ns = 0, 0, floor(8 * log2(duration_ns)))) AS bucket, method,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       sum(lock_ns) AS lock_ns, sum(alloc_bytes) AS alloc_bytes
FROM {db}.span_attribution WHERE span_known = 1
GROUP BY tenant, service, operation, minute, bucket, method

-- statement
DROP VIEW IF EXISTS {db}.op_tail_functions_mv

-- statement
CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.op_tail_functions_mv TO {db}.op_tail_functions AS
SELECT tenant, service, operation, minute, bucket, function, method,
       sum(c) AS self_cpu_ns, sum(w) AS self_wall_ns, sum(cf * cf) AS self_cpu_sq,
       sum(wf * wf) AS self_wall_sq, count() AS rows,
       sum(l) AS self_lock_ns, sum(a) AS self_alloc_bytes, sum(lf * lf) AS self_lock_sq,
       sum(af * af) AS self_alloc_sq
FROM (SELECT tenant, service, operation, minute,
             toUInt16(if(duration_ns = 0, 0, floor(8 * log2(duration_ns)))) AS bucket,
             function, method, self_cpu_ns AS c, self_wall_ns AS w,
             toFloat64(self_cpu_ns) AS cf, toFloat64(self_wall_ns) AS wf,
             self_lock_ns AS l, self_alloc_bytes AS a,
             toFloat64(self_lock_ns) AS lf, toFloat64(self_alloc_bytes) AS af
      FROM {db}.span_functions WHERE span_known = 1)
GROUP BY tenant, service, operation, minute, bucket, function, method

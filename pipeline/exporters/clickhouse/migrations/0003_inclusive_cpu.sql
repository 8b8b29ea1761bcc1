-- Migration 3: inclusive CPU per span (self plus descendants in the same service, placed
-- by the correlator), and off-CPU measured against it: a span's duration covers its
-- children.

-- statement
ALTER TABLE {db}.span_attribution
    ADD COLUMN IF NOT EXISTS inclusive_cpu_ns UInt64 CODEC(T64, ZSTD(1))

-- statement
-- rows written before this migration had no children placed: inclusive = self
CREATE OR REPLACE VIEW {db}.span_attribution_rows AS
SELECT if(a.trace_id = '' AND ix.trace_id != '', ix.trace_id, a.trace_id) AS trace_id,
       a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service,
       a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time,
       a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns,
       greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns,
       a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {db}.span_index GROUP BY span_id)
    AS ix ON a.span_id = ix.span_id
SETTINGS join_use_nulls = 0

-- statement
-- per method; queries add up the methods they want (exact: link + link+time)
CREATE OR REPLACE VIEW {db}.span_attribution_totals AS
SELECT trace_id, span_id, method,
       max(service) AS service, max(name) AS name, max(parent_span_id) AS parent_span_id,
       max(start_time) AS start_time, max(duration_ns) AS duration_ns,
       max(span_known) AS span_known,
       sum(cpu_ns) AS cpu_ns, sum(inclusive_cpu_ns) AS inclusive_cpu_ns,
       sum(wall_ns) AS wall_ns, sum(sample_count) AS sample_count,
       toUInt64(greatest(0, toInt64(duration_ns) - toInt64(inclusive_cpu_ns))) AS off_cpu_ns
FROM {db}.span_attribution_rows
GROUP BY trace_id, span_id, method

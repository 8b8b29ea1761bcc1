-- Migration 5: one trace reads one narrow range again: the rows view is two branches, rows
-- that have their trace (the filter trace_id = X reaches span_attribution's primary key)
-- and span-only rows (few: the correlator resolves most in memory), resolved through
-- span_index for their own span ids only, not the whole index.

-- statement
-- both branches select the same columns, on one line each
CREATE OR REPLACE VIEW {db}.span_attribution_rows AS
SELECT a.trace_id AS trace_id, a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time, a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns, greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
WHERE a.trace_id != ''
UNION ALL
SELECT ix.trace_id AS trace_id, a.span_id AS span_id, a.method AS method, a.source AS source, a.service AS service, a.name AS name, a.parent_span_id AS parent_span_id, a.start_time AS start_time, a.duration_ns AS duration_ns, a.span_known AS span_known, a.cpu_ns AS cpu_ns, greatest(a.inclusive_cpu_ns, a.cpu_ns) AS inclusive_cpu_ns, a.wall_ns AS wall_ns, a.sample_count AS sample_count
FROM {db}.span_attribution AS a FINAL
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {db}.span_index
           WHERE span_id IN (SELECT span_id FROM {db}.span_attribution WHERE trace_id = '')
           GROUP BY span_id) AS ix ON a.span_id = ix.span_id
WHERE a.trace_id = ''
SETTINGS join_use_nulls = 0

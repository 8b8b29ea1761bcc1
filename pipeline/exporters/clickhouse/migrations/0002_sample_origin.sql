-- Migration 2: where a sample was taken: thread (for child-span and thread attribution),
-- the span name Pyroscope SDKs label samples with, and the process (pid, host).

-- statement
ALTER TABLE {db}.profile_samples
    ADD COLUMN IF NOT EXISTS thread_id UInt64 CODEC(T64, ZSTD(1)),  -- 0: not known
    ADD COLUMN IF NOT EXISTS thread_name LowCardinality(String),
    ADD COLUMN IF NOT EXISTS span_name LowCardinality(String),
    ADD COLUMN IF NOT EXISTS pid UInt32 CODEC(T64, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS host LowCardinality(String)

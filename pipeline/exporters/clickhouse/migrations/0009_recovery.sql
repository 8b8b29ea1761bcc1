-- Migration 9: what the correlator needs to recover after a crash
-- (processors/correlate/recovery.py).
--
-- ingested_at says when a raw row was stored, so that a restarted correlator finds the
-- traces it may have been holding in memory: those with a row stored since its last
-- checkpoint's held_since (the arrival of the oldest input it still held unreported).
-- A column with a DEFAULT leaves the Collector's queries on otel_traces unchanged, and
-- the writer names its columns, so the default fills it. `timed` says a sample carried
-- its own instant (Sample.timed), which decides how a replay places it (link+time).
-- `request` is the id of the client request a row came in (a hash of it, 0 when not
-- known): a restarted receiver reads the ids of the last minutes and answers a resend of
-- a request it had stored, but not acknowledged, without storing it twice
-- (pipeline/receivers/idempotency.py). The minmax index on ingested_at lets both read
-- only recent granules. correlator_checkpoint keeps the newest checkpoint per correlator
-- id (ReplacingMergeTree(updated)).

-- statement
ALTER TABLE {db}.profile_samples
    ADD COLUMN IF NOT EXISTS ingested_at DateTime DEFAULT now() CODEC(Delta, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS timed UInt8 DEFAULT 0,  -- time is the sample's own instant
    ADD COLUMN IF NOT EXISTS request UInt64 DEFAULT 0 CODEC(ZSTD(1)),  -- client request id
    ADD INDEX IF NOT EXISTS ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1

-- statement
ALTER TABLE {db}.otel_traces
    ADD COLUMN IF NOT EXISTS ingested_at DateTime DEFAULT now() CODEC(Delta, ZSTD(1)),
    ADD COLUMN IF NOT EXISTS request UInt64 DEFAULT 0 CODEC(ZSTD(1)),
    ADD INDEX IF NOT EXISTS ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1

-- statement
CREATE TABLE IF NOT EXISTS {db}.correlator_checkpoint (
    component String,                                  -- the connector's id
    held_since DateTime,                               -- oldest input held unreported
    alive_at DateTime,                                 -- when this checkpoint was taken
    updated DateTime64(3)
) ENGINE = ReplacingMergeTree(updated)
-- the newest checkpoint per correlator: argMax(held_since, updated) (also across shards)
ORDER BY component

-- Migration 12: the backfill ledger (pipeline/backfill/ledger.py, issue #15).
--
-- One row per unit of a backfill job and state change: a job is planned as units, each
-- is written `planned`, then `running`, then `done` or `failed` with its figures (the CPU
-- it read, attributed and left unattributed, the rows it wrote), so that a job killed at
-- any point and started again skips what is done and redoes the rest. The newest row of a
-- unit wins (ReplacingMergeTree(updated), read FINAL or with argMax).

-- statement
CREATE TABLE IF NOT EXISTS {db}.backfill_ledger (
    job String,                                        -- the job's id (its arguments' hash)
    unit String,                                       -- the unit's id within the job
    phase UInt8,                                       -- 1 load, 2 attribute, 3 aggregates
    tenant LowCardinality(String),
    spec String,                                       -- the unit, as JSON
    state LowCardinality(String),                      -- planned | running | done | failed
    cpu_in UInt64,
    cpu_attributed UInt64,
    cpu_unattributed UInt64,
    rows_read UInt64,
    rows_written UInt64,
    lo_ns Int64,                                       -- span starts it touched, for phase 3
    hi_ns Int64,
    message String,                                    -- why it failed, with the figures
    updated DateTime64(6)
) ENGINE = ReplacingMergeTree(updated)
ORDER BY (job, unit)

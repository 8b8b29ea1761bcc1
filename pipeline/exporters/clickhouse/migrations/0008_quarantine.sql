-- Migration 8: rows ClickHouse refused for their values (a number beyond its column, a
-- time beyond DateTime's 2106): the writer splits them out of their block and keeps them
-- here, with the reason, instead of retrying the block for ever (writer.py). `row` is the
-- row as JSON; read them with SELECT * FROM quarantine ORDER BY time DESC.

-- statement
CREATE TABLE IF NOT EXISTS {db}.quarantine (
    time DateTime64(3) DEFAULT now64(3) CODEC(Delta, ZSTD(1)),
    component LowCardinality(String),                  -- the exporter's id
    table LowCardinality(String),                      -- the table the row was meant for
    reason String CODEC(ZSTD(1)),
    row String CODEC(ZSTD(3))                          -- JSON, every value printable
) ENGINE = MergeTree
PARTITION BY toDate(time)
-- "what was refused for this table lately" is the question; few rows, one narrow range
ORDER BY (table, time)
{ttl:time}
SETTINGS ttl_only_drop_parts = 1, {dedup}

-- Migration 6: a Kafka block delivered twice reaches the aggregates once. ClickHouse
-- deduplicates a materialized view's output in its *target* table (under a token derived
-- from the source block's), and only when that table keeps a deduplication window: plain
-- MergeTree tables keep none by default, so the aggregates get one. (Observed on 26.9:
-- a block dropped as a duplicate by span_attribution still fed op_minute until
-- op_minute had a window; tests/pipeline/exporters/test_aggregates.py.)

-- statement
ALTER TABLE {db}.op_minute MODIFY SETTING {dedup}

-- statement
ALTER TABLE {db}.op_calls MODIFY SETTING {dedup}

-- statement
ALTER TABLE {db}.fn_minute MODIFY SETTING {dedup}

-- statement
ALTER TABLE {db}.op_stacks_minute MODIFY SETTING {dedup}

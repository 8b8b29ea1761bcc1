-- Migration 7: stacks expire too: one not seen for `ttl` plus a day goes. Each writer
-- writes a stack it keeps seeing again every few hours (writer.STACK_REFRESH_S), renewing
-- its last_seen (ReplacingMergeTree(last_seen) keeps the newest row), so a stack outlives
-- every sample that references it: a sample expires `ttl` after its time, and its stack
-- was written at most the refresh before. Without this, profilers that mint new stacks
-- all day (JIT addresses, generated code) grew the table for ever.
--
-- "when ttl": with ttl 0 (keep for ever) this migration has no statement.

-- statement when ttl
-- {stack_ttl_seconds}: ttl plus schema.STACK_TTL_MARGIN_S
ALTER TABLE {db}.profile_stacks MODIFY TTL last_seen + toIntervalSecond({stack_ttl_seconds})

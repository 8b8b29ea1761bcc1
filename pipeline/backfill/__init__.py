"""Batch backfill (issue #15): telemetry read from files and stores rather than received."""

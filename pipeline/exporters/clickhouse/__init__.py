"""ClickHouse exporter: schema, row encoding, batched writer, queries."""

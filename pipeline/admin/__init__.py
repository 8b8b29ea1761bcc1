"""The running pipeline's read-only HTTP API: health, metrics and queries."""

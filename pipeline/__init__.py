"""spanprof runtime: config, component graph, receivers, exporters, admin API and CLI."""

__version__ = "0.1.0"

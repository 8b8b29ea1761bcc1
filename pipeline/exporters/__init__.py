"""Exporters: where batches become durable."""

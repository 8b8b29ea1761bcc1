"""The document's own shape: the ``service:`` section, the raw top level, and ``Config``.

Component sections are plain mappings here; each is decoded with the ``Config`` of its
component's factory when the file is loaded (``pipeline.config.load``), and ``Config``
holds the result.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from pipeline.config.ranges import Duration, PositiveInt, check_endpoint
from pipeline.config.tls import ReceiverAuth, TlsConfig
from pipeline.tenants import TenantsConfig


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True):
    receivers: list[str]
    exporters: list[str]
    processors: list[str] = []


class LogsConfig(msgspec.Struct, forbid_unknown_fields=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    encoding: Literal["console", "json"] = "console"


class TelemetryConfig(msgspec.Struct, forbid_unknown_fields=True):
    logs: LogsConfig = msgspec.field(default_factory=LogsConfig)


class AdminConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The read-only HTTP API (health, metrics, queries) of a running pipeline."""

    enabled: bool = True
    endpoint: str = "127.0.0.1:13133"
    # which clickhouse exporter answers queries; default: the first one configured
    query_exporter: str = ""
    # the listener's guards against slow and greedy clients (pipeline/receivers/http.py);
    # plain float defaults: the config's JSON Schema cannot encode a Duration default
    read_header_timeout: Duration = 10.0  # type: ignore[assignment]
    read_timeout: Duration = 30.0  # type: ignore[assignment]
    idle_timeout: Duration = 60.0  # type: ignore[assignment]
    max_connections: PositiveInt = 1000
    tls: TlsConfig | None = None  # pipeline/tls.py
    auth: ReceiverAuth | None = None  # pipeline/auth.py; /health stays open (probes)

    def validate(self) -> None:
        if self.enabled:
            check_endpoint(self.endpoint)
            if self.tls is not None:
                self.tls.validate("tls")


class ServiceConfig(msgspec.Struct, forbid_unknown_fields=True):
    pipelines: dict[str, PipelineConfig]
    # the extensions to start (defined under extensions:), as in the Collector
    extensions: list[str] = []
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    # where relative paths (e.g. chdb://./data) are resolved; default: the current directory
    data_dir: str = "."
    # per-tenant limits (pipeline/tenants.py)
    tenants: TenantsConfig = msgspec.field(default_factory=TenantsConfig)


class RawConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A spanprof pipeline: the OpenTelemetry Collector's shape (component sections are
    checked by ``spanprof validate``, whose types are each component's Config)."""

    service: ServiceConfig
    receivers: dict[str, dict[str, Any] | None] = {}
    processors: dict[str, dict[str, Any] | None] = {}
    exporters: dict[str, dict[str, Any] | None] = {}
    connectors: dict[str, dict[str, Any] | None] = {}
    extensions: dict[str, dict[str, Any] | None] = {}


class Config(msgspec.Struct):
    """A validated configuration: component configs already decoded to their types."""

    service: ServiceConfig
    receivers: dict[str, Any]
    processors: dict[str, Any]
    exporters: dict[str, Any]
    connectors: dict[str, Any]
    extensions: dict[str, Any] = {}


def component_type(component_id: str) -> str:
    """``otlp/internal`` -> ``otlp``: a component id is a type, optionally ``/`` a name."""
    return component_id.split("/", 1)[0]


def signal_of(pipeline_id: str) -> str:
    """``traces/raw`` -> ``traces``: a pipeline id is a signal, optionally ``/`` a name."""
    return pipeline_id.split("/", 1)[0]

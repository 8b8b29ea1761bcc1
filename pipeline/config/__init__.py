"""YAML -> typed configuration.

The file has the OpenTelemetry Collector's shape (``receivers:``, ``processors:``,
``exporters:``, ``connectors:``, ``service: pipelines:``); component ids are ``type`` or
``type/name``. Every component section is decoded with its factory's msgspec ``Config``
(unknown keys are errors), and *all* problems are reported together, each prefixed with the
key path the user wrote, e.g. ``exporters.clickhouse.endpoint: ...``, so one run of
``spanprof validate`` lists every missing section, unknown key, value out of range and
pipeline naming an undefined component.

The loader does not know which components exist: its caller passes the factories
(``load_file(path, default_factories())``), so that the components, which use the types
below, and the config, which decodes with the components' types, do not import each other.

- ``ranges``: field types with their ranges (``Duration``, ``PositiveInt``, ...), msgspec hooks
- ``source``: reading the file, YAML, ``${env:NAME:-default}``, remembering secrets
- ``decode``: key-by-key decoding that collects every problem with its key path
- ``model``: the ``service:`` section, the raw document and the validated ``Config``
- ``load``: ``load_file`` / ``load_text``: sections by their factories, pipelines checked
"""

from pipeline.config.decode import decode_struct
from pipeline.config.load import load_file, load_text
from pipeline.config.model import (
    AdminConfig,
    Config,
    LogsConfig,
    PipelineConfig,
    RawConfig,
    ServiceConfig,
    TelemetryConfig,
    component_type,
    signal_of,
)
from pipeline.config.ranges import (
    MAX_SECONDS,
    Duration,
    MessageSizeMiB,
    NonNegDuration,
    NonNegInt,
    Percentage,
    PositiveInt,
    PositiveInt32,
    check_endpoint,
    dec_hook,
    enc_hook,
    schema_hook,
)

__all__ = [
    "MAX_SECONDS", "AdminConfig", "Config", "Duration", "LogsConfig", "MessageSizeMiB",
    "NonNegDuration", "NonNegInt", "Percentage", "PipelineConfig", "PositiveInt",
    "PositiveInt32", "RawConfig", "ServiceConfig", "TelemetryConfig", "check_endpoint",
    "component_type", "dec_hook", "decode_struct", "enc_hook", "load_file", "load_text",
    "schema_hook", "signal_of",
]

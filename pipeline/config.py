"""YAML -> typed configuration.

The file has the OpenTelemetry Collector's shape (``receivers:``, ``processors:``,
``exporters:``, ``connectors:``, ``service: pipelines:``); component ids are ``type`` or
``type/name``. Every component section is decoded with its factory's msgspec ``Config``
(unknown keys are errors), and *all* problems are reported together, each prefixed with the
key path the user wrote, e.g. ``exporters.clickhouse.endpoint: ...``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import msgspec
import yaml

from pipeline.errors import ConfigError
from pipeline.records import SIGNALS


class Duration(float):
    """Seconds, written as a number or as ``250ms``, ``10s``, ``5m``, ``1h``."""

    _UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    _RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ns|us|ms|s|m|h|d)?\s*$")

    @classmethod
    def parse(cls, obj: object) -> Duration:
        if isinstance(obj, bool):
            raise ValueError("expected a duration such as 10s, got a boolean")
        if isinstance(obj, int | float):
            if obj < 0:
                raise ValueError("a duration cannot be negative")
            return cls(obj)
        if isinstance(obj, str):
            m = cls._RE.match(obj)
            if m:
                return cls(float(m.group(1)) * cls._UNITS[m.group(2) or "s"])
        raise ValueError(f"expected a duration such as 500ms, 10s or 5m, got {obj!r}")


def dec_hook(type_: type, obj: object) -> object:
    if type_ is Duration:
        return Duration.parse(obj)
    raise NotImplementedError(type_)


def enc_hook(obj: object) -> object:
    if isinstance(obj, Duration):
        return float(obj)
    raise NotImplementedError(type(obj))


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


class ServiceConfig(msgspec.Struct, forbid_unknown_fields=True):
    pipelines: dict[str, PipelineConfig]
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    # where relative paths (e.g. chdb://./data) are resolved; default: the current directory
    data_dir: str = "."


class RawConfig(msgspec.Struct, forbid_unknown_fields=True):
    service: ServiceConfig
    receivers: dict[str, dict[str, Any] | None] = {}
    processors: dict[str, dict[str, Any] | None] = {}
    exporters: dict[str, dict[str, Any] | None] = {}
    connectors: dict[str, dict[str, Any] | None] = {}


class Config(msgspec.Struct):
    """A validated configuration: component configs already decoded to their types."""

    service: ServiceConfig
    receivers: dict[str, Any]
    processors: dict[str, Any]
    exporters: dict[str, Any]
    connectors: dict[str, Any]


_SECTION_KIND = {
    "receivers": "receiver",
    "processors": "processor",
    "exporters": "exporter",
    "connectors": "connector",
}
_ENV_RE = re.compile(r"\$\$|\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def signal_of(pipeline_id: str) -> str:
    return pipeline_id.split("/", 1)[0]


def _expand(node: Any, path: str, env: dict[str, str], problems: list[str]) -> Any:
    """Expand ``${env:NAME}`` / ``${env:NAME:-default}`` in every string; ``$$`` is a ``$``.

    A value that is one reference as a whole stays a string unless it reads as a YAML list
    or mapping; the typed decoding (``decode_struct``, not strict) then turns
    ``port: ${env:PORT}`` into an int where the field is one, while a password ``123456``,
    ``true`` or ``#x`` stays the string it is (re-read as YAML, those became an int, a bool
    and nothing).
    """
    if isinstance(node, dict):
        return {k: _expand(v, f"{path}.{k}" if path else str(k), env, problems)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_expand(v, f"{path}[{i}]", env, problems) for i, v in enumerate(node)]
    if not isinstance(node, str) or "$" not in node:
        return node

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(f"{path}: environment variable {name} is not set and has no default")
        return ""

    whole = _ENV_RE.fullmatch(node)
    out = _ENV_RE.sub(sub, node)
    if whole and whole.group(0) != "$$" and out[:1] in ("[", "{"):
        try:
            parsed = yaml.safe_load(out)
        except yaml.YAMLError:
            return out
        return parsed if isinstance(parsed, list | dict) else out
    return out


def _msgspec_problem(prefix: str, err: msgspec.ValidationError) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$.port``` becomes
    ``receivers.otlp.port: expected int, got str``."""
    text = str(err)
    where = ""
    m = re.search(r" - at `\$(.*)`$", text)
    if m:
        where, text = m.group(1), text[: m.start()]
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", text)
    if unknown:
        where, text = f"{where}.{unknown.group(1)}", "unknown key"
    where = where.lstrip(".") if not prefix else where
    text = text.replace("`", "")
    if text[:1].isupper() and not text[:2].isupper():
        text = text[0].lower() + text[1:]
    return f"{prefix}{where}: {text}" if prefix or where else text


def decode_struct(raw: Any, type_: type[msgspec.Struct], path: str) -> msgspec.Struct:
    """Decode one section, raising ``ConfigError`` whose message starts with its key path."""
    try:
        # not strict: "4317" from an environment variable is an int where one is wanted
        return msgspec.convert(raw if raw is not None else {}, type_, dec_hook=dec_hook,
                               strict=False)
    except msgspec.ValidationError as err:
        raise ConfigError(_msgspec_problem(path, err)) from None


def load_text(text: str, source: str = "<config>", env: dict[str, str] | None = None) -> Config:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    problems: list[str] = []
    doc = _expand(doc, "", dict(os.environ) if env is None else env, problems)
    if "service" not in doc:
        problems.append("service: required key is missing")
        raise ConfigError(problems)
    try:
        raw = msgspec.convert(doc, RawConfig, dec_hook=dec_hook)
    except msgspec.ValidationError as err:
        raise ConfigError(problems + [_msgspec_problem("", err)]) from None

    from pipeline.registry import factories

    known = factories()
    decoded: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_KIND}
    for section, kind in _SECTION_KIND.items():
        for cid, body in getattr(raw, section).items():
            ctype = component_type(cid)
            factory = known[kind].get(ctype)  # type: ignore[index]
            if factory is None:
                valid = ", ".join(sorted(known[kind])) or "none"  # type: ignore[index]
                problems.append(f"{section}.{cid}: unknown {kind} type {ctype!r} (known: {valid})")
                continue
            try:
                cfg = decode_struct(body, factory.config, f"{section}.{cid}")
            except ConfigError as err:
                problems.extend(err.problems)
                continue
            # validate() names keys relative to the component: "endpoint: ..."
            validate = getattr(cfg, "validate", None)
            try:
                if validate is not None:
                    validate()
            except (ConfigError, ValueError) as err:
                found = err.problems if isinstance(err, ConfigError) else [str(err)]
                problems.extend(f"{section}.{cid}.{p}" for p in found)
                continue
            decoded[section][cid] = cfg

    problems.extend(_check_pipelines(raw, known))
    if problems:
        raise ConfigError(problems)
    return Config(service=raw.service, **decoded)


def _check_pipelines(raw: RawConfig, known: Any) -> list[str]:
    problems: list[str] = []
    if not raw.service.pipelines:
        problems.append("service.pipelines: at least one pipeline is required")
    used_connector_as: dict[str, list[set[str]]] = {cid: [set(), set()] for cid in raw.connectors}
    for pid, p in raw.service.pipelines.items():
        base = f"service.pipelines.{pid}"
        signal = signal_of(pid)
        if signal not in SIGNALS:
            problems.append(f"{base}: unknown signal {signal!r} (known: {', '.join(SIGNALS)})")
            continue
        if not p.receivers:
            problems.append(f"{base}.receivers: at least one receiver is required")
        if not p.exporters:
            problems.append(f"{base}.exporters: at least one exporter is required")
        for role, section, ids in (
            ("receivers", "receivers", p.receivers),
            ("processors", "processors", p.processors),
            ("exporters", "exporters", p.exporters),
        ):
            for i, cid in enumerate(ids):
                where = f"{base}.{role}[{i}]"
                if role != "processors" and cid in raw.connectors:
                    f = known["connector"].get(component_type(cid))
                    if f is None:
                        continue  # already reported
                    allowed = f.emits if role == "receivers" else f.signals
                    if signal not in allowed:
                        problems.append(f"{where}: connector {cid!r} cannot be used as "
                                        f"{role[:-1]} in a {signal} pipeline")
                    used_connector_as[cid][0 if role == "receivers" else 1].add(pid)
                    continue
                if cid not in getattr(raw, section):
                    problems.append(f"{where}: {cid!r} is not defined in {section}:")
                    continue
                f = known[_SECTION_KIND[section]].get(component_type(cid))
                if f is not None and signal not in f.signals:
                    problems.append(f"{where}: {cid!r} does not support {signal} "
                                    f"(supports: {', '.join(f.signals)})")
    for cid, (as_recv, as_exp) in used_connector_as.items():
        if as_recv and not as_exp or as_exp and not as_recv:
            problems.append(f"connectors.{cid}: a connector must be an exporter of one pipeline "
                            "and a receiver of another")
    return problems


def load_file(path: str, env: dict[str, str] | None = None) -> Config:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    return load_text(text, source=path, env=env)

"""A config file -> ``Config``, with every problem in the file reported together.

Which component types exist is the caller's to say (``factories``, usually
``pipeline.registry.default_factories()``): each section under ``receivers:``,
``processors:``, ``exporters:`` and ``connectors:`` is decoded with its factory's msgspec
``Config``, and each pipeline is checked against the components defined and the signals
their factories handle.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipeline.component import Factories, Factory, Kind
from pipeline.config.decode import FAILED, Failed, Partial, decode, decode_struct, join, validate_at
from pipeline.config.model import Config, PipelineConfig, ServiceConfig, component_type, signal_of
from pipeline.config.source import parse, read_file
from pipeline.config.tls import ReceiverAuth
from pipeline.errors import ConfigError
from pipeline.records import SIGNALS

_SECTION_KIND: dict[str, Kind] = {
    "receivers": "receiver",
    "processors": "processor",
    "exporters": "exporter",
    "connectors": "connector",
    "extensions": "extension",
}
_TOP_LEVEL = ("service", *_SECTION_KIND)
# the Collector's component id: a type, optionally "/" and a name
_ID_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*(/\S+)?")


def load_file(path: str, factories: Factories, env: dict[str, str] | None = None) -> Config:
    return load_text(read_file(path), factories, source=path, env=env)


def load_text(text: str, factories: Factories, source: str = "<config>",
              env: dict[str, str] | None = None) -> Config:
    """``env`` replaces the process environment for ``${env:...}`` (tests pass ``{}``)."""
    problems: list[str] = []
    doc = parse(text, source, env, problems)
    problems.extend(f"{k}: unknown key" for k in doc if k not in _TOP_LEVEL)
    defined: dict[str, dict[str, Any]] = {}  # section -> the ids written there
    decoded: dict[str, dict[str, Any]] = {}
    for section, kind in _SECTION_KIND.items():
        defined[section], decoded[section] = _load_section(
            doc.get(section), section, factories.get(kind, {}), problems)
    service, pipelines = _load_service(doc, problems)
    if pipelines is not None:
        problems.extend(_check_pipelines(pipelines, defined, factories))
    if not isinstance(service, Failed):
        problems.extend(_check_auth(service, decoded["receivers"], defined["extensions"]))
    if problems:
        raise ConfigError(problems)
    return Config(service=service, **decoded)


def _load_section(body: Any, section: str, known: Mapping[str, Factory],
                  problems: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One of receivers/processors/exporters/connectors: (ids written, decoded configs)."""
    if body is None:
        return {}, {}
    if not isinstance(body, dict):
        problems.append(f"{section}: expected a mapping of component ids, "
                        f"got {type(body).__name__}")
        return {}, {}
    kind = _SECTION_KIND[section]
    defined: dict[str, Any] = {}
    decoded: dict[str, Any] = {}
    for cid, cbody in body.items():
        where = join(section, cid)
        if not isinstance(cid, str) or not _ID_RE.fullmatch(cid):
            problems.append(f"{where}: expected a component id, type or type/name "
                            "(e.g. otlp, batch/traces)")
            continue
        defined[cid] = cbody
        factory = known.get(component_type(cid))
        if factory is None:
            valid = ", ".join(sorted(known)) or "none"
            problems.append(f"{where}: unknown {kind} type {component_type(cid)!r} "
                            f"(known: {valid})")
            continue
        try:
            decoded[cid] = decode_struct(cbody, factory.config, where)
        except ConfigError as err:
            problems.extend(err.problems)
    return defined, decoded


def _load_service(doc: dict[Any, Any], problems: list[str]) -> tuple[Any, Any]:
    """(the service section or FAILED, the pipelines to check or None): the pipelines
    that decoded are checked against the components even when other keys are wrong."""
    if "service" not in doc:
        problems.append("service: required key is missing")
        return FAILED, None
    raw = doc["service"]
    if not isinstance(raw, dict):
        got = type(raw).__name__ if raw is not None else "nothing"
        problems.append(f"service: expected a mapping with pipelines:, got {got}")
        return FAILED, None
    before = len(problems)
    service = decode(raw, ServiceConfig, "service", problems)
    if isinstance(service, Failed):
        return FAILED, None
    value = service.value if isinstance(service, Partial) else service
    problems.extend(validate_at(value.admin, "service.admin"))
    problems.extend(validate_at(value.tenants, "service.tenants"))
    return (value if len(problems) == before else FAILED), value.pipelines


def _auth_refs(receivers: dict[str, Any], service: ServiceConfig
               ) -> list[tuple[str, str]]:
    """(key, extension id) for every ``auth: {authenticator: ID}`` of a listener."""
    listeners: list[tuple[str, Any]] = [("service.admin", service.admin)]
    for rid, rc in receivers.items():
        protocols = getattr(rc, "protocols", None)
        if protocols is not None and hasattr(protocols, "enabled"):
            listeners += [(f"receivers.{rid}.protocols.{name}", p) for name, p in
                          zip(("grpc", "http"), protocols.enabled(), strict=True)]
        else:
            listeners.append((f"receivers.{rid}", rc))
    # (a Kafka receiver's ``auth:`` is its SASL to the brokers, not a listener's)
    return [(f"{key}.auth.authenticator", auth.authenticator) for key, c in listeners
            if isinstance(auth := getattr(c, "auth", None), ReceiverAuth)]


def _check_auth(service: ServiceConfig, receivers: dict[str, Any],
                extensions: dict[str, Any]) -> list[str]:
    """Every extension service.extensions starts is defined; every authenticator a
    listener names is started."""
    problems = [f"service.extensions[{i}]: {eid!r} is not defined in extensions:"
                for i, eid in enumerate(service.extensions) if eid not in extensions]
    for key, eid in _auth_refs(receivers, service):
        if eid not in service.extensions:
            problems.append(f"{key}: {eid!r} is not an extension started by "
                            "service.extensions")
    return problems


def _check_pipelines(pipelines: dict[str, PipelineConfig], defined: dict[str, dict[str, Any]],
                     known: Factories) -> list[str]:
    """Each pipeline's signal, and every id it names: defined, of a type that handles the
    signal, listed once; connectors used on both sides."""
    problems: list[str] = []
    if not pipelines:
        problems.append("service.pipelines: at least one pipeline is required")
    connectors = defined["connectors"]
    used_connector_as: dict[str, list[set[str]]] = {cid: [set(), set()] for cid in connectors}
    for pid, p in pipelines.items():
        base = f"service.pipelines.{pid}"
        signal = signal_of(pid)
        if signal not in SIGNALS:
            problems.append(f"{base}: unknown signal {signal!r} (known: {', '.join(SIGNALS)})")
            continue
        if not p.receivers:
            problems.append(f"{base}.receivers: at least one receiver is required")
        if not p.exporters:
            problems.append(f"{base}.exporters: at least one exporter is required")
        for role, ids in (("receivers", p.receivers), ("processors", p.processors),
                          ("exporters", p.exporters)):
            for i, cid in enumerate(ids):
                where = f"{base}.{role}[{i}]"
                if cid in ids[:i]:
                    problems.append(f"{where}: {cid!r} is listed twice")
                    continue
                if role != "processors" and cid in connectors:
                    f = known["connector"].get(component_type(cid))
                    if f is None:
                        continue  # already reported
                    allowed = f.emits if role == "receivers" else f.signals
                    if signal not in allowed:
                        problems.append(f"{where}: connector {cid!r} cannot be used as "
                                        f"{role[:-1]} in a {signal} pipeline")
                    used_connector_as[cid][0 if role == "receivers" else 1].add(pid)
                    continue
                if cid not in defined[role]:
                    problems.append(f"{where}: {cid!r} is not defined in {role}:")
                    continue
                f = known[_SECTION_KIND[role]].get(component_type(cid))
                if f is not None and signal not in f.signals:
                    problems.append(f"{where}: {cid!r} does not support {signal} "
                                    f"(supports: {', '.join(f.signals)})")
    for cid, (as_recv, as_exp) in used_connector_as.items():
        if as_recv and not as_exp or as_exp and not as_recv:
            problems.append(f"connectors.{cid}: a connector must be an exporter of one pipeline "
                            "and a receiver of another")
    return problems



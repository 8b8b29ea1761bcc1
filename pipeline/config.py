"""YAML -> typed configuration.

The file has the OpenTelemetry Collector's shape (``receivers:``, ``processors:``,
``exporters:``, ``connectors:``, ``service: pipelines:``); component ids are ``type`` or
``type/name``. Every component section is decoded with its factory's msgspec ``Config``
(unknown keys are errors), and *all* problems are reported together, each prefixed with the
key path the user wrote, e.g. ``exporters.clickhouse.endpoint: ...``: the document is
decoded key by key (``_decode``), not in one ``msgspec.convert`` that stops at the first
mistake, so one run of ``spanprof validate`` lists every missing section, unknown key, value
out of range and pipeline naming an undefined component.

Ranges are part of the types, so every component gets them by using the type:
``Duration`` is finite and > 0 (``NonNegDuration`` where 0 means "off" or "forever"),
``PositiveInt`` is a size or count >= 1, and an endpoint is ``HOST:PORT`` with a port of
1-65535 (``check_endpoint``; 0 asks the OS for a free port, which the tests rely on).
"""

from __future__ import annotations

import math
import os
import re
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin
from urllib.parse import unquote

import msgspec
import yaml

from pipeline.errors import ConfigError
from pipeline.log import is_secret_key, remember_secret
from pipeline.records import SIGNALS

# beyond this, a number is a typo, and later arithmetic (int(ttl), call_later) overflows
MAX_SECONDS = 100 * 365 * 86400.0
# sizes and counts: >= 1, and small enough for every C library they are handed to (int64)
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# what gRPC core takes (a C int): max_concurrent_streams, ...
PositiveInt32 = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Percentage = Annotated[int, msgspec.Meta(ge=0, le=100)]
# a message size in MiB that gRPC core takes in bytes, as a C int
MessageSizeMiB = Annotated[int, msgspec.Meta(ge=1, le=2047)]


class Duration(float):
    """Seconds, written as a number or as ``250ms``, ``10s``, ``5m``, ``1h``.

    In a config it must be finite and greater than 0: ``timeout: 0`` or ``.nan`` would
    otherwise turn a wait into a busy loop or a hang. A field where 0 has a meaning
    ("keep forever", "send at once") is a ``NonNegDuration``.
    """

    allow_zero: ClassVar[bool] = False
    _UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    _RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ns|us|ms|s|m|h|d)?\s*$")

    @classmethod
    def parse(cls, obj: object) -> Duration:
        """Any finite, non-negative duration (also used for query ranges like ``1h..0s``)."""
        if isinstance(obj, bool):
            raise ValueError("expected a duration such as 10s, got a boolean")
        seconds: float | None = None
        if isinstance(obj, int | float):
            try:
                seconds = float(obj)
            except OverflowError:
                seconds = math.inf
        elif isinstance(obj, str):
            m = cls._RE.match(obj)
            if m:
                seconds = float(m.group(1)) * cls._UNITS[m.group(2) or "s"]
        if seconds is None:
            raise ValueError(f"expected a duration such as 500ms, 10s or 5m, got {obj!r}")
        if not math.isfinite(seconds):
            raise ValueError(f"expected a finite duration, got {obj!r}")
        if seconds < 0:
            raise ValueError("a duration cannot be negative")
        return cls(seconds)

    @classmethod
    def from_config(cls, obj: object) -> Duration:
        """``parse`` plus the range a config field of this type allows."""
        d = cls.parse(obj)
        if float(d) == 0 and not cls.allow_zero:
            raise ValueError("must be greater than 0 (e.g. 500ms, 10s)")
        if d > MAX_SECONDS:
            raise ValueError(f"must be at most 100 years, got {obj!r}")
        return d


class NonNegDuration(Duration):
    """A ``Duration`` where 0 is allowed and means "off" (``ttl: 0`` keeps data forever,
    ``batch.timeout: 0`` sends at once): the field's comment says which."""

    allow_zero = True


def check_endpoint(endpoint: str, key: str = "endpoint") -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``ConfigError`` naming ``key`` otherwise.

    The port is 1-65535, or 0 for "any free port" (tests start pipelines that way; the
    chosen port is logged). Servers would otherwise take 99999 modulo 65536 or fail later
    with a traceback.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host.strip() or any(c.isspace() for c in endpoint) \
            or not re.fullmatch(r"[0-9]{1,5}", port):
        raise ConfigError(f"{key}: expected HOST:PORT, got {endpoint!r}")
    if int(port) > 65535:
        raise ConfigError(f"{key}: port must be 1-65535 (0: any free port), got {port}")
    return host, int(port)


def dec_hook(type_: type, obj: object) -> object:
    if isinstance(type_, type) and issubclass(type_, Duration):
        return type_.from_config(obj)
    raise NotImplementedError(type_)


def enc_hook(obj: object) -> object:
    if isinstance(obj, Duration):
        return float(obj)
    raise NotImplementedError(type(obj))


def schema_hook(type_: type) -> dict[str, Any]:
    """JSON Schema of the custom types (``spanprof schema config``)."""
    if isinstance(type_, type) and issubclass(type_, Duration):
        low = "minimum" if type_.allow_zero else "exclusiveMinimum"
        return {"anyOf": [{"type": "number", low: 0, "maximum": MAX_SECONDS},
                          {"type": "string", "pattern": Duration._RE.pattern}],
                "description": "seconds, or a number with a unit: 250ms, 10s, 5m, 1h, 7d"}
    raise NotImplementedError(type_)


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

    def validate(self) -> None:
        if self.enabled:
            check_endpoint(self.endpoint)


class ServiceConfig(msgspec.Struct, forbid_unknown_fields=True):
    pipelines: dict[str, PipelineConfig]
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    # where relative paths (e.g. chdb://./data) are resolved; default: the current directory
    data_dir: str = "."


class RawConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A spanprof pipeline: the OpenTelemetry Collector's shape (component sections are
    checked by ``spanprof validate``, whose types are each component's Config)."""

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
_TOP_LEVEL = ("service", *_SECTION_KIND)
_ENV_RE = re.compile(r"\$\$|\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# the Collector's component id: a type, optionally "/" and a name
_ID_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*(/\S+)?")


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def signal_of(pipeline_id: str) -> str:
    return pipeline_id.split("/", 1)[0]


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _expand(node: Any, path: str, env: dict[str, str], problems: list[str]) -> Any:
    """Expand ``${env:NAME}`` / ``${env:NAME:-default}`` in every string; ``$$`` is a ``$``.

    A value that is one reference as a whole stays a string unless it reads as a YAML list
    or mapping; the typed decoding (``_decode``, not strict) then turns
    ``port: ${env:PORT}`` into an int where the field is one, while a password ``123456``,
    ``true`` or ``#x`` stays the string it is (re-read as YAML, those became an int, a bool
    and nothing).
    """
    if isinstance(node, dict):
        return {k: _expand(v, _join(path, k), env, problems) for k, v in node.items()}
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


def _remember_secrets(node: Any, key: object = None) -> None:
    """Every value under a secret-looking key, and every URL password, is redacted from
    errors and logs from now on (``pipeline.log.redact``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _remember_secrets(v, k)
    elif isinstance(node, list):
        for v in node:
            _remember_secrets(v, key)
    elif isinstance(node, str | int) and not isinstance(node, bool):
        if is_secret_key(key):
            remember_secret(str(node))
        elif isinstance(node, str) and "@" in node:
            m = re.search(r"://[^/@:\s]*:([^/@\s]+)@", node)
            if m:  # as written, and as the client is given it (percent-decoded)
                remember_secret(m.group(1))
                remember_secret(unquote(m.group(1)))


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


class _Failed:
    """A value that could not be decoded at all (its problems are already recorded)."""


FAILED = _Failed()


class Partial:
    """A value decoded with problems (already recorded), repaired so that checking can go
    on: a struct with each bad field at its default, a mapping without its bad entries.
    ``validate()`` and the pipeline checks run on it, so one run reports those problems
    too; it is never returned as configuration."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _ok(value: Any) -> bool:
    return not isinstance(value, _Failed | Partial)


def _struct_in(type_: Any) -> type[msgspec.Struct] | None:
    """The Struct a field holds (``X``, ``X | None``, ``X | UnsetType``), if exactly one."""
    if isinstance(type_, type) and issubclass(type_, msgspec.Struct):
        return type_
    if get_origin(type_) in (Union, types.UnionType):
        found = [t for t in get_args(type_) if isinstance(t, type)
                 and issubclass(t, msgspec.Struct)]
        return found[0] if len(found) == 1 else None
    return None


def _decode(raw: Any, type_: Any, path: str, problems: list[str]) -> Any:
    """``raw`` as ``type_``, recording *every* problem (msgspec stops at the first one):
    structs, mappings and lists are walked key by key; leaves go through msgspec. Returns
    the value, a ``Partial`` or ``FAILED``."""
    struct = _struct_in(type_)
    if struct is not None and isinstance(raw, dict):
        return _decode_struct(raw, struct, path, problems)
    if get_origin(type_) is dict and isinstance(raw, dict):
        return _decode_dict(raw, type_, path, problems)
    if get_origin(type_) is list and isinstance(raw, list):
        (item_t,) = get_args(type_)
        items = [_decode(v, item_t, f"{path}[{i}]", problems) for i, v in enumerate(raw)]
        return items if all(_ok(v) for v in items) else FAILED
    try:
        # not strict: "4317" from an environment variable is an int where one is wanted
        return msgspec.convert(raw, type_, dec_hook=dec_hook, strict=False)
    except msgspec.ValidationError as err:
        problems.append(_msgspec_problem(path, err))
        return FAILED


def _decode_dict(raw: dict[Any, Any], type_: Any, path: str, problems: list[str]) -> Any:
    key_t, value_t = get_args(type_)
    out, ok = {}, True
    for k, v in raw.items():
        if key_t is str and not isinstance(k, str):
            problems.append(f"{_join(path, k)}: keys must be strings, got {type(k).__name__}")
            ok = False
            continue
        value = _decode(v, value_t, _join(path, k), problems)
        if _ok(value):
            out[k] = value
        else:
            ok = False
    return out if ok else Partial(out)


def _decode_struct(raw: dict[Any, Any], struct: type[msgspec.Struct], path: str,
                   problems: list[str]) -> Any:
    """A Struct from a mapping: every unknown key, missing key and bad value is reported.
    A nested section left empty (``telemetry:``) takes its defaults, as in the Collector."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
    before = len(problems)
    for key in raw:
        if key not in fields:
            problems.append(f"{_join(path, key)}: unknown key")
    values = {}
    for name, f in fields.items():
        where = _join(path, name)
        if name not in raw:
            if f.required:
                problems.append(f"{where}: required key is missing")
            continue
        value = raw[name]
        if value is None and _struct_in(f.type) is f.type:
            value = {}
        value = _decode(value, f.type, where, problems)
        if isinstance(value, Partial):
            value = value.value
        if isinstance(value, _Failed):
            if f.required:
                return FAILED
            continue  # repaired: the default
        values[f.name] = value
    try:
        built = struct(**values)
    except (TypeError, ValueError) as err:  # a __post_init__ refusing the combination
        problems.append(f"{path}: {err}")
        return FAILED
    return built if len(problems) == before else Partial(built)


def decode_struct(raw: Any, type_: type[msgspec.Struct], path: str) -> msgspec.Struct:
    """Decode one section (``None`` is ``{}``), then run its ``validate()``; raise
    ``ConfigError`` listing every problem, each starting with its key path."""
    problems: list[str] = []
    cfg = _decode({} if raw is None else raw, type_, path, problems)
    if isinstance(cfg, Partial):
        cfg = cfg.value
    if not isinstance(cfg, _Failed):
        problems.extend(_validate(cfg, path))
    if problems:
        raise ConfigError(problems)
    return cfg  # type: ignore[no-any-return]


def _validate(cfg: Any, path: str) -> list[str]:
    """``validate()`` names keys relative to its struct (``endpoint: ...``)."""
    validate = getattr(cfg, "validate", None)
    if validate is None:
        return []
    try:
        validate()
    except (ConfigError, ValueError) as err:
        found = err.problems if isinstance(err, ConfigError) else [str(err)]
        return [_join(path, p) for p in found]
    return []


def load_text(text: str, source: str = "<config>", env: dict[str, str] | None = None) -> Config:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    except RecursionError:  # "[[[[...", deeper than the parser's stack
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, "
                          f"got {type(doc).__name__}")
    problems: list[str] = []
    doc = _expand(doc, "", dict(os.environ) if env is None else env, problems)
    _remember_secrets(doc)
    problems.extend(f"{k}: unknown key" for k in doc if k not in _TOP_LEVEL)

    from pipeline.registry import factories

    known = factories()
    defined: dict[str, dict[str, Any]] = {}  # section -> the ids written there
    decoded: dict[str, dict[str, Any]] = {}
    for section, kind in _SECTION_KIND.items():
        defined[section], decoded[section] = _load_section(
            doc.get(section), section, known[kind], problems)  # type: ignore[index]
    service, pipelines = _load_service(doc, problems)
    if pipelines is not None:
        problems.extend(_check_pipelines(pipelines, defined, known))
    if problems:
        raise ConfigError(problems)
    return Config(service=service, **decoded)


def _load_section(body: Any, section: str, known: dict[str, Any],
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
        where = _join(section, cid)
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
    service = _decode(raw, ServiceConfig, "service", problems)
    if isinstance(service, _Failed):
        return FAILED, None
    value = service.value if isinstance(service, Partial) else service
    problems.extend(_validate(value.admin, "service.admin"))
    return (value if len(problems) == before else FAILED), value.pipelines


def _check_pipelines(pipelines: dict[str, PipelineConfig], defined: dict[str, dict[str, Any]],
                     known: Any) -> list[str]:
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


def load_file(path: str, env: dict[str, str] | None = None) -> Config:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text: {err.reason} at byte {err.start}") from None
    return load_text(text, source=path, env=env)

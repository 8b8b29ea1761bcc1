"""Decoding with every problem collected, each prefixed with the key path the user wrote.

``msgspec.convert`` stops at the first mistake; here structs, mappings and lists are walked
key by key (``decode``) and only the leaves go through msgspec, so one run of ``spanprof
validate`` lists every unknown key, missing key and value out of range, e.g.
``exporters.clickhouse.endpoint: ...``. msgspec's own messages are rewritten to that form
(``_msgspec_problem``).
"""

from __future__ import annotations

import re
import types
from typing import Any, Union, get_args, get_origin

import msgspec

from pipeline.config.ranges import dec_hook
from pipeline.errors import ConfigError


def join(path: str, key: object) -> str:
    """``receivers.otlp`` + ``protocols`` -> ``receivers.otlp.protocols``."""
    return f"{path}.{key}" if path else str(key)


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


class Failed:
    """A value that could not be decoded at all (its problems are already recorded)."""


FAILED = Failed()


class Partial:
    """A value decoded with problems (already recorded), repaired so that checking can go
    on: a struct with each bad field at its default, a mapping without its bad entries.
    ``validate()`` and the pipeline checks run on it, so one run reports those problems
    too; it is never returned as configuration."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _ok(value: Any) -> bool:
    return not isinstance(value, Failed | Partial)


def _struct_in(type_: Any) -> type[msgspec.Struct] | None:
    """The Struct a field holds (``X``, ``X | None``, ``X | UnsetType``), if exactly one."""
    if isinstance(type_, type) and issubclass(type_, msgspec.Struct):
        return type_
    if get_origin(type_) in (Union, types.UnionType):
        found = [t for t in get_args(type_) if isinstance(t, type)
                 and issubclass(t, msgspec.Struct)]
        return found[0] if len(found) == 1 else None
    return None


def decode(raw: Any, type_: Any, path: str, problems: list[str]) -> Any:
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
        items = [decode(v, item_t, f"{path}[{i}]", problems) for i, v in enumerate(raw)]
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
            problems.append(f"{join(path, k)}: keys must be strings, got {type(k).__name__}")
            ok = False
            continue
        value = decode(v, value_t, join(path, k), problems)
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
            problems.append(f"{join(path, key)}: unknown key")
    values = {}
    for name, f in fields.items():
        where = join(path, name)
        if name not in raw:
            if f.required:
                problems.append(f"{where}: required key is missing")
            continue
        value = raw[name]
        if value is None and _struct_in(f.type) is f.type:
            value = {}
        value = decode(value, f.type, where, problems)
        if isinstance(value, Partial):
            value = value.value
        if isinstance(value, Failed):
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
    cfg = decode({} if raw is None else raw, type_, path, problems)
    if isinstance(cfg, Partial):
        cfg = cfg.value
    if not isinstance(cfg, Failed):
        problems.extend(validate_at(cfg, path))
    if problems:
        raise ConfigError(problems)
    return cfg  # type: ignore[no-any-return]


def validate_at(cfg: Any, path: str) -> list[str]:
    """The problems ``cfg.validate()`` reports, under ``path``: ``validate()`` names keys
    relative to its struct (``endpoint: ...``)."""
    validate = getattr(cfg, "validate", None)
    if validate is None:
        return []
    try:
        validate()
    except (ConfigError, ValueError) as err:
        found = err.problems if isinstance(err, ConfigError) else [str(err)]
        return [join(path, p) for p in found]
    return []


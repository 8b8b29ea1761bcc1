"""Helpers shared by the OTLP decoders."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

UNKNOWN_SERVICE = "unknown_service"


def any_value_str(v: Any) -> str:
    """AnyValue -> string the way the Collector's ClickHouse exporter stores attributes."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return str(v.string_value)
    if kind == "int_value":
        return str(v.int_value)
    if kind == "bool_value":
        return "true" if v.bool_value else "false"
    if kind == "double_value":
        return repr(v.double_value)
    if kind == "bytes_value":
        return bytes(v.bytes_value).hex()
    if kind in ("array_value", "kvlist_value"):
        return json.dumps(_any_value_py(v), separators=(",", ":"))
    return ""


def _any_value_py(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value_py(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value_py(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return bytes(v.bytes_value).hex()
    if kind is None:
        return None
    return getattr(v, kind)


def attributes_dict(kvs: Iterable[Any]) -> dict[str, str]:
    return {kv.key: any_value_str(kv.value) for kv in kvs}


def service_name(resource_attributes: dict[str, str]) -> str:
    return resource_attributes.get("service.name") or UNKNOWN_SERVICE


def is_zero(b: bytes) -> bool:
    return not b or b.count(0) == len(b)

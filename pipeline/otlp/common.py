"""Helpers shared by the OTLP decoders."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

UNKNOWN_SERVICE = "unknown_service"


def any_value_str(v: Any) -> str:
    """AnyValue -> string exactly as the Collector's ClickHouse exporter stores attributes
    (pdata ``Value.AsString()``), so the same query matches data from either writer."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return str(v.string_value)
    if kind == "int_value":
        return str(v.int_value)
    if kind == "bool_value":
        return "true" if v.bool_value else "false"
    if kind == "double_value":
        return format_double(v.double_value)
    if kind == "bytes_value":
        return base64.b64encode(bytes(v.bytes_value)).decode()
    if kind in ("array_value", "kvlist_value"):
        return _json(v)
    return ""


def format_double(f: float) -> str:
    """A double the way Go's encoding/json (ES6 number-to-string) writes it: shortest
    round-trip digits, fixed notation unless |f| < 1e-6 or >= 1e21, ``1e-7`` not ``1e-07``."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    a = abs(f)
    if a != 0 and (a < 1e-6 or a >= 1e21):
        # Python's repr uses exponent notation throughout these ranges
        mantissa, _, exp = repr(f).partition("e")
        sign, digits = exp[0], exp[1:].lstrip("0") or "0"
        return f"{mantissa}e{sign}{digits if sign == '-' else digits.zfill(2)}"
    return format(Decimal(repr(f)).normalize(), "f")


def _json(v: Any) -> str:
    """AnyValue -> compact JSON as Go writes ``Value.AsRaw()``: map keys sorted, bytes as
    base64 strings, doubles as in ``format_double``."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return "[" + ",".join(_json(x) for x in v.array_value.values) + "]"
    if kind == "kvlist_value":
        items = sorted(((kv.key, kv.value) for kv in v.kvlist_value.values), key=lambda i: i[0])
        return "{" + ",".join(f"{json.dumps(k)}:{_json(x)}" for k, x in items) + "}"
    if kind == "string_value":
        return json.dumps(v.string_value, ensure_ascii=False)
    if kind == "bytes_value":
        return json.dumps(base64.b64encode(bytes(v.bytes_value)).decode())
    if kind == "double_value":
        return format_double(v.double_value)
    if kind is None:
        return "null"
    return any_value_str(v)


def attributes_dict(kvs: Iterable[Any]) -> dict[str, str]:
    out = {}
    for kv in kvs:  # a string value (most) without a call
        v = kv.value
        out[kv.key] = v.string_value if v.WhichOneof("value") == "string_value" \
            else any_value_str(v)
    return out


def service_name(resource_attributes: dict[str, str]) -> str:
    return resource_attributes.get("service.name") or UNKNOWN_SERVICE


def is_zero(b: bytes) -> bool:
    return not b or b.count(0) == len(b)


class Rejections:
    """Items a decoder refused: their (resource, scope, item) paths, a count, and a message
    naming the first few (``partial_success.error_message``)."""

    MAX_REPORTED = 3

    def __init__(self) -> None:
        self.paths: list[tuple[int, int, int]] = []
        self._errors: list[str] = []

    def add(self, path: tuple[int, int, int], where: str, problem: object) -> None:
        self.paths.append(path)
        if len(self._errors) < self.MAX_REPORTED:
            self._errors.append(f"{where}: {problem}")

    @property
    def count(self) -> int:
        return len(self.paths)

    @property
    def message(self) -> str:
        text = "; ".join(self._errors)
        if self.count > len(self._errors):
            text += f" (and {self.count - len(self._errors)} more)"
        return text

"""The value types of config fields, with their ranges, and msgspec's hooks for them.

Ranges are part of the types, so every component gets them by using the type:
``Duration`` is finite and > 0 (``NonNegDuration`` where 0 means "off" or "forever"),
``PositiveInt`` is a size or count >= 1, and an endpoint is ``HOST:PORT`` with a port of
1-65535 (``check_endpoint``; 0 asks the OS for a free port, which the tests rely on).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, ClassVar

import msgspec

from pipeline.errors import ConfigError

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

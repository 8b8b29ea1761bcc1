"""The admin API's answers and parameters: JSON bodies, errors, the tenant of a request,
and the checks every query parameter goes through before a query runs (a bad one is
``BadRequest``: a 400 whose message names it). Shared by the handlers of server.py and
ui_api.py.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from pipeline.admin import queries
from pipeline.admin.ranges import parse_range
from pipeline.config import Duration
from pipeline.log import redact
from pipeline.receivers.authn import TENANT
from pipeline.records import DEFAULT_TENANT

MAX_LIMIT = 10_000
MAX_TEXT = 1024  # characters in a service or operation name
MAX_NS = 2**63 - 1  # a duration parameter, in ns


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": redact(message)}, status=status)


def tenant_of(request: web.Request) -> str:
    """Whose data a request may see: what the listener's middleware resolved (``authn``):
    the tenant its token maps to with auth on, else ``X-Scope-OrgID``'s or the default
    tenant. A ``tenant`` query parameter is never read."""
    return request.get(TENANT) or DEFAULT_TENANT


def limit(q: Any) -> int:
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit: expected an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise BadRequest(f"limit: expected 1..{MAX_LIMIT}")
    return limit


class BadRequest(Exception):
    """A query parameter is wrong: 400, its message names the parameter."""


class NotFound(Exception):
    pass


def param(q: Any, name: str, required: bool = False) -> str | None:
    v = q.get(name) or None
    if required and v is None:
        raise BadRequest(f"{name}: required")
    return str(v) if v is not None else None


def text(q: Any, name: str, required: bool = False) -> str | None:
    """A name compared with stored ones (service, operation): printable, bounded."""
    v = param(q, name, required)
    if v is None:
        return None
    if len(v) > MAX_TEXT:
        raise BadRequest(f"{name}: longer than {MAX_TEXT} characters")
    if any(ord(c) < 32 or 127 <= ord(c) < 160 or 0xD800 <= ord(c) < 0xE000 for c in v):
        raise BadRequest(f"{name}: control characters, NUL and lone surrogates are not "
                          "allowed")
    return v


def hex_id(v: str | None, name: str, length: int) -> str:
    """A trace (32) or span (16) id as lowercase hex."""
    v = (v or "").lower()
    if len(v) != length or not all(c in "0123456789abcdef" for c in v):
        raise BadRequest(f"{name}: expected {length} hex characters")
    return v


def time_range(q: Any, name: str, now: float, default: str | None = None) -> tuple[int, int]:
    spec = param(q, name, default is None) or str(default)
    try:
        return parse_range(spec, now, name)
    except ValueError as err:
        raise BadRequest(str(err)) from None


def tail_rule(q: Any) -> tuple[float | None, int | None]:
    """``slowest`` (``1%`` or ``0.01``: up to half of the calls; the default, 1%) or
    ``slower_than`` (a duration: ``1s``, ``250ms``), not both."""
    slowest, slower = param(q, "slowest"), param(q, "slower_than")
    if slowest and slower:
        raise BadRequest("slowest: give slowest or slower_than, not both")
    if slower:
        try:
            ns = int(Duration.parse(slower) * 1e9)
        except ValueError as err:
            raise BadRequest(f"slower_than: {err}") from None
        if not 0 <= ns < 2**63:
            raise BadRequest("slower_than: out of range")
        return None, ns
    text = (slowest or "1%").strip()
    try:
        frac = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise BadRequest("slowest: expected a share of the calls such as 1% or 0.01") \
            from None
    if not 0 < frac <= 0.5:
        raise BadRequest("slowest: expected more than 0 and at most 50%")
    return frac, None


def choice(q: Any, name: str, options: tuple[str, ...], default: str) -> str:
    v = param(q, name) or default
    if v not in options:
        raise BadRequest(f"{name}: expected {', '.join(options[:-1])} or {options[-1]}")
    return v


def integer(q: Any, name: str, lo: int, hi: int, default: int) -> int:
    try:
        v = int(param(q, name) or default)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer") from None
    if not lo <= v <= hi:
        raise BadRequest(f"{name}: expected {lo}..{hi}")
    return v


def duration_ns(q: Any, name: str, default: int) -> int:
    """A duration (``250ms``, ``1.5s``, ``0``) in ns, within 0..2^63-1."""
    v = param(q, name)
    if v is None:
        return default
    try:
        ns = int(Duration.parse(v) * 1e9)
    except (ValueError, OverflowError):
        raise BadRequest(f"{name}: expected a duration such as 250ms or 1.5s") from None
    if not 0 <= ns <= MAX_NS:
        raise BadRequest(f"{name}: out of range")
    return ns


def method(q: Any) -> str:
    method = str(q.get("method", "exact"))
    try:
        queries.methods_of(method)
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return method

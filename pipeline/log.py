"""structlog set-up: JSON or console, events as snake_case names with fields, secrets redacted.

Redaction happens in one place, the last processor before rendering, so that no component
has to remember it: a value under a key that names a secret (``password``, ``token``,
``authorization``, ...) becomes ``***``; in every other string, ``user:pass@`` in a URL,
``password=...``-style pairs, and every secret value the configuration holds (remembered by
``pipeline.config`` when it loads a file, see ``remember_secret``) are replaced. The same
``redact()`` is applied to configuration errors before they are printed, since a client
library's exception text may quote the URL or the password it was given.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

MASK = "***"
# a whole key, or its last _-separated part, names a secret: password, db_password, token,
# bearer_token, authorization, api_key, client_secret, credentials
_SECRET_KEY = re.compile(
    r"(?i)(?:.*[_-])?(?:password|passwd|pwd|secret|token|authorization|api_?key|credentials?)")
# scheme://user:password@host -> scheme://user:***@host
_URL_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):(?P<pw>[^/@\s]+)@")
# password=x, db_password=x, "password": "x", token: x, Authorization: Bearer x (as quoted
# in error texts);
# not a key path (exporters.clickhouse.password: expected str): the problem must stay readable
_PAIR = re.compile(
    r"(?i)(?P<key>(?<![.\w])(?:\w*_)?(?:password|passwd|pwd|secret|token|api_?key|"
    r"authorization)['\"]?"
    r"\s*[=:]\s*['\"]?)(?P<scheme>(?:bearer|basic)\s+)?(?P<value>[^\s'\",;&}]+)")
# shorter values are not remembered: replacing "ab" in every log line would garble them
_MIN_SECRET_LEN = 4
_secrets: set[str] = set()


def is_secret_key(key: object) -> bool:
    return isinstance(key, str) and _SECRET_KEY.fullmatch(key) is not None


def remember_secret(value: object) -> None:
    """Redact this literal value wherever it appears from now on (errors, logs)."""
    if isinstance(value, str) and len(value) >= _MIN_SECRET_LEN:
        _secrets.add(value)


def forget_secrets() -> None:
    """For tests: start from no remembered values."""
    _secrets.clear()


def redact(text: str) -> str:
    """``text`` with every secret it may contain replaced by ``***``."""
    for secret in sorted(_secrets, key=len, reverse=True):  # longest first: no partial leftovers
        text = text.replace(secret, MASK)
    text = _URL_USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _PAIR.sub(lambda m: f"{m['key']}{m['scheme'] or ''}{MASK}", text)


def redact_value(key: object, value: Any) -> Any:
    """One field of an event, redacted (mappings and lists are walked)."""
    if is_secret_key(key) and value not in (None, ""):
        return MASK
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(k, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(None, v) for v in value)
    return value


def redact_event(_logger: Any, _method: str,
                 event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: runs after ``format_exc_info``, so tracebacks are redacted too."""
    return {k: redact_value(k, v) for k, v in event_dict.items()}


def configure(level: str = "info", encoding: str = "console") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if encoding == "json"
        else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )

"""The command line's side of the admin API: one JSON request to a running `spanprof run`.

The query commands (``spanprof top``, ``why``, ...) and ``spanprof backfill`` submitting to
a running pipeline both ask it over HTTP(S); an answer that is an error becomes the
command's one-line exit message, with the API's own ``error`` field when it sent one.
Standard library only: the commands that use it must stay quick to start.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


def request_json(url: str, *, headers: dict[str, str], context: ssl.SSLContext | None,
                 unreachable: Callable[[object], str], method: str = "GET",
                 body: Any = None) -> Any:
    """The decoded JSON answer to ``method url`` (with ``body`` as JSON when given).
    ``SystemExit`` with ``error: URL: STATUS MESSAGE`` when the API answers an error, and
    with ``unreachable(reason)`` when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, headers=headers, data=data)
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            msg = json.loads(err.read()).get("error", err.reason)
        except ValueError:
            msg = err.reason
        raise SystemExit(f"error: {url}: {err.code} {msg}") from None
    except (urllib.error.URLError, OSError) as err:
        raise SystemExit(unreachable(getattr(err, "reason", err))) from None

"""How every OTLP receiver (gRPC, HTTP) turns a request body into a checked batch.

A gateway's usual protobuf trace request (its spans not wanted as records, only passed on)
is checked on its bytes by the native library (``pipeline.native``), never parsed; any
other request, or one the library leaves, is parsed and checked in Python, which names
what it refuses. Either way the item count is held to the receiver's limit before the
checks cost anything per item.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.otlp.traces import check_trace_bytes
from pipeline.receivers.limits import ITEMS, check_items, count_items


def take_request(signal: str, body: bytes, *, records: bool, parse: Callable[[bytes], Any],
                 decode: Callable[..., Any], wire: bytes | None, limit: int, key: str) -> Any:
    """The ``Decoded`` batch of ``body``. ``parse`` makes the request message (and raises
    what the receiver answers as malformed); ``decode`` is the signal's decoder; ``wire``
    the protobuf bytes as received (None for JSON), which a gateway passes on; ``limit``
    and ``key``: the items allowed in one request and the config key that says so
    (``TooLarge`` beyond it)."""
    if not records and signal == "traces" and wire is not None:
        decoded = check_trace_bytes(wire)
        if decoded is not None:
            check_items(len(decoded.batch), limit, ITEMS[signal], key)
            return decoded
    req = parse(body)
    check_items(count_items(signal, req), limit, ITEMS[signal], key)
    return decode(req, records, wire=wire)

"""Per-request limits every receiver applies before a request costs anything downstream.

A request over a limit is refused whole with a message naming the config key (HTTP 413,
gRPC ``RESOURCE_EXHAUSTED``), never truncated: a client that splits its batches smaller
succeeds, and nothing accepted is lost.
"""

from __future__ import annotations

import zlib
from typing import Any

from pipeline.errors import InvalidData, TooLarge

# what a signal's requests hold: the receivers' metric names count items, not requests
ITEMS = {"traces": "spans", "profiles": "samples"}


def count_items(signal: str, req: Any) -> int:
    """Spans in an ExportTraceServiceRequest, samples in an ExportProfilesServiceRequest,
    counted on the message before anything is decoded."""
    if signal == "traces":
        return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return sum(len(p.samples) for rp in req.resource_profiles for sp in rp.scope_profiles
               for p in sp.profiles)


def check_items(n: int, limit: int, what: str, key: str) -> None:
    if limit and n > limit:
        raise TooLarge(f"{n} {what} in one request, over {key}={limit}: send smaller batches")


def gunzip_limited(data: bytes, limit: int, what: str, key: str) -> bytes:
    """Inflate gzip data, never producing more than ``limit`` bytes (a gzip bomb is refused,
    not inflated)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as err:
        raise InvalidData(f"{what}: not valid gzip: {err}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise TooLarge(f"{what}: decompresses to more than {key}={limit} bytes")
    return out

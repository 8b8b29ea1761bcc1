"""Which signal an OTLP message or document holds, read without decoding it.

One Collector ``file`` exporter named in both a traces and a profiles pipeline is one
component (``exporter/fileexporter/factory.go``, ``getOrCreateFileExporter``: cached per
config), so its file interleaves both signals, and the backfill reader decides per line or
message, not per file.

JSON: ``resourceSpans`` is traces; ``resourceProfiles`` or ``dictionary`` is profiles (the
protobuf field names too, which ``json_format`` accepts).

Protobuf: ``ExportTraceServiceRequest`` has one field (``resource_spans = 1``);
``ExportProfilesServiceRequest`` (and ``ProfilesData``, the same numbers) has
``resource_profiles = 1`` and ``dictionary = 2``, which every profiles request that names
a string carries. Without a field 2, the first span or profile tells them apart by the
wire types of fields they both number but type differently (``trace.proto`` /
``profiles.proto`` v1development):

=======  ==========================  ==========================
field    Span                        Profile
=======  ==========================  ==========================
3        trace_state (LEN)           time_unix_nano (I64)
4        parent_span_id (LEN)        duration_nano (VARINT)
7        start_time_unix_nano (I64)  profile_id (LEN)
8        end_time_unix_nano (I64)    dropped_attributes_count (VARINT)
=======  ==========================  ==========================

The walk never trusts a length: a malformed wire stops it, and the answer is "unknown".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

Signal = Literal["traces", "profiles"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_SPAN_WIRE = {3: _LEN, 4: _LEN, 7: _I64, 8: _I64}
_PROFILE_WIRE = {3: _I64, 4: _VARINT, 7: _LEN, 8: _VARINT}
_TRACE_KEYS = ("resourceSpans", "resource_spans")
_PROFILE_KEYS = ("resourceProfiles", "resource_profiles", "dictionary")
_HEAD_KEY = re.compile(rb'"(resourceSpans|resource_spans|resourceProfiles|resource_profiles)"'
                       rb"\s*:")


def json_signal(doc: Any) -> Signal | None:
    """The signal of a parsed OTLP/JSON document by its keys; None if it names neither."""
    if not isinstance(doc, dict):
        return None
    if any(k in doc for k in _TRACE_KEYS):
        return "traces"
    if any(k in doc for k in _PROFILE_KEYS):
        return "profiles"
    return None


def json_head_signal(head: bytes) -> Signal | None:
    """The signal of the first OTLP/JSON key in the first bytes of a file (a guess for the
    file as a whole: each line is classified again when it is read)."""
    m = _HEAD_KEY.search(head)
    if m is None:
        return None
    return "traces" if m.group(1) in (b"resourceSpans", b"resource_spans") else "profiles"


def proto_signal(b: bytes) -> Signal | None:
    """The signal of a serialised OTLP export request (module docstring); None when it
    holds no span or profile to tell by, or its wire is malformed before one."""
    for field, _, _, _ in _walk(b, 0, len(b)):
        if field == 2:
            return "profiles"
    for field, wire, start, end in _walk(b, 0, len(b)):
        if field != 1 or wire != _LEN:
            continue
        for f2, w2, s2, e2 in _walk(b, start, end):  # ResourceSpans / ResourceProfiles
            if f2 != 2 or w2 != _LEN:
                continue
            for f3, w3, s3, e3 in _walk(b, s2, e2):  # ScopeSpans / ScopeProfiles
                if f3 != 2 or w3 != _LEN:
                    continue
                for f4, w4, _, _ in _walk(b, s3, e3):  # Span / Profile
                    if _SPAN_WIRE.get(f4) == w4:
                        return "traces"
                    if _PROFILE_WIRE.get(f4) == w4:
                        return "profiles"
    return None


def _uvarint(b: bytes, i: int, end: int) -> tuple[int, int] | None:
    value, shift = 0, 0
    while i < end and shift < 64:
        x = b[i]
        i += 1
        value |= (x & 0x7F) << shift
        if x < 0x80:
            return value, i
        shift += 7
    return None


def _walk(b: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, payload start, payload end) of each field in
    ``b[start:end]``, until the end or the first malformed field."""
    i = start
    while i < end:
        got = _uvarint(b, i, end)
        if got is None:
            return
        tag, i = got
        wire = tag & 7
        if wire == _VARINT:
            got = _uvarint(b, i, end)
            if got is None:
                return
            j = got[1]
        elif wire == _I64:
            j = i + 8
        elif wire == _I32:
            j = i + 4
        elif wire == _LEN:
            got = _uvarint(b, i, end)
            if got is None:
                return
            n, i = got
            j = i + n
        else:
            return
        if j > end or tag >> 3 == 0:
            return
        yield tag >> 3, wire, i, j
        i = j

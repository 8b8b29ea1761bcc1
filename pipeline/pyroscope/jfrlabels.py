"""The Pyroscope Java agent's ``labels`` part -> ``LabelsSnapshot``: what the ``contextId``
and ``spanName`` numbers in a recording's events mean (``jfr.parse`` labels samples from it).

The part is protobuf (Pyroscope's ``jfr_labels.proto``: two maps), read here field by
field: every count is checked against ``Limits.max_labels``, and every failure is one
``JfrError`` starting ``labels:`` that names its byte, as the recording's are (``jfrwire``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pipeline.pyroscope.jfrwire import DEFAULT_LIMITS, JfrError, JfrTooLarge, Limits, s64


class LabelsSnapshot(NamedTuple):
    """The agent's ``labels`` part: what its ``contextId`` and ``spanName`` numbers mean."""

    contexts: dict[int, dict[str, str]]  # context id -> its labels
    strings: dict[int, str]  # string id -> string (span names are among them)


def parse_labels(data: bytes, limits: Limits = DEFAULT_LIMITS) -> LabelsSnapshot:
    """The ``labels`` part (protobuf, Pyroscope's ``jfr_labels.proto``)::

        message LabelsSnapshot { map<int64, Context> contexts = 1; map<int64, string> strings = 2; }
        message Context { map<int64, int64> labels = 1; }  // string id -> string id

    A map entry is a message of ``key = 1``, ``value = 2``; unknown fields are skipped, a
    repeated key keeps its last value (protobuf's rules). A label naming a string the
    snapshot lacks is an error. ``JfrError`` if it cannot be read, ``JfrTooLarge`` over
    ``max_labels`` (contexts, strings and labels together)."""
    data = bytes(data)
    if data[:2] == b"\x1f\x8b":
        raise JfrError("labels: the snapshot is gzip-compressed: inflate it first")
    raw: dict[int, dict[int, int]] = {}
    strings: dict[int, str] = {}
    count = 0
    try:
        for field, s, e, at in _pb_fields(data, 0, len(data)):
            count += 1
            if count > limits.max_labels:
                raise JfrTooLarge(f"labels: more than max_labels={limits.max_labels} "
                                  f"entries (byte {at})")
            if field == 1:
                key, (cs, ce) = _pb_entry(data, s, e, at, value_is_bytes=True)
                labels = raw[s64(key)] = {}
                for f, ls, le, lat in _pb_fields(data, cs, ce):
                    if f == 1:
                        count += 1
                        if count > limits.max_labels:
                            raise JfrTooLarge(f"labels: more than max_labels="
                                              f"{limits.max_labels} entries (byte {lat})")
                        k, v = _pb_entry(data, ls, le, lat, value_is_bytes=False)
                        labels[s64(k)] = s64(v)
            elif field == 2:
                key, (vs, ve) = _pb_entry(data, s, e, at, value_is_bytes=True)
                strings[s64(key)] = data[vs:ve].decode("utf-8", "replace")
    except IndexError:
        raise JfrError("labels: the snapshot ends inside a field") from None
    contexts = {}
    for cid, labels in raw.items():
        out = {}
        for k, v in labels.items():
            if k not in strings or v not in strings:
                raise JfrError(f"labels: context {cid} has a label {k}={v}; the snapshot has "
                               f"no string {k if k not in strings else v}")
            out[strings[k]] = strings[v]
        contexts[cid] = out
    return LabelsSnapshot(contexts, strings)


def _pb_var(buf: bytes, pos: int) -> tuple[int, int]:
    v = 0
    for i in range(10):
        b = buf[pos + i]
        v |= (b & 0x7F) << (7 * i)
        if b < 0x80:
            return v & 0xFFFFFFFFFFFFFFFF, pos + i + 1
    raise JfrError(f"labels: a varint of more than 10 bytes at byte {pos}")


def _pb_fields(buf: bytes, pos: int, end: int) -> Any:
    """The length-delimited fields of the message in buf[pos:end] -> (field number, start,
    end, offset of the tag); fields of other wire types are checked and skipped."""
    while pos < end:
        at = pos
        tag, pos = _pb_var(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _pb_var(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            n, pos = _pb_var(buf, pos)
            if n > end - pos:
                raise JfrError(f"labels: a field of {n} bytes at byte {at}, "
                               f"{end - pos} left")
            yield field, pos, pos + n, at
            pos += n
        else:
            raise JfrError(f"labels: wire type {wire} (field {field}) at byte {at}")
        if pos > end:
            raise JfrError(f"labels: the field at byte {at} runs past its message")


def _pb_entry(buf: bytes, pos: int, end: int, at: int,
              value_is_bytes: bool) -> tuple[int, Any]:
    """A map entry: (key, value) where the value is an integer or a (start, end) span."""
    key, value = 0, ((end, end) if value_is_bytes else 0)
    while pos < end:
        tag_at = pos
        tag, pos = _pb_var(buf, pos)
        field, wire = tag >> 3, tag & 7
        if field == 1 and wire == 0:
            key, pos = _pb_var(buf, pos)
        elif field == 2 and wire == (2 if value_is_bytes else 0):
            if value_is_bytes:
                n, pos = _pb_var(buf, pos)
                if n > end - pos:
                    raise JfrError(f"labels: a value of {n} bytes at byte {tag_at}, "
                                   f"{end - pos} left")
                value, pos = (pos, pos + n), pos + n
            else:
                value, pos = _pb_var(buf, pos)
        elif field in (1, 2):
            raise JfrError(f"labels: map entry field {field} has wire type {wire} "
                           f"(byte {tag_at})")
        elif wire == 0:
            _, pos = _pb_var(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            n, pos = _pb_var(buf, pos)
            pos += n
        else:
            raise JfrError(f"labels: wire type {wire} (field {field}) at byte {tag_at}")
        if pos > end:
            raise JfrError(f"labels: the map entry at byte {at} runs past its end")
    return key, value

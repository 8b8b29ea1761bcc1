"""Records in numbered segment files (``000000000001.log``, ...): how the sending queue
(``pipeline/exporters/clickhouse/queue.py``) and the intake
(``pipeline/receivers/intake.py``) frame, name and read back their logs; ``writer.py``
appends them.

Each record is ``length (u32) | crc32 (u32) | kind (u8) | payload``, little-endian, where
length and crc32 cover kind and payload, and the payload is msgpack. The kinds are each
log's own, but for ``FORGET`` ``[seq, ...]``, which the writer adds after a failed
``fsync``: those records were refused (their senders told to retry), never to be used,
though they may be on disk.

A record that does not check out (cut short, or a crc that does not match) ends what is
read of its segment: a write the process died in, never acknowledged.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

FORGET = 4
HEADER = struct.Struct("<II")  # length and crc32 of what follows: kind (1 byte), payload
PREFIX = HEADER.size + 1  # a record's bytes before its payload: header and kind

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()

def record(kind: int, obj: Any) -> bytearray:
    """The record of ``obj`` (msgpack) as written: encoded once, in place after room for
    its header and kind (a correlator's report is megabytes: no copy of it is made)."""
    buf = bytearray(PREFIX)
    _enc.encode_into(obj, buf, PREFIX)
    buf[HEADER.size] = kind
    body = memoryview(buf)[HEADER.size:]
    HEADER.pack_into(buf, 0, len(body), zlib.crc32(body))
    body.release()
    return buf


def segments(directory: str) -> list[tuple[int, str]]:
    """The segment files of a queue directory, oldest first: (number, path)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".log") and n[:-4].isdigit())
    return [(int(n[:-4]), os.path.join(directory, n)) for n in names]


def segment_path(directory: str, number: int) -> str:
    return os.path.join(directory, f"{number:012d}.log")


class Scan:
    """The records of one segment's bytes, in order: ``(kind, payload, size, offset)``,
    the payload decoded by ``heads[kind]`` where given (the sending queue reads a batch's
    head, not its tables), else as msgpack; ``end`` is where the good records end once
    iterated. A record that does not check out but is followed by one that does was
    damaged after it was written (a torn write is always the last): it is skipped and
    noted in ``damaged`` (offset, size), and the records after it are read."""

    def __init__(self, data: bytes,
                 heads: Mapping[int, Callable[[memoryview], Any]] | None = None) -> None:
        self.data = data
        self.heads = heads or {}
        self.end = 0
        self.damaged: list[tuple[int, int]] = []

    def _good(self, at: int) -> bool:
        """Whether a record that checks out starts at ``at``."""
        data = self.data
        if at + HEADER.size >= len(data):
            return False
        length, crc = HEADER.unpack_from(data, at)
        end = at + HEADER.size + length
        return bool(length >= 1 and end <= len(data) and zlib.crc32(
            memoryview(data)[at + HEADER.size:end]) == crc)

    def __iter__(self) -> Iterator[tuple[int, Any, int, int]]:
        data, at = self.data, 0
        view = memoryview(data)
        while at + HEADER.size < len(data):
            length, crc = HEADER.unpack_from(data, at)
            end = at + HEADER.size + length
            body = view[at + HEADER.size:end]
            if length < 1 or end > len(data):
                break
            if zlib.crc32(body) != crc:
                if not self._good(end):
                    break
                self.damaged.append((at, end - at))
                at = self.end = end
                continue
            kind = data[at + HEADER.size]
            head = self.heads.get(kind)
            yield kind, _dec.decode(body[1:]) if head is None else head(body[1:]), end - at, at
            at = self.end = end


@dataclass
class Segment:
    number: int
    path: str
    pending: int = 0  # records in it not done


def delete_done(segments: list[Segment], keep_current: bool, log: Any) -> None:
    """Delete the oldest segments while nothing in them is pending (the last, being
    written, too unless ``keep_current``); a file that cannot be deleted now is logged and
    left: read back at the next start, where nothing in it is pending either."""
    while segments and segments[0].pending <= 0 and (not keep_current or len(segments) > 1):
        seg = segments.pop(0)
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("log_segment_not_deleted", path=seg.path, error=str(err))

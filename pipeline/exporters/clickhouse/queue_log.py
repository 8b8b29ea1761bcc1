"""The sending queue's files (``queue.py``): records in numbered segment files.

Each record is ``length (u32) | crc32 (u32) | kind (u8) | payload``, little-endian, where
length and crc32 cover kind and payload, and the payload is msgpack:

* ``DATA``  ``[seq, token | None, rows, [stack ids], {table: {column: [values]}}]``: a batch;
* ``GROUP`` ``[gid, [seq, ...], token]``: these batches are inserted together under token;
* ``DONE``  ``gid``: that group is in ClickHouse;
* ``FORGET`` ``[seq, ...]``: these batches were refused (the fsync meant to cover them
  failed, their senders told to retry): never inserted, though they may be on disk.

A record that does not check out (cut short, or a crc that does not match) ends what is
read of its segment: a write the process died in, never acknowledged.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from pipeline.exporters.clickhouse.rows import Columns

DATA, GROUP, DONE, FORGET = 1, 2, 3, 4
HEADER = struct.Struct("<II")  # length and crc32 of what follows: kind (1 byte), payload

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


PREFIX = HEADER.size + 1  # a record's bytes before its payload: header and kind


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
    """The records of one segment's bytes, in order: ``(kind, payload, size, offset)``; a
    ``DATA`` record's payload without its tables (``DataHead``: they are read again when
    they are inserted, ``read_tables``); ``end`` is where the good records end once
    iterated. A record that does not check out but is followed by one that does was
    damaged after it was written (a torn write is always the last): it is skipped and
    noted in ``damaged`` (offset, size), and the records after it are read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
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
            if kind == DATA:
                yield kind, DataHead(*_head.decode(body[1:])[:4]), end - at, at
            else:
                yield kind, _dec.decode(body[1:]), end - at, at
            at = self.end = end


class DataHead(NamedTuple):
    """A ``DATA`` record's payload but its tables."""

    seq: int
    token: str | None
    rows: int
    stacks: list[Any]


# a DATA payload with its tables skipped, not decoded (msgspec.Raw: a view of the bytes)
_head = msgspec.msgpack.Decoder(tuple[int, str | None, int, list[Any], msgspec.Raw])


def read_tables(path: str, offset: int, size: int, seq: int) -> dict[str, Columns]:
    """The tables of batch ``seq``, the ``DATA`` record at ``offset`` of the segment at
    ``path`` (``size`` bytes, header included), read again from the disk. ``QueueError``
    when what is there is not that record (the file changed under the queue: the batch is
    lost); ``OSError`` as raised when the disk cannot be read now (to try again)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise QueueError(f"{path}: the record at byte {offset} is cut short")
    length, crc = HEADER.unpack_from(data, 0)
    body = memoryview(data)[HEADER.size:]
    if length != len(body) or zlib.crc32(body) != crc or body[0] != DATA:
        raise QueueError(f"{path}: the record at byte {offset} does not check out")
    try:
        payload = _dec.decode(body[1:])
        got, tables = payload[0], payload[4]
    except (msgspec.DecodeError, IndexError, KeyError, TypeError) as err:
        raise QueueError(f"{path}: the record at byte {offset} cannot be read: {err}") from err
    if got != seq or not isinstance(tables, dict):
        raise QueueError(f"{path}: the record at byte {offset} is batch {got}, not {seq}")
    return tables


@dataclass
class Record:
    seq: int
    # None: on disk only (beyond the queue's memory_mib, or read back at start), read
    # again when the record is inserted (``read_tables``)
    tables: dict[str, Columns] | None
    rows: int
    stacks: set[tuple[str, int]]  # (tenant, stack id): rows.StackKey
    token: str | None  # a Kafka block's own token: the record is a group of its own
    size: int
    segment: int  # the number of the segment it is in
    offset: int  # where in that segment (its header's first byte)
    at: float = field(default_factory=time.monotonic)


@dataclass
class Group:
    gid: int
    seqs: list[int]
    token: str
    segment: int


@dataclass
class Segment:
    number: int
    path: str
    pending: int = 0  # records and groups in it not done


class QueueError(Exception):
    """The log cannot be read or written (the exporter refuses to start on it)."""

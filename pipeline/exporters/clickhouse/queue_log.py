"""The sending queue's records (``queue.py``), in ``pipeline/disklog``'s segment files:

* ``DATA``  ``[seq, token | None, rows, [stack ids], {table: {column: [values]}}]``: a batch;
* ``GROUP`` ``[gid, [seq, ...], token]``: these batches are inserted together under token;
* ``DONE``  ``gid``: that group is in ClickHouse;
* ``FORGET`` ``[seq, ...]``: these batches were refused (the fsync meant to cover them
  failed, their senders told to retry): never inserted, though they may be on disk.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from pipeline.disklog.segments import HEADER, Scan
from pipeline.exporters.clickhouse.rows import Columns

DATA, GROUP, DONE = 1, 2, 3  # and the writer's FORGET (4)
_dec = msgspec.msgpack.Decoder()


class DataHead(NamedTuple):
    """A ``DATA`` record's payload but its tables."""

    seq: int
    token: str | None
    rows: int
    stacks: list[Any]


# a DATA payload with its tables skipped, not decoded (msgspec.Raw: a view of the bytes)
_head = msgspec.msgpack.Decoder(tuple[int, str | None, int, list[Any], msgspec.Raw])


def scan(data: bytes) -> Scan:
    """A segment's records (``Scan``), a ``DATA`` record's payload without its tables
    (``DataHead``: they are read again when they are inserted, ``read_tables``)."""
    return Scan(data, {DATA: lambda body: DataHead(*_head.decode(body)[:4])})


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


class QueueError(Exception):
    """The log cannot be read or written (the exporter refuses to start on it)."""

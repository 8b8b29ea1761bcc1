"""The sending queue's files (``queue.py``): records in numbered segment files.

Each record is ``length (u32) | crc32 (u32) | kind (u8) | payload``, little-endian, where
length and crc32 cover kind and payload, and the payload is msgpack:

* ``DATA``  ``[seq, token | None, rows, [stack ids], {table: {column: [values]}}]``: a batch;
* ``GROUP`` ``[gid, [seq, ...], token]``: these batches are inserted together under token;
* ``DONE``  ``gid``: that group is in ClickHouse.

A record that does not check out (cut short, or a crc that does not match) ends what is
read of its segment: a write the process died in, never acknowledged.

A segment starts as a *spare*: a file of zeros made ahead in the background, written out and
fsynced, then renamed into place when the previous segment is full. Records overwrite its
zeros, so an append changes no file size and no block map, and ``fdatasync`` has only the
record's own pages to write: no journal commit, which on ext4 would also wait for every
other file's dirty data (ClickHouse writing its parts beside us). A zero length ends the
scan as any record that does not check out does.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.exporters.clickhouse.rows import Columns

DATA, GROUP, DONE = 1, 2, 3
HEADER = struct.Struct("<II")  # length and crc32 of what follows: kind (1 byte), payload

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def encode(obj: Any) -> bytes:
    return _enc.encode(obj)


def record(kind: int, payload: bytes) -> bytes:
    body = bytes([kind]) + payload
    return HEADER.pack(len(body), zlib.crc32(body)) + body


def segments(directory: str) -> list[tuple[int, str]]:
    """The segment files of a queue directory, oldest first: (number, path)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".log") and n[:-4].isdigit())
    return [(int(n[:-4]), os.path.join(directory, n)) for n in names]


def segment_path(directory: str, number: int) -> str:
    return os.path.join(directory, f"{number:012d}.log")


SPARE = "spare.seg"  # the next segment, zeros; never read as a segment (no .log)


def make_spare(directory: str, size: int, tag: str) -> None:
    """Write ``size`` zero bytes to a new file and fsync it, then rename it to the spare.
    ``tag`` keeps the half-written file of one queue apart from another's."""
    part = os.path.join(directory, f"{SPARE}.{tag}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        zeros = bytes(min(size, 1 << 20))
        left = size
        while left > 0:
            left -= os.write(fd, zeros[:left])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(part)
        raise
    os.close(fd)
    os.rename(part, os.path.join(directory, SPARE))


def remove_spares(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(SPARE):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def open_segment(directory: str, number: int) -> tuple[int, bool]:
    """Open segment ``number`` for writing: the spare renamed into place if there is one
    (True), else a new empty file. The directory entry is made durable by ``sync_dir``."""
    path = segment_path(directory, number)
    try:
        os.rename(os.path.join(directory, SPARE), path)
        return os.open(path, os.O_WRONLY), True
    except FileNotFoundError:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), False


def retire(fd: int, directory: str) -> None:
    """Once appends have moved to a new segment: make what ``fd`` (the old one, or -1)
    holds durable and close it, and the directory entries (the new segment's name)."""
    if fd >= 0:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def only_zeros(data: bytes, at: int) -> bool:
    """Whether what follows the last good record is a spare's untouched zeros (not a torn
    write)."""
    return data.count(0, at) == len(data) - at


class Scan:
    """The records of one segment's bytes, in order: ``(kind, payload, size)``; ``end`` is
    where the good records end once iterated."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.end = 0

    def __iter__(self) -> Iterator[tuple[int, Any, int]]:
        data, at = self.data, 0
        while at + HEADER.size < len(data):
            length, crc = HEADER.unpack_from(data, at)
            end = at + HEADER.size + length
            if length < 1 or end > len(data) or zlib.crc32(data[at + HEADER.size:end]) != crc:
                break
            kind = data[at + HEADER.size]
            yield kind, _dec.decode(data[at + HEADER.size + 1:end]), end - at
            at = self.end = end


@dataclass
class Record:
    seq: int
    tables: dict[str, Columns]
    rows: int
    stacks: set[int]
    token: str | None  # a Kafka block's own token: the record is a group of its own
    size: int
    segment: int  # the number of the segment it is in
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

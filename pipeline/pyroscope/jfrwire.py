"""The JFR wire as Java profilers write it: errors, limits, the chunk header, integers,
strings. ``jfrmeta.py`` reads the metadata event with it, ``jfr.py`` recordings;
``jfrlabels.py`` reads the agent's labels snapshot (protobuf).

Facts of the format used here (JDK's JFR file format, as async-profiler writes it):

* a chunk starts with a 68-byte big-endian header: magic ``FLR\\0``, major and minor version
  (2 bytes each), then 8 bytes each: chunk size, constant pool and metadata offsets, start
  time (ns), duration (ns), start ticks, ticks per second; then 4 bytes of features;
* integers are LEB128-style varints when the chunk header's feature bit 0 ("compressed
  integers") is set (always, for async-profiler and the JDK): 7 bits a byte, low bits first,
  the 9th byte whole; ``int``s are their unsigned 32-bit pattern (-1: 5 bytes). Writers pad
  some sizes (5-byte varints patched later), so non-minimal encodings are valid;
* a string starts with an encoding byte: 0 null, 1 empty, 2 a reference into the string
  constant pool (a varint), 3 UTF-8 and 5 Latin-1 (a varint length then the bytes), 4 a
  UTF-16 char array (a varint length then one varint per char).

Nothing read is trusted: every count and length is checked against the bytes left and
against ``Limits`` before anything is allocated for it, and every failure is one
``JfrError`` naming what was wrong and its byte offset in the recording.
"""

from __future__ import annotations

import re
import struct
from typing import Any, NamedTuple

from pipeline.errors import InvalidData, TooLarge
from pipeline.otlp.bounds import MAX_STACK_DEPTH


class JfrError(InvalidData, ValueError):
    """A JFR recording or labels snapshot that cannot be read; the message says what was
    wrong and at which byte."""


class JfrTooLarge(JfrError, TooLarge):
    """Within the format but over one of the ``Limits``; the message names the limit."""


class Limits(NamedTuple):
    """What one recording (and its labels snapshot) may hold. Each is checked before the
    memory for it is taken."""

    max_events: int = 1_000_000  # events of every type, in all chunks
    max_stack_depth: int = MAX_STACK_DEPTH  # frames of one stack trace
    max_pool_entries: int = 1_000_000  # constant-pool entries, all pools of all chunks
    max_string_bytes: int = 64 << 20  # bytes of all strings decoded (metadata, pools, events)
    max_frames: int = 4_000_000  # stack frames decoded in all stack traces
    max_chunks: int = 256  # chunks in one recording
    max_metadata_elements: int = 100_000  # elements of one chunk's metadata tree
    max_labels: int = 1_000_000  # contexts, strings and labels of one labels snapshot


DEFAULT_LIMITS = Limits()


class Budget:
    """What a recording has used of its ``Limits`` so far."""

    __slots__ = ("limits", "events", "entries", "string_bytes", "frames")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.events = self.entries = self.string_bytes = self.frames = 0

    def _over(self, key: str, at: int) -> JfrTooLarge:
        return JfrTooLarge(f"jfr: more than {key}={getattr(self.limits, key)} "
                           f"(at byte {at})")

    def take_entries(self, n: int, at: int) -> None:
        self.entries += n
        if self.entries > self.limits.max_pool_entries:
            raise self._over("max_pool_entries", at)

    def take_string(self, n: int, at: int) -> None:
        self.string_bytes += n
        if self.string_bytes > self.limits.max_string_bytes:
            raise self._over("max_string_bytes", at)

    def take_frames(self, n: int, at: int) -> None:
        if n > self.limits.max_stack_depth:
            raise JfrTooLarge(f"jfr: a stack trace of {n} frames, more than max_stack_depth="
                              f"{self.limits.max_stack_depth} (at byte {at})")
        self.frames += n
        if self.frames > self.limits.max_frames:
            raise self._over("max_frames", at)


HEADER_SIZE = 68


class ChunkHeader(NamedTuple):
    size: int  # bytes in the chunk, its header included
    start_ns: int  # Unix ns
    duration_ns: int
    start_ticks: int  # the ticks at start_ns
    tps: int  # ticks per second; never 0


def read_header(data: bytes, pos: int) -> ChunkHeader:
    """The header of the chunk at byte ``pos``; ``JfrError`` unless it is a 2.x header with
    compressed integers, ticks per second, and a size within ``data``."""
    h = data[pos:pos + HEADER_SIZE]
    if len(h) < HEADER_SIZE:
        raise JfrError(f"jfr: {len(h)} bytes at byte {pos}, fewer than a chunk header's")
    if h[:4] != b"FLR\0":
        raise JfrError(f"jfr: no chunk magic FLR\\0 at byte {pos} (found {h[:4]!r})")
    major = int.from_bytes(h[4:6], "big")
    size, _, _, start_ns, duration_ns, start_ticks, tps = (
        int.from_bytes(h[i:i + 8], "big") for i in range(8, 64, 8))
    features = int.from_bytes(h[64:68], "big")
    if major != 2:
        raise JfrError(f"jfr: chunk version {major}.x at byte {pos}; only 2.x is read")
    if not features & 1:
        raise JfrError(f"jfr: the chunk at byte {pos} has fixed-size integers (features "
                       f"{features:#x}); only compressed integers are read")
    if not HEADER_SIZE <= size <= len(data) - pos:
        raise JfrError(f"jfr: the chunk at byte {pos} says it has {size} bytes; "
                       f"{len(data) - pos} are left")
    if tps == 0:
        raise JfrError(f"jfr: the chunk at byte {pos} has 0 ticks per second")
    return ChunkHeader(size, start_ns, duration_ns, start_ticks, tps)


def uvar(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` -> (unsigned value, next position); IndexError past the end
    of ``buf`` (callers hand each event its own bytes, so that is the event's end)."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    v = b & 0x7F
    for shift in (7, 14, 21, 28, 35, 42, 49):
        pos += 1
        b = buf[pos]
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos + 1
    return v | (buf[pos + 1] << 56), pos + 2


# One varint: up to 8 bytes with the high bit set and one without, or 9 bytes. findall
# splits a run of varints exactly as reading them one after the other does, in C.
VARINTS = re.compile(rb"[\x80-\xff]{0,8}[\x00-\x7f]|[\x80-\xff]{8}[\x00-\xff]")
# the value of every varint of one or two bytes
SHORT_VARINTS = {bytes([b]): b for b in range(0x80)} | {
    bytes([lo, hi]): (lo & 0x7F) | (hi << 7) for lo in range(0x80, 0x100) for hi in range(0x80)}


def varint_value(v: bytes) -> int:
    """The value of one varint's bytes (as VARINTS matches them): the 7-bit groups of the
    first 8 bytes packed together in three mask-and-shift steps, then the 9th byte."""
    x = int.from_bytes(v[:8], "little") & 0x7F7F7F7F7F7F7F7F
    x = (x & 0x007F007F007F007F) | ((x & 0x7F007F007F007F00) >> 1)
    x = (x & 0x00003FFF00003FFF) | ((x & 0x3FFF00003FFF0000) >> 2)
    x = (x & 0x000000000FFFFFFF) | ((x & 0x0FFFFFFF00000000) >> 4)
    return x | (v[8] << 56) if len(v) == 9 else x


def s64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class PoolString(int):
    """A string written as a reference to the string constant pool (encoding 2); it is
    looked up once the pools are read."""


def read_string(buf: bytes, pos: int, budget: Budget, base: int) -> tuple[Any, int]:
    """A string at ``pos`` -> (str, None for null, or a PoolString; next position)."""
    enc = buf[pos]
    pos += 1
    if enc == 0:
        return None, pos
    if enc == 1:
        return "", pos
    if enc == 2:
        ref, pos = uvar(buf, pos)
        return PoolString(ref), pos
    if enc not in (3, 4, 5):
        raise JfrError(f"jfr: unknown string encoding {enc} at byte {base + pos - 1}")
    n, start = uvar(buf, pos)
    left = len(buf) - start
    if n > left:
        raise JfrError(f"jfr: a string of {n} bytes at byte {base + pos}, {left} left")
    budget.take_string(n, base + pos)
    if enc == 3:
        return buf[start:start + n].decode("utf-8", "replace"), start + n
    if enc == 5:
        return buf[start:start + n].decode("latin-1"), start + n
    units = []  # UTF-16 code units, one varint each (so at most one per byte left)
    p = start
    for _ in range(n):
        u, p = uvar(buf, p)
        units.append(u & 0xFFFF)
    return struct.pack(f">{n}H", *units).decode("utf-16-be", "replace"), p

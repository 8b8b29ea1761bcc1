"""Stacks of one request, built within a budget: OTLP profiles and pprof share this.

A stack is cheap to *reference* and expensive to *build*: one location id in the input
(a byte) can stand for a location with many inlined lines, whose names are hashed into
the stack id. Without a budget a few hundred kilobytes of stacks that reference the same
locations again and again became gigabytes of frames. So each location is resolved once
(``Frames``, with the bytes its frames feed the stack hash), and every new stack is
checked against the request's budget *before* its lists are allocated:

* depth: at most ``max_depth`` frames in one stack (inlined lines included);
* frames: at most ``FRAME_FANOUT`` frames per location reference seen, plus
  ``FRAME_SLACK``: output stays a small multiple of the input;
* text: at most ``MAX_FRAME_TEXT`` characters of names hashed per request.

``stack_hash`` is unchanged (ids already stored stay valid): hashing a stack is hashing
the concatenation of its locations' pre-encoded frame bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

from pipeline.otlp.bounds import FRAME_FANOUT, FRAME_SLACK, MAX_FRAME_TEXT, MAX_STACK_DEPTH
from pipeline.records import Stack

_LINE = struct.Struct("<q")


class StackRefused(ValueError):
    """A stack (or location) over the request's budget; the message names the limit."""


class Frames(NamedTuple):
    """One resolved location: its frames, innermost first, and their hash input."""

    functions: tuple[str, ...]
    files: tuple[str, ...]
    lines: tuple[int, ...]
    text: bytes


def _frame_bytes(fn: str, fl: str, line: int) -> bytes:
    return b"".join((fn.encode(), b"\x00", fl.encode(), _LINE.pack(line)))


def stack_hash(functions: list[str], files: list[str], lines: list[int]) -> int:
    """A 63-bit id of a stack's frames, identical for identical stacks from any request."""
    h = hashlib.blake2b(digest_size=8)
    for fn, fl, ln in zip(functions, files, lines, strict=True):
        h.update(_frame_bytes(fn, fl, ln))
    return int.from_bytes(h.digest(), "little") >> 1


class StackTable:
    """The stacks one request built, by id, and what building them has cost so far."""

    def __init__(self, max_depth: int = MAX_STACK_DEPTH, max_text: int = MAX_FRAME_TEXT,
                 depth_key: str = "") -> None:
        self.max_depth = max_depth
        self.depth_key = f" ({depth_key})" if depth_key else ""
        self.max_text = max_text
        self.stacks: dict[int, Stack] = {}
        self.refs = 0
        self.frames = 0
        self.text = 0

    def check_depth(self, n: int, what: str) -> None:
        """Before resolving anything: every location is at least one frame."""
        if n > self.max_depth:
            raise StackRefused(f"{what} has {n} frames, over the stack depth limit "
                               f"{self.max_depth}{self.depth_key}")

    def location(self, frames: Sequence[tuple[str, str, int]], what: str) -> Frames:
        """One location's frames (function, file, line), innermost first."""
        self.check_depth(len(frames), what)
        self._spend_text(sum(len(fn) + len(fl) for fn, fl, _ in frames), what)
        if not frames:
            return Frames((), (), (), b"")
        fns, files, lines = zip(*frames, strict=True)
        text = b"".join(_frame_bytes(fn, fl, ln) for fn, fl, ln in frames)
        return Frames(fns, files, lines, text)

    def spend(self, locs: Sequence[Frames], what: str) -> None:
        """Charge a stack of these locations to the request's budget, building nothing (a
        gateway's checks: the stack itself is built where it is stored)."""
        depth = sum(len(f.functions) for f in locs)
        self.check_depth(depth, what)
        self.refs += len(locs)
        self.frames += depth
        if self.frames > FRAME_FANOUT * self.refs + FRAME_SLACK:
            raise StackRefused(f"{what}: the request's stacks expand to {self.frames} frames "
                               f"from {self.refs} location references, over {FRAME_FANOUT} "
                               f"per reference (+{FRAME_SLACK})")
        self._spend_text(sum(len(f.text) for f in locs), what)

    def stack(self, locs: Sequence[Frames], what: str) -> int:
        """The id of the stack of these locations (leaf first), built if new."""
        self.spend(locs, what)
        h = hashlib.blake2b(digest_size=8)
        for f in locs:
            h.update(f.text)
        sid = int.from_bytes(h.digest(), "little") >> 1
        if sid not in self.stacks:
            self.stacks[sid] = Stack(
                sid, list(chain.from_iterable(f.functions for f in locs)),
                list(chain.from_iterable(f.files for f in locs)),
                list(chain.from_iterable(f.lines for f in locs)))
        return sid

    def _spend_text(self, n: int, what: str) -> None:
        self.text += n
        if self.text > self.max_text:
            raise StackRefused(f"{what}: the request's stacks hash more than {self.max_text} "
                               "bytes of function and file names")

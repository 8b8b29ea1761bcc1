"""What the correlator keeps of a span, and the entries that hold a span's data.

``SpanInfo`` is what a sample's row needs of its span (operation, parent, time) and what
placement needs (thread, process); ``Tree`` the known spans of one trace, walked from a
span to its children and ancestors; ``Pending`` a span (held for ``grace``, or reported and
receiving late samples) with what has been joined to it; ``Orphan`` the samples of a span
not seen yet. ``SLOT_NS`` and ``MAX_SLOTS`` shape the time index of known spans, by
service and second, in which unlabelled samples find the spans open at their instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pipeline.records import Sample
from processors.correlate.accumulators import Acc

SLOT_NS = 1_000_000_000  # the time index for unlabelled samples: one-second slots
MAX_SLOTS = 3600  # a span longer than an hour is matched in its first hour only


# gc=False (here and in Pending): hundreds of thousands are held at once, and the garbage
# collector scanning them made every collection of the young generations 60-150 ms at
# 10 k spans/s with a 60 s grace; they hold no cycles (refcounting frees them)
class SpanInfo(msgspec.Struct, gc=False):
    service: str
    name: str
    parent_span_id: bytes
    start_ns: int
    duration_ns: int
    thread_id: int = 0
    pid: int = 0
    host: str = ""

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


class Pending(msgspec.Struct, gc=False):
    info: SpanInfo
    acc: Acc
    ready_at: float


class Tree:
    """The known spans of one trace, with a children index built when first needed, and
    ``waiting``: CPU of known spans whose parent is not known yet, by parent id, then
    (service, method), to be added to that parent's inclusive CPU (and up) when it comes."""

    __slots__ = ("spans", "_children", "waiting", "_shares")

    def __init__(self) -> None:
        self.spans: dict[bytes, SpanInfo] = {}
        self._children: dict[bytes, list[bytes]] | None = None
        self.waiting: dict[bytes, dict[tuple[str, str], int]] | None = None
        # tuples, not lists: a list is always tracked by the garbage collector, and one
        # (mostly empty) per span asked about was most of what it scanned of held state
        self._shares: dict[bytes, tuple[tuple[bytes, int], ...]] | None = None

    def add(self, span_id: bytes, info: SpanInfo) -> None:
        self.spans[span_id] = info
        self._children = None
        self._shares = None

    def remove(self, span_id: bytes) -> None:
        self.spans.pop(span_id, None)
        self._children = None
        self._shares = None

    def shares(self, span_id: bytes) -> tuple[tuple[bytes, int], ...]:
        """How an untimed sample labelled ``span_id`` is shared in its subtree: each span of
        the labelled span's service below it (and the span itself, first) with its self
        time, its duration less the union of its same-service children's (clipped to it).
        Empty where the span has no such child: the sample stays on its label."""
        if len(self.spans) == 1 or not self.children(span_id):
            return ()  # a leaf (half the spans of any tree, a trace's only one): nothing below
        if self._shares is None:
            self._shares = {}
        got = self._shares.get(span_id)
        if got is not None:
            return got
        info = self.spans.get(span_id)
        out: list[tuple[bytes, int]] = []
        if info is not None and info.duration_ns > 0:
            seen = {span_id}
            todo = [span_id]
            while todo:
                sid = todo.pop()
                s = self.spans[sid]
                kids = [c for c in self.children(sid) if c not in seen
                        and self.spans[c].service == info.service]
                out.append((sid, max(0, s.duration_ns - _covered(
                    s, [self.spans[c] for c in kids]))))
                seen.update(kids)
                todo.extend(kids)
            if len(out) == 1 or not any(w for _, w in out[1:]):
                out = []
        got = self._shares[span_id] = tuple(out)
        return got

    def children(self, span_id: bytes) -> list[bytes]:
        if self._children is None:
            ch: dict[bytes, list[bytes]] = {}
            for sid, info in self.spans.items():
                if info.parent_span_id:
                    ch.setdefault(info.parent_span_id, []).append(sid)
            self._children = ch
        return self._children.get(span_id, [])


def _covered(parent: SpanInfo, children: list[SpanInfo]) -> int:
    """How much of ``parent``'s time its ``children`` cover (their union, clipped)."""
    lo_end, hi_end = parent.start_ns, parent.end_ns
    spans = sorted((max(c.start_ns, lo_end), min(c.end_ns, hi_end)) for c in children)
    total, cur_lo, cur_hi = 0, 0, -1
    for lo, hi in spans:
        if hi <= lo:
            continue
        if lo > cur_hi:
            total += max(0, cur_hi - cur_lo)
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    return total + max(0, cur_hi - cur_lo)


@dataclass(slots=True)
class Orphan:
    acc: Acc
    timed: list[tuple[Sample, str]] = field(default_factory=list)  # placed when the span comes

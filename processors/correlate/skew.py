"""Clock skew between a process's profiler and the tracer, learnt from labelled samples.

A timed sample is placed by comparing its instant, from the profiler's clock, with span
start and end times, from the tracer's; where the two clocks differ, it would land in the
wrong span. ``CorrelatorState`` keeps one ``Skew`` per process (service, pid, host) and
takes its estimate off sample times before placing them.
"""

from __future__ import annotations

import heapq


class Skew:
    """How far a profiler's clock is off the tracer's, per process, learnt from labelled
    timed samples: a sample of span S was taken within S, so ``t - S.end <= skew <= t -
    S.start``. The tightest bounds over many samples bracket the skew. Where they admit no
    skew at all (``lo <= 0 <= hi``: the usual case, both clocks being the host's), none is
    taken off: a midpoint there would be biased by off-CPU time at one end of the spans (a
    span that waits 30 ms after its last sample moves ``lo`` 30 ms down, not ``hi``).
    Where they prove a skew, their midpoint (the least worst-case error) is subtracted
    from sample times before they are placed. Bounds restart every ``WINDOW`` samples (the
    previous estimate stays in use until the new one has ``MIN`` samples), so drift is
    followed. Each bound is the ``TRIM``-th tightest, not the tightest: a sample whose
    label outlived its span (a thread stalled, by a collection say, between the span's end
    and the profiler's label being cleared) is one sample past its span's end, and must
    not prove a skew that moves every sample of the process; a real skew moves them all."""

    WINDOW = 5000
    MIN = 20
    TRIM = 4
    __slots__ = ("_lo", "_hi", "n", "estimate")

    def __init__(self) -> None:
        self._lo: list[int] = []  # the TRIM largest t - end (a min-heap)
        self._hi: list[int] = []  # the TRIM smallest t - start, negated (a min-heap)
        self.n = 0
        self.estimate = 0

    @property
    def lo(self) -> int:
        return self._lo[0] if len(self._lo) >= self.TRIM else -(1 << 62)

    @property
    def hi(self) -> int:
        return -self._hi[0] if len(self._hi) >= self.TRIM else 1 << 62

    def observe(self, t: int, start: int, end: int) -> None:
        if self.n >= self.WINDOW:
            self._lo, self._hi, self.n = [], [], 0
        for heap, v in ((self._lo, t - end), (self._hi, start - t)):
            if len(heap) < self.TRIM:
                heapq.heappush(heap, v)
            elif v > heap[0]:
                heapq.heapreplace(heap, v)
        self.n += 1
        if self.n >= self.MIN:
            lo, hi = self.lo, self.hi
            self.estimate = 0 if lo <= 0 <= hi else (lo + hi) // 2

"""Clock skew between a process's profiler and the tracer, learnt from labelled samples.

A timed sample is placed by comparing its instant, from the profiler's clock, with span
start and end times, from the tracer's; where the two clocks differ, it would land in the
wrong span. ``CorrelatorState`` keeps one ``Skew`` per process (service, pid, host) and
takes its estimate off sample times before placing them.
"""

from __future__ import annotations


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
    followed."""

    WINDOW = 5000
    MIN = 20
    __slots__ = ("lo", "hi", "n", "estimate")

    def __init__(self) -> None:
        self.lo = -(1 << 62)
        self.hi = 1 << 62
        self.n = 0
        self.estimate = 0

    def observe(self, t: int, start: int, end: int) -> None:
        if self.n >= self.WINDOW:
            self.lo, self.hi, self.n = -(1 << 62), 1 << 62, 0
        self.lo = max(self.lo, t - end)
        self.hi = min(self.hi, t - start)
        self.n += 1
        if self.n >= self.MIN:
            self.estimate = 0 if self.lo <= 0 <= self.hi else (self.lo + self.hi) // 2

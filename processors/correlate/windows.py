"""When what the correlator holds leaves it: after its window, or early at the bounds.

Input is held for windows of ``now``, the state's explicit clock: a timed sample for
``grace`` after it came, so that the spans running at its instant are known when it is
placed (``_place_held``); a span for ``grace`` after it came, so that samples uploaded
after it join its first rows; an orphan for ``orphan_timeout`` after its first sample; a
reported span's marker for ``late_window``, its late samples reported at the next flush.
``take_due`` places and reports what is due (all of it when forced, at shutdown);
``oldest_held`` dates the oldest input not reported yet, the correlator's checkpoint.

Every report is a *delta* row and a span's totals are the sum of its rows, so a late sample
adds to the span rather than replacing or vanishing, and CPU is conserved: what comes in is
reported on a span or as unattributed, exactly once. Rows carry self CPU (``cpu_ns``) and
inclusive CPU (self plus the descendants in the same service, ``inclusive_cpu_ns``): a sample
placed in a span adds to the inclusive CPU of its known ancestors too.

Memory is bounded twice: by ``max_entries`` (held spans, sample groups and timed samples)
and by ``max_bytes``, an estimate kept as entries come and go (``bytes``, see ``sizes``).
Beyond either, markers of reported spans are dropped first, then what ``frames`` learnt
(neither loses data), then the oldest entries are reported early, counted in ``evicted``:
their CPU is reported, never dropped.

``Windows`` holds these methods of ``CorrelatorState``; the tables are the state's,
declared here for the type checker only.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque
from itertools import islice

from pipeline.records import Attribution, AttributionBatch, Sample, Unattributed
from processors.correlate.accumulators import LINK, Acc, Key, add, attribution
from processors.correlate.messages import random_source
from processors.correlate.sizes import ACC_BYTES, ITEM_BYTES, SAMPLE_BYTES
from processors.correlate.skew import Skew
from processors.correlate.spans import SpanInfo
from processors.correlate.timed import TimedPlacement


class Windows(TimedPlacement):
    """Holding input for its windows and reporting it: a part of ``CorrelatorState`` (see
    the module)."""

    grace: float
    orphan_timeout: float
    late_window: float
    max_entries: int
    max_bytes: int
    held: deque[tuple[float, Sample, str]]
    _evicted: list[tuple[Key, SpanInfo | None, Acc]]
    _early: list[tuple[float, Key]]

    @property
    def entries(self) -> int:
        """Entries held for their window (what ``max_entries`` bounds)."""
        return (len(self.spans) + len(self.orphans) + len(self.late) + len(self.held)
                + self._orphan_timed)

    @property
    def bytes(self) -> int:
        """Estimated memory held (what ``max_bytes`` bounds)."""
        accs = len(self.spans) + len(self.orphans) + len(self.late) + len(self.unattributed)
        return (self._span_bytes + ACC_BYTES * accs + ITEM_BYTES * self._items
                + SAMPLE_BYTES * (len(self.held) + self._orphan_timed) + self.frames.bytes)

    def _over(self) -> bool:
        return self.entries > self.max_entries or self.bytes > self.max_bytes

    def oldest_held(self) -> float | None:
        """A lower bound on the arrival (clock of ``now``) of the input held unreported, or
        None when nothing is held: the correlator's checkpoint, from which a restart after
        a crash finds the traces whose rows it may have lost (``recovery``).

        A span's accumulator dates from its span's arrival (or its first sample's), and that
        span is in the store, so its trace is found. Accumulators created when a timed
        sample was placed (orphans, late, unattributed, evicted) date from the placement,
        up to ``grace`` (plus one flush) after the sample arrived: ``grace`` is taken off
        them, and the connector's margin covers the flush."""
        # held spans and orphans are in arrival order, so the first of each is the oldest
        # (a scan of every held span took 50 ms at 200 000): but for spans whose samples
        # came first (``_early``, their accumulator dates from the samples)
        times = []
        first = next(iter(self.spans.values()), None)
        if first is not None:
            times.append(first.acc.since)
        early = self._prune_early()
        if early:
            times.append(early[0][0])
        first_orphan = next(iter(self.orphans.values()), None)
        if first_orphan is not None:
            times.append(first_orphan.acc.since - self.grace)
        times += [p.acc.since - self.grace for p in self.late.values()]
        times += [a.since - self.grace for a in self.unattributed.values()]
        times += [a.since - self.grace for _, _, a in self._evicted]
        if self.held:
            times.append(self.held[0][0])  # appended in arrival order
        return min(times) if times else None

    def _prune_early(self) -> list[tuple[float, Key]]:
        """``_early`` without the stale entries at its top (spans reported since, or whose
        entry was replaced); at every flush too, so that it stays about as large as the
        spans it names."""
        early = self._early
        while early and ((p := self.spans.get(early[0][1])) is None
                         or p.acc.since != early[0][0]):
            heapq.heappop(early)
        return early

    def _place_held(self, now: float, force: bool) -> None:
        held = self.held
        due: list[tuple[Sample, str]] = []
        while held and (force or held[0][0] + self.grace <= now or self._over()):
            _, smp, leaf = held.popleft()
            due.append((smp, leaf))
        # first learn the clock skew from the labelled ones, then place them all
        for smp, _ in due:
            if smp.span_id:
                info = self._info(self._key(smp))
                if info is not None and info.duration_ns:
                    pkey = (smp.service, smp.pid, smp.host)
                    sk = self.skews.get(pkey)
                    if sk is None:
                        sk = self.skews[pkey] = Skew()
                    sk.observe(smp.time_ns, info.start_ns, info.end_ns)
        self._place_due(due, now)
        if force or not (self.held or self._orphan_timed):
            # no sample waits for its stack; forced (shutdown): what was learnt goes too
            self.frames.clear(learnt=force)

    def _pop_orphan(self, key: Key) -> Acc:
        """Take an orphan out for reporting: its span never came (or memory is short), so
        its timed samples go on the label as they are."""
        orphan = self.orphans.pop(key)
        self._items -= orphan.acc.items()
        for smp, leaf in orphan.timed:
            add(orphan.acc.m(LINK), smp.measure, smp.value, smp.count, leaf, smp.stack_id)
        self._orphan_timed -= len(orphan.timed)
        return orphan.acc

    def has_due(self, now: float, force: bool = False) -> bool:
        """Whether ``take_due`` would report a held span, late entry or orphan (what its
        ``limit`` counts)."""
        if force:
            return bool(self.spans or self.late or self.orphans)
        first = next(iter(self.spans.values()), None)
        # orphans come in arrival order, so the first is the oldest (were one out of order,
        # the next flush would report it)
        orphan = next(iter(self.orphans.values()), None)
        return bool(self.late or (first is not None and first.ready_at <= now)
                    or (orphan is not None and orphan.acc.since + self.orphan_timeout <= now))

    def take_due(self, now: float, force: bool = False,
                 limit: int | None = None) -> AttributionBatch:
        """Remove and return every report that is due (all of them when ``force``); with
        ``limit``, those of at most that many held spans, late entries and orphans, oldest
        first (``has_due`` then says whether more are due): a report's rows are built a
        piece at a time, not all at once (at shutdown, everything held)."""
        budget = limit if limit is not None else sys.maxsize
        self._place_held(now, force)
        rows: list[Attribution] = []
        for key, info, acc in self._evicted:
            rows.extend(_rows(key, info, acc))
        self._evicted.clear()

        # in arrival order, so in ready_at order (now + grace, the clock monotonic): the due
        # ones are a prefix, and the scan stops at the first not due (not all held spans)
        due: list[Key] = []
        for k, p in self.spans.items():
            if (not force and p.ready_at > now) or len(due) >= budget:
                break
            due.append(k)
        budget -= len(due)
        for key in due:
            p = self.spans.pop(key)
            self._items -= p.acc.items()
            rows.extend(_rows(key, p.info, p.acc))
            self.emitted[key] = (now + self.late_window, p.info)
        self._prune_early()
        for key in list(islice(self.late, budget)):
            late = self.late.pop(key)
            self._items -= late.acc.items()
            rows.extend(_rows(key, late.info, late.acc))
            self.stats.late_reported += 1
            budget -= 1
        orphans: list[Key] = []
        for k, o in self.orphans.items():
            if len(orphans) >= budget:
                break
            if force or o.acc.since + self.orphan_timeout <= now:
                orphans.append(k)
        for key in orphans:
            rows.extend(_rows(key, None, self._pop_orphan(key)))
            self.stats.orphans_reported += 1

        unattributed = []
        for (svc, minute), a in self.unattributed.items():
            m = a.m(LINK)
            unattributed.append(Unattributed(svc, minute, m.cpu_ns, m.wall_ns, m.count,
                                             random_source()))
        self.unattributed.clear()
        while self.emitted:
            key, (expires, info) = next(iter(self.emitted.items()))
            if expires > now and not force:
                break
            del self.emitted[key]
            if key not in self.spans:
                self._forget(key, info)
        self.stats.rows_out += len(rows)
        return AttributionBatch(rows, unattributed)

    def shrink_to(self, max_entries: int, max_bytes: int, now: float) -> None:
        """Report the oldest entries early until at most ``max_entries`` and ``max_bytes``
        are held (the bounds of all tenants' states together, ``connector``)."""
        saved = self.max_entries, self.max_bytes
        self.max_entries, self.max_bytes = max(0, max_entries), max(0, max_bytes)
        try:
            self._bound(now)
        finally:
            self.max_entries, self.max_bytes = saved

    def _bound(self, now: float) -> None:
        """Keep held entries within ``max_entries`` and ``max_bytes`` by reporting the
        oldest ones early."""
        if self.held and self._over():
            self._place_held(now, force=False)  # places the oldest held samples first
        while len(self.emitted) and (self.entries + len(self.emitted) > self.max_entries
                                     or self.bytes > self.max_bytes):
            key, (_, info) = self.emitted.popitem(last=False)  # losing a marker loses no data
            if key not in self.spans:
                self._forget(key, info)
        if self._over() and self.frames.bytes:
            self.frames.clear()  # only placement by stack is lost
        while self._over():
            # the oldest held entry of the three kinds is reported first
            heads: list[tuple[float, str, Key]] = []
            for kind, table in (("span", self.spans), ("late", self.late)):
                first = next(iter(table.items()), None)
                if first is not None:
                    heads.append((first[1].acc.since, kind, first[0]))
            first_orphan = next(iter(self.orphans.items()), None)
            if first_orphan is not None:
                heads.append((first_orphan[1].acc.since, "orphan", first_orphan[0]))
            if not heads:
                break
            _, kind, key = min(heads)
            if kind == "orphan":
                self._evicted.append((key, None, self._pop_orphan(key)))
            else:
                p = (self.spans if kind == "span" else self.late).pop(key)
                self._items -= p.acc.items()
                self._evicted.append((key, p.info, p.acc))
                if kind == "span" or key in self.emitted:  # a late entry's marker may be gone
                    self.emitted[key] = (now + self.late_window, p.info)
                    self.emitted.move_to_end(key)
            self.stats.evicted += 1


def _rows(key: Key, info: SpanInfo | None, acc: Acc) -> list[Attribution]:
    """A span's rows: one per method that joined something to it. A span without CPU has
    none: its name, duration and off-CPU time are read from ``otel_traces``."""
    out = []
    for method, m in acc.methods():
        if not m.any():
            continue
        if info is None:
            out.append(attribution(key[0], key[1], method, acc.service, "", b"", 0, 0, False, m,
                                   random_source()))
        else:
            out.append(attribution(key[0], key[1], method, info.service, info.name,
                                   info.parent_span_id, info.start_ns, info.duration_ns, True, m,
                                   random_source()))
    return out

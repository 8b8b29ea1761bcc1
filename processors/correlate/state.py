"""Join state of the correlator: pure, synchronous, and driven by an explicit clock.

Spans and the samples that explain them arrive in any order and minutes apart (profilers
upload every 10-60 s). The state keeps, per (trace_id, span_id):

* ``spans``    - spans seen and not yet reported, with the CPU joined to them so far;
                 reported once ``grace`` has passed since the span arrived;
* ``orphans``  - samples whose span has not been seen; reported after ``orphan_timeout``
                 with ``span_known=False`` so their CPU is never lost, even if the span never
                 comes (a span that comes later simply adds its own row);
* ``emitted``  - spans already reported (for ``late_window``): late samples for them are
                 reported at the next flush instead of waiting as orphans;
* ``late``     - those late samples, not yet reported;
* ``trees``    - per trace, the spans known (held or reported): parent links, thread and
                 process, to place a sample in the span that was running when it was taken;
* ``held``     - samples that carry their own instant (``timed``), held for ``grace`` so that
                 the spans running at that instant are known when they are placed;
* ``skews``    - per process, how far the profiler's clock is off the tracer's (``skew``),
                 taken off sample times before they are placed;
* ``frames``   - the stacks of held samples, and which frames each operation runs, learnt
                 to place by stack the samples their instant cannot (``frames``).

How a sample finds its span, and the ``method`` its row says (``link``, ``link+time``,
``thread``, ``window``), is in ``placement`` (and ``timed``: timed samples).

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

What the state holds per span is in ``accumulators`` and ``spans``; the Kafka tier, which
holds nothing, computes each message's rows alone (``messages``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec

from pipeline.records import (
    ATTRIBUTED,
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Sample,
    Span,
    Unattributed,
)
from processors.correlate.accumulators import LINK, UNKNOWN_FRAME, Acc, Key, add
from processors.correlate.frames import Frames
from processors.correlate.messages import random_source
from processors.correlate.sizes import ACC_BYTES, ITEM_BYTES, SAMPLE_BYTES, span_cost
from processors.correlate.skew import Skew
from processors.correlate.spans import MAX_SLOTS, SLOT_NS, Orphan, Pending, SpanInfo, Tree
from processors.correlate.timed import TimedPlacement


@dataclass
class Stats:
    spans_in: int = 0
    spans_duplicate: int = 0
    samples_in: int = 0
    samples_linked: int = 0
    samples_unlinked: int = 0
    samples_placed_in_child: int = 0  # link+time: moved from the labelled span to a child
    samples_by_thread: int = 0
    samples_shared: int = 0  # link+share: untimed, shared in the labelled span's subtree
    samples_by_window: int = 0
    samples_by_stack: int = 0  # link+share or window: placed by stack among open spans
    rows_out: int = 0
    orphans_reported: int = 0
    late_reported: int = 0
    evicted: int = 0  # entries reported before their window: max_entries or max_bytes


def _int_attr(attrs: dict[str, str], key: str) -> int:
    v = attrs.get(key, "")
    return int(v) if v.isdigit() else 0


@dataclass
class CorrelatorState(TimedPlacement):
    grace: float = 10.0
    orphan_timeout: float = 60.0
    late_window: float = 600.0
    max_entries: int = 200_000
    max_bytes: int = 512 << 20
    # OrderedDicts: the oldest entry is read at every eviction (``_bound``), and a plain
    # dict's first item costs a scan over the holes its popped entries leave at the front
    # (quadratic at the bound: 59% of the event loop at 10 k spans/s with a 60 s grace)
    spans: dict[Key, Pending] = field(default_factory=OrderedDict)
    orphans: dict[Key, Orphan] = field(default_factory=OrderedDict)
    emitted: OrderedDict[Key, tuple[float, SpanInfo]] = field(default_factory=OrderedDict)
    late: dict[Key, Pending] = field(default_factory=OrderedDict)  # info kept with the data
    unattributed: dict[tuple[str, int], Acc] = field(default_factory=dict)
    trees: dict[bytes, Tree] = field(default_factory=dict)
    # (service, second) -> spans open then; a dict for O(1) removal in insertion order
    slots: dict[tuple[str, int], dict[Key, None]] = field(default_factory=dict)
    held: deque[tuple[float, Sample, str]] = field(default_factory=deque)
    skews: dict[tuple[str, int, str], Skew] = field(default_factory=dict)
    labels_children: set[str] = field(default_factory=set)
    frames: Frames = field(default_factory=Frames)
    # span id -> trace id of known spans: samples labelled with a span id alone (some
    # Pyroscope SDKs) join their span here rather than waiting as orphans
    trace_of: dict[bytes, bytes] = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    _evicted: list[tuple[Key, SpanInfo | None, Acc]] = field(default_factory=list)
    # (since, key) of held spans adopted from an orphan, oldest first (``oldest_held``);
    # entries of spans reported since are dropped when they reach the top
    _early: list[tuple[float, Key]] = field(default_factory=list)
    _orphan_timed: int = 0  # timed samples held inside orphans
    _span_bytes: int = 0  # estimated size of the known spans (``_know`` / ``_forget``)
    _items: int = 0  # function and stack entries in the accumulators held

    def __repr__(self) -> str:
        return (f"<CorrelatorState spans={len(self.spans)} orphans={len(self.orphans)} "
                f"late={len(self.late)} emitted={len(self.emitted)} "
                f"evicted={self.stats.evicted}>")

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

    # ---- input -------------------------------------------------------------------------

    def add_spans(self, spans: list[Span], now: float) -> None:
        adopted: list[Key] = []  # spans whose untimed samples came first
        for s in spans:
            key = (s.trace_id, s.span_id)
            self.stats.spans_in += 1
            if key in self.spans or key in self.emitted:
                self.stats.spans_duplicate += 1  # a retried export: the first copy stands
                continue
            info = SpanInfo(s.service, s.name, s.parent_span_id, s.start_ns, s.duration_ns,
                             _int_attr(s.attributes, "thread.id"),
                             _int_attr(s.resource_attributes, "process.pid"),
                             s.resource_attributes.get("host.name", ""))
            orphan = self.orphans.pop(key, None)
            span_only = self.orphans.pop((b"", s.span_id), None)
            if span_only is not None:  # its samples came first, labelled by span id alone
                if orphan is None:
                    orphan = span_only
                else:
                    before = orphan.acc.items() + span_only.acc.items()
                    orphan.acc.merge(span_only.acc)
                    self._items += orphan.acc.items() - before
                    orphan.timed.extend(span_only.timed)
                orphan.timed = [(msgspec.structs.replace(x, trace_id=s.trace_id), leaf)
                                for x, leaf in orphan.timed]
            acc = orphan.acc if orphan is not None else Acc(now, s.service)
            self.spans[key] = Pending(info, acc, now + self.grace)
            if orphan is not None:
                heapq.heappush(self._early, (acc.since, key))
            self._know(key, info)
            self._adopt(key, info, acc, now)
            if orphan is not None and acc.link is not None:
                adopted.append(key)
            if orphan is not None and orphan.timed:
                # placed after grace, once the span's children have come too
                self.held.extend((now, smp, leaf) for smp, leaf in orphan.timed)
                self._orphan_timed -= len(orphan.timed)
        for key in adopted:  # samples that named a span below another: not root-only
            self.learn_labels(key, self.trees[key[0]].spans[key[1]].service)
        for key in adopted:  # once the whole batch is known: its children came with it
            self._share_adopted(key, now)
        self._bound(now)

    def add_samples(self, batch: ProfileBatch, now: float) -> None:
        for smp in batch.samples:  # first learn which services label more than roots
            if smp.span_id and not smp.timed and smp.service not in self.labels_children:
                self.learn_labels(self._key(smp), smp.service)
        stats = self.stats
        stats.samples_in += len(batch.samples)
        # untimed labelled samples per (resolved) span and service, credited together
        linked: dict[tuple[bytes, bytes, str], list[tuple[Sample, str]]] = {}
        for smp in batch.samples:
            if smp.measure not in ATTRIBUTED:
                continue  # off_cpu/other measures are stored raw, not attributed
            if smp.span_id:
                stats.samples_linked += 1
            else:
                stats.samples_unlinked += 1
            stack = batch.stacks.get(smp.stack_id)
            fns = stack.functions if stack is not None else None
            leaf = fns[0] if fns else UNKNOWN_FRAME
            if smp.timed:
                self.held.append((now, smp, leaf))  # placed once its spans are known
                if fns:  # its stack may tell its span where its instant cannot
                    self.frames.keep(smp.stack_id, fns)
            elif smp.span_id:
                gkey = (*self._key(smp), smp.service)
                group = linked.get(gkey)
                if group is None:
                    linked[gkey] = [(smp, leaf)]
                else:
                    group.append((smp, leaf))
            else:
                self._unattributed(smp, now)
        for (tid, sid, service), group in linked.items():
            self._add_linked((tid, sid), service, group, now)
        self._bound(now)

    # ---- known spans -------------------------------------------------------------------

    def _know(self, key: Key, info: SpanInfo) -> None:
        self.trace_of[key[1]] = key[0]
        tree = self.trees.get(key[0])
        if tree is None:
            tree = self.trees[key[0]] = Tree()
        tree.add(key[1], info)
        first = info.start_ns // SLOT_NS
        last = min(max(first, (info.end_ns - 1) // SLOT_NS), first + MAX_SLOTS - 1)
        self._span_bytes += span_cost(info, last - first + 1)
        for slot in range(first, last + 1):
            self.slots.setdefault((info.service, slot), {})[key] = None

    def _forget(self, key: Key, info: SpanInfo) -> None:
        if self.trace_of.get(key[1]) == key[0]:
            del self.trace_of[key[1]]
        tree = self.trees.get(key[0])
        if tree is not None:
            tree.remove(key[1])
            if not tree.spans:
                if tree.waiting:
                    self._items -= sum(len(w) for w in tree.waiting.values())
                del self.trees[key[0]]
        first = info.start_ns // SLOT_NS
        last = min(max(first, (info.end_ns - 1) // SLOT_NS), first + MAX_SLOTS - 1)
        self._span_bytes -= span_cost(info, last - first + 1)
        for slot in range(first, last + 1):
            keys = self.slots.get((info.service, slot))
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self.slots[(info.service, slot)]

    # ---- placing samples (where: ``placement``) ----------------------------------------

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

    # ---- output ------------------------------------------------------------------------

    def _pop_orphan(self, key: Key) -> Acc:
        """Take an orphan out for reporting: its span never came (or memory is short), so
        its timed samples go on the label as they are."""
        orphan = self.orphans.pop(key)
        self._items -= orphan.acc.items()
        for smp, leaf in orphan.timed:
            add(orphan.acc.m(LINK), smp.measure, smp.value, smp.count, leaf, smp.stack_id)
        self._orphan_timed -= len(orphan.timed)
        return orphan.acc

    def take_due(self, now: float, force: bool = False) -> AttributionBatch:
        """Remove and return every report that is due (all of them when ``force``)."""
        self._place_held(now, force)
        rows: list[Attribution] = []
        for key, info, acc in self._evicted:
            rows.extend(_rows(key, info, acc))
        self._evicted.clear()

        # in arrival order, so in ready_at order (now + grace, the clock monotonic): the due
        # ones are a prefix, and the scan stops at the first not due (not all held spans)
        due: list[Key] = []
        for k, p in self.spans.items():
            if not force and p.ready_at > now:
                break
            due.append(k)
        for key in due:
            p = self.spans.pop(key)
            self._items -= p.acc.items()
            rows.extend(_rows(key, p.info, p.acc))
            self.emitted[key] = (now + self.late_window, p.info)
        self._prune_early()
        for key, late in self.late.items():
            self._items -= late.acc.items()
            rows.extend(_rows(key, late.info, late.acc))
            self.stats.late_reported += 1
        self.late.clear()
        for key in [k for k, o in self.orphans.items()
                    if force or o.acc.since + self.orphan_timeout <= now]:
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
            out.append(Attribution(key[0], key[1], method, acc.service, "", b"", 0, 0, False,
                                   m.cpu_ns, m.wall_ns, m.count, m.self_cpu, m.self_wall,
                                   random_source(), m.incl_cpu, m.stack_cpu, m.stack_wall,
                                   **m.extra()))
        else:
            out.append(Attribution(key[0], key[1], method, info.service, info.name,
                                   info.parent_span_id, info.start_ns, info.duration_ns, True,
                                   m.cpu_ns, m.wall_ns, m.count, m.self_cpu, m.self_wall,
                                   random_source(), m.incl_cpu, m.stack_cpu, m.stack_wall,
                                   **m.extra()))
    return out

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
* ``skews``    - per process, how far the profiler's clock is off the tracer's (``_Skew``),
                 taken off sample times before they are placed.

How a sample finds its span, and the ``method`` its row says:

* ``link``      - the sample's link / span label names the span (exact);
* ``link+time`` - a timed sample labelled with a local root span goes to the deepest span of
                  that trace and service open at its instant, on its thread when both say
                  (``thread.id``); where child spans overlap and the thread does not tell
                  them apart, it stays on the deepest span that is unambiguous;
* ``thread``    - an unlabelled timed sample, matched by process (service, host, pid) and
                  thread to the innermost span running on that thread at that instant;
* ``window``    - an unlabelled timed sample where threads are unknown: shared equally by the
                  innermost spans of the process open at that instant (approximate).

Every report is a *delta* row and a span's totals are the sum of its rows, so a late sample
adds to the span rather than replacing or vanishing, and CPU is conserved: what comes in is
reported on a span or as unattributed, exactly once. Rows carry self CPU (``cpu_ns``) and
inclusive CPU (self plus the descendants in the same service, ``inclusive_cpu_ns``): a sample
placed in a span adds to the inclusive CPU of its known ancestors too.

Memory is bounded twice: by ``max_entries`` (held spans, sample groups and timed samples)
and by ``max_bytes``, an estimate kept as entries come and go (``bytes``: a known span with
its strings and its seconds in the time index, an accumulator and each function or stack
it holds, a held sample; the sizes are CPython's, checked against tracemalloc in
tests/processors/test_state_memory.py). Beyond either, markers of reported spans are
dropped first (that loses no data), then the oldest entries are reported early, counted in
``evicted``: their CPU is reported, never dropped.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec

from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Sample,
    Span,
    SpanBatch,
    Unattributed,
)

Key = tuple[bytes, bytes]
MINUTE_NS = 60_000_000_000
SLOT_NS = 1_000_000_000  # the time index for unlabelled samples: one-second slots
MAX_SLOTS = 3600  # a span longer than an hour is matched in its first hour only
UNKNOWN_FRAME = "[unknown]"
LINK, LINK_TIME, THREAD, WINDOW = "link", "link+time", "thread", "window"
EXACT_METHODS = (LINK, LINK_TIME)

# Estimated sizes, in bytes (CPython 3.11 on 64 bits; tests/processors/test_state_memory.py
# holds the total within a factor of 1.5 of what tracemalloc measures)
SPAN_BYTES = 460  # a known span: _SpanInfo, trees, trace_of, emitted entries (+ its strings)
SLOT_BYTES = 40  # one second of a span in the time index (``slots``)
ACC_BYTES = 250  # an accumulator (held span, orphan, late entry), without methods
ITEM_BYTES = 40  # one function or stack entry of an accumulator
METHOD_ITEMS = 19  # a method's entry in an accumulator (``_M``), counted in items
SAMPLE_BYTES = 350  # a timed sample held for grace


class _M:
    """What one method contributed to one span since it was last reported."""

    __slots__ = ("cpu_ns", "wall_ns", "count", "incl_cpu", "self_cpu", "self_wall",
                 "stack_cpu", "stack_wall")

    def __init__(self) -> None:
        self.cpu_ns = 0
        self.wall_ns = 0
        self.count = 0
        self.incl_cpu = 0
        self.self_cpu: dict[str, int] = {}  # leaf function -> ns
        self.self_wall: dict[str, int] = {}
        self.stack_cpu: dict[int, int] = {}  # stack id -> ns (flame graphs)
        self.stack_wall: dict[int, int] = {}


class _Acc:
    """CPU and wall time joined to one span since it was last reported, per method."""

    __slots__ = ("by", "since", "service")

    def __init__(self, since: float, service: str = "") -> None:
        self.by: dict[str, _M] = {}
        self.since = since
        self.service = service

    def items(self) -> int:
        """Size in ``ITEM_BYTES``: methods and their function and stack entries."""
        return sum(METHOD_ITEMS + len(m.self_cpu) + len(m.self_wall) + len(m.stack_cpu)
                   + len(m.stack_wall) for m in self.by.values())

    def add(self, method: str, measure: str, value: int, count: int, leaf: str | None,
            stack: int = 0) -> int:
        """Add a sample under ``method``; how many items (``items``) that created."""
        m = self.by.get(method)
        new = 0
        if m is None:
            m = self.by[method] = _M()
            new = METHOD_ITEMS
        return new + _add(m, measure, value, count, leaf, stack)

    def m(self, method: str) -> _M:
        got = self.by.get(method)
        if got is None:
            got = self.by[method] = _M()
        return got

    def merge(self, other: _Acc) -> None:
        for method, o in other.by.items():
            m = self.m(method)
            m.cpu_ns += o.cpu_ns
            m.wall_ns += o.wall_ns
            m.count += o.count
            m.incl_cpu += o.incl_cpu
            for d, od in ((m.self_cpu, o.self_cpu), (m.self_wall, o.self_wall)):
                for k, v in od.items():
                    d[k] = d.get(k, 0) + v
            for sd, osd in ((m.stack_cpu, o.stack_cpu), (m.stack_wall, o.stack_wall)):
                for sk, sv in osd.items():
                    sd[sk] = sd.get(sk, 0) + sv


@dataclass(slots=True)
class _SpanInfo:
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


@dataclass(slots=True)
class _Pending:
    info: _SpanInfo
    acc: _Acc
    ready_at: float


class _Tree:
    """The known spans of one trace, with a children index built when first needed."""

    __slots__ = ("spans", "_children")

    def __init__(self) -> None:
        self.spans: dict[bytes, _SpanInfo] = {}
        self._children: dict[bytes, list[bytes]] | None = None

    def add(self, span_id: bytes, info: _SpanInfo) -> None:
        self.spans[span_id] = info
        self._children = None

    def remove(self, span_id: bytes) -> None:
        self.spans.pop(span_id, None)
        self._children = None

    def children(self, span_id: bytes) -> list[bytes]:
        if self._children is None:
            ch: dict[bytes, list[bytes]] = {}
            for sid, info in self.spans.items():
                if info.parent_span_id:
                    ch.setdefault(info.parent_span_id, []).append(sid)
            self._children = ch
        return self._children.get(span_id, [])


@dataclass(slots=True)
class _Orphan:
    acc: _Acc
    timed: list[tuple[Sample, str]] = field(default_factory=list)  # placed when the span comes


class _Skew:
    """How far a profiler's clock is off the tracer's, per process, learnt from labelled
    timed samples: a sample of span S was taken within S, so ``t - S.end <= skew <= t -
    S.start``. The tightest bounds over many samples bracket the skew; their midpoint is
    subtracted from sample times before they are placed. Bounds restart every ``WINDOW``
    samples (the previous estimate stays in use until the new one has ``MIN`` samples), so
    drift is followed."""

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
            self.estimate = (self.lo + self.hi) // 2


@dataclass
class Stats:
    spans_in: int = 0
    spans_duplicate: int = 0
    samples_in: int = 0
    samples_linked: int = 0
    samples_unlinked: int = 0
    samples_placed_in_child: int = 0  # link+time: moved from the labelled span to a child
    samples_by_thread: int = 0
    samples_by_window: int = 0
    rows_out: int = 0
    orphans_reported: int = 0
    late_reported: int = 0
    evicted: int = 0  # entries reported before their window: max_entries or max_bytes


def _leaf(batch: ProfileBatch, smp: Sample) -> str:
    stack = batch.stacks.get(smp.stack_id)
    return stack.functions[0] if stack is not None and stack.functions else UNKNOWN_FRAME


def _int_attr(attrs: dict[str, str], key: str) -> int:
    v = attrs.get(key, "")
    return int(v) if v.isdigit() else 0


@dataclass
class CorrelatorState:
    grace: float = 10.0
    orphan_timeout: float = 60.0
    late_window: float = 600.0
    max_entries: int = 200_000
    max_bytes: int = 512 << 20
    spans: dict[Key, _Pending] = field(default_factory=dict)
    orphans: dict[Key, _Orphan] = field(default_factory=dict)
    emitted: OrderedDict[Key, tuple[float, _SpanInfo]] = field(default_factory=OrderedDict)
    late: dict[Key, _Pending] = field(default_factory=dict)  # info kept with the data
    unattributed: dict[tuple[str, int], _Acc] = field(default_factory=dict)
    trees: dict[bytes, _Tree] = field(default_factory=dict)
    # (service, second) -> spans open then; a dict for O(1) removal in insertion order
    slots: dict[tuple[str, int], dict[Key, None]] = field(default_factory=dict)
    held: deque[tuple[float, Sample, str]] = field(default_factory=deque)
    skews: dict[tuple[str, int, str], _Skew] = field(default_factory=dict)
    # span id -> trace id of known spans: samples labelled with a span id alone (some
    # Pyroscope SDKs) join their span here rather than waiting as orphans
    trace_of: dict[bytes, bytes] = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    _evicted: list[tuple[Key, _SpanInfo | None, _Acc]] = field(default_factory=list)
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
                + SAMPLE_BYTES * (len(self.held) + self._orphan_timed))

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
        times = [p.acc.since for p in self.spans.values()]
        times += [o.acc.since - self.grace for o in self.orphans.values()]
        times += [p.acc.since - self.grace for p in self.late.values()]
        times += [a.since - self.grace for a in self.unattributed.values()]
        times += [a.since - self.grace for _, _, a in self._evicted]
        if self.held:
            times.append(self.held[0][0])  # appended in arrival order
        return min(times) if times else None

    # ---- input -------------------------------------------------------------------------

    def add_spans(self, spans: list[Span], now: float) -> None:
        for s in spans:
            key = (s.trace_id, s.span_id)
            self.stats.spans_in += 1
            if key in self.spans or key in self.emitted:
                self.stats.spans_duplicate += 1  # a retried export: the first copy stands
                continue
            info = _SpanInfo(s.service, s.name, s.parent_span_id, s.start_ns, s.duration_ns,
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
            acc = orphan.acc if orphan is not None else _Acc(now, s.service)
            self.spans[key] = _Pending(info, acc, now + self.grace)
            self._know(key, info)
            if orphan is not None and orphan.timed:
                # placed after grace, once the span's children have come too
                self.held.extend((now, smp, leaf) for smp, leaf in orphan.timed)
                self._orphan_timed -= len(orphan.timed)
        self._bound(now)

    def add_samples(self, batch: ProfileBatch, now: float) -> None:
        for smp in batch.samples:
            self.stats.samples_in += 1
            if smp.measure != "cpu" and smp.measure != "wall":
                continue  # off_cpu/other measures are stored raw, not attributed
            if smp.span_id:
                self.stats.samples_linked += 1
            else:
                self.stats.samples_unlinked += 1
            leaf = _leaf(batch, smp)
            if smp.timed:
                self.held.append((now, smp, leaf))  # placed once its spans are known
            elif smp.span_id:
                self._add_linked(smp, leaf, now)
            else:
                self._unattributed(smp, now)
        self._bound(now)

    # ---- placing samples ---------------------------------------------------------------

    def _resolve(self, smp: Sample) -> Sample:
        """A span-only sample of a known span, given its trace."""
        if not smp.trace_id and smp.span_id:
            tid = self.trace_of.get(smp.span_id)
            if tid is not None:
                return msgspec.structs.replace(smp, trace_id=tid)
        return smp

    def _know(self, key: Key, info: _SpanInfo) -> None:
        self.trace_of[key[1]] = key[0]
        tree = self.trees.get(key[0])
        if tree is None:
            tree = self.trees[key[0]] = _Tree()
        tree.add(key[1], info)
        first = info.start_ns // SLOT_NS
        last = min(max(first, (info.end_ns - 1) // SLOT_NS), first + MAX_SLOTS - 1)
        self._span_bytes += _span_cost(info, last - first + 1)
        for slot in range(first, last + 1):
            self.slots.setdefault((info.service, slot), {})[key] = None

    def _forget(self, key: Key, info: _SpanInfo) -> None:
        if self.trace_of.get(key[1]) == key[0]:
            del self.trace_of[key[1]]
        tree = self.trees.get(key[0])
        if tree is not None:
            tree.remove(key[1])
            if not tree.spans:
                del self.trees[key[0]]
        first = info.start_ns // SLOT_NS
        last = min(max(first, (info.end_ns - 1) // SLOT_NS), first + MAX_SLOTS - 1)
        self._span_bytes -= _span_cost(info, last - first + 1)
        for slot in range(first, last + 1):
            keys = self.slots.get((info.service, slot))
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self.slots[(info.service, slot)]

    def _acc_of(self, key: Key, now: float) -> _Acc | None:
        """The accumulator of a known span: held, or (reported) its late entry."""
        pending = self.spans.get(key)
        if pending is not None:
            return pending.acc
        em = self.emitted.get(key)
        if em is None:
            return None
        late = self.late.get(key)
        if late is None:
            late = self.late[key] = _Pending(em[1], _Acc(now, em[1].service), now)
        return late.acc

    def _info(self, key: Key) -> _SpanInfo | None:
        tree = self.trees.get(key[0])
        return tree.spans.get(key[1]) if tree is not None else None

    def _credit(self, key: Key, method: str, smp: Sample, value: int, count: int,
                leaf: str, now: float) -> None:
        """Add a sample's value to a known span (self) and its known ancestors in the same
        service (inclusive)."""
        acc = self._acc_of(key, now)
        assert acc is not None
        self._items += acc.add(method, smp.measure, value, count, leaf, smp.stack_id)
        if smp.measure != "cpu":
            return
        tree = self.trees.get(key[0])
        info = tree.spans.get(key[1]) if tree is not None else None
        seen = {key[1]}
        while tree is not None and info is not None and info.parent_span_id:
            parent_id = info.parent_span_id
            parent = tree.spans.get(parent_id)
            if parent is None or parent.service != info.service or parent_id in seen:
                break
            seen.add(parent_id)
            pacc = self._acc_of((key[0], parent_id), now)
            if pacc is None:
                break
            methods = len(pacc.by)
            pacc.m(method).incl_cpu += value
            self._items += METHOD_ITEMS * (len(pacc.by) - methods)
            info = parent

    def _add_linked(self, smp: Sample, leaf: str, now: float) -> None:
        smp = self._resolve(smp)
        key = (smp.trace_id, smp.span_id)
        if self._acc_of(key, now) is not None:
            self._credit(key, LINK, smp, smp.value, smp.count, leaf, now)
            return
        orphan = self.orphans.get(key)
        if orphan is None:
            orphan = self.orphans[key] = _Orphan(_Acc(now, smp.service))
        self._items += orphan.acc.add(LINK, smp.measure, smp.value, smp.count, leaf,
                                      smp.stack_id)

    def _skew_of(self, smp: Sample) -> int:
        sk = self.skews.get((smp.service, smp.pid, smp.host))
        return sk.estimate if sk is not None else 0

    def _place_linked(self, smp: Sample, leaf: str, now: float) -> None:
        """A timed, labelled sample: into the deepest span open at its instant."""
        smp = self._resolve(smp)
        key = (smp.trace_id, smp.span_id)
        tree = self.trees.get(smp.trace_id)
        label = tree.spans.get(smp.span_id) if tree is not None else None
        if tree is None or label is None:
            orphan = self.orphans.get(key)
            if orphan is None:
                orphan = self.orphans[key] = _Orphan(_Acc(now, smp.service))
            orphan.timed.append((smp, leaf))
            self._orphan_timed += 1
            return
        t = smp.time_ns - self._skew_of(smp)
        target = _deepest(tree, smp.span_id, label, t, smp.thread_id)
        if target == smp.span_id:
            self._credit(key, LINK, smp, smp.value, smp.count, leaf, now)
        else:
            self.stats.samples_placed_in_child += 1
            self._credit((smp.trace_id, target), LINK_TIME, smp, smp.value, smp.count, leaf,
                         now)

    def _place_unlinked(self, smp: Sample, leaf: str, now: float) -> None:
        """A timed sample without a label: by process and thread, else by time window."""
        t = smp.time_ns - self._skew_of(smp)
        open_: list[tuple[Key, _SpanInfo]] = []
        for key in self.slots.get((smp.service, t // SLOT_NS), ()):
            info = self._info(key)
            if info is None or not info.start_ns <= t < info.end_ns:
                continue
            if smp.pid and info.pid and smp.pid != info.pid:
                continue
            if smp.host and info.host and smp.host != info.host:
                continue
            open_.append((key, info))
        if not open_:
            self._unattributed(smp, now)
            return
        if any(info.thread_id for _, info in open_):
            if not smp.thread_id:
                on_thread: list[tuple[Key, _SpanInfo]] = []
            else:
                on_thread = [(k, i) for k, i in open_ if i.thread_id == smp.thread_id]
            if smp.thread_id and on_thread:
                # the innermost span running on that thread: the latest to have started
                key = max(on_thread, key=lambda ki: (ki[1].start_ns, -ki[1].duration_ns))[0]
                self.stats.samples_by_thread += 1
                self._credit(key, THREAD, smp, smp.value, smp.count, leaf, now)
                return
            if smp.thread_id:
                self._unattributed(smp, now)  # its thread ran none of the known spans
                return
        # only time is known: the innermost open spans share it (approximate)
        parents = {(k[0], i.parent_span_id) for k, i in open_}
        leaves = sorted(k for k, _ in open_ if k not in parents)
        n = len(leaves)
        self.stats.samples_by_window += 1
        for i, key in enumerate(leaves):
            share = smp.value // n + (1 if i < smp.value % n else 0)
            ticks = smp.count // n + (1 if i < smp.count % n else 0)
            if share or ticks:
                self._credit(key, WINDOW, smp, share, ticks, leaf, now)

    def _unattributed(self, smp: Sample, now: float) -> None:
        ukey = (smp.service, smp.time_ns - smp.time_ns % MINUTE_NS)
        acc = self.unattributed.get(ukey)
        if acc is None:
            acc = self.unattributed[ukey] = _Acc(now, smp.service)
        _add(acc.m(LINK), smp.measure, smp.value, smp.count, None)

    def _pop_orphan(self, key: Key) -> _Acc:
        """Take an orphan out for reporting: its span never came (or memory is short), so
        its timed samples go on the label as they are."""
        orphan = self.orphans.pop(key)
        self._items -= orphan.acc.items()
        for smp, leaf in orphan.timed:
            _add(orphan.acc.m(LINK), smp.measure, smp.value, smp.count, leaf, smp.stack_id)
        self._orphan_timed -= len(orphan.timed)
        return orphan.acc

    def _place_held(self, now: float, force: bool) -> None:
        held = self.held
        due: list[tuple[Sample, str]] = []
        while held and (force or held[0][0] + self.grace <= now or self._over()):
            _, smp, leaf = held.popleft()
            due.append((smp, leaf))
        # first learn the clock skew from the labelled ones, then place them all
        for smp, _ in due:
            if smp.span_id:
                info = self._info((smp.trace_id or self.trace_of.get(smp.span_id, b""),
                                   smp.span_id))
                if info is not None and info.duration_ns:
                    pkey = (smp.service, smp.pid, smp.host)
                    sk = self.skews.get(pkey)
                    if sk is None:
                        sk = self.skews[pkey] = _Skew()
                    sk.observe(smp.time_ns, info.start_ns, info.end_ns)
        for smp, leaf in due:
            if smp.span_id:
                self._place_linked(smp, leaf, now)
            else:
                self._place_unlinked(smp, leaf, now)

    # ---- output ------------------------------------------------------------------------

    def take_due(self, now: float, force: bool = False) -> AttributionBatch:
        """Remove and return every report that is due (all of them when ``force``)."""
        self._place_held(now, force)
        rows: list[Attribution] = []
        for key, info, acc in self._evicted:
            rows.extend(_rows(key, info, acc))
        self._evicted.clear()

        for key in [k for k, p in self.spans.items() if force or p.ready_at <= now]:
            p = self.spans.pop(key)
            self._items -= p.acc.items()
            rows.extend(_rows(key, p.info, p.acc))
            self.emitted[key] = (now + self.late_window, p.info)
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


def _deepest(tree: _Tree, span_id: bytes, info: _SpanInfo, t: int, thread: int) -> bytes:
    """From the labelled span down: the deepest span of its service open at ``t``,
    descending only while the choice is unambiguous (on ``thread`` when spans say theirs)."""
    seen = {span_id}
    while True:
        open_ = []
        for cid in tree.children(span_id):
            c = tree.spans[cid]
            if c.service == info.service and c.start_ns <= t < c.end_ns and cid not in seen:
                open_.append((cid, c))
        if thread and len(open_) > 1:
            same = [(cid, c) for cid, c in open_ if c.thread_id == thread]
            unknown = [(cid, c) for cid, c in open_ if not c.thread_id]
            open_ = same if same else unknown
        elif thread:
            open_ = [(cid, c) for cid, c in open_ if not c.thread_id or c.thread_id == thread]
        if len(open_) != 1:
            return span_id
        span_id, info = open_[0]
        seen.add(span_id)


def _add(m: _M, measure: str, value: int, count: int, leaf: str | None,
         stack: int = 0) -> int:
    """Add a sample to ``m``; how many function and stack entries that created."""
    if measure == "cpu":
        m.cpu_ns += value
        m.incl_cpu += value
        m.count += count
        if leaf is None:
            return 0
        fns, stacks = m.self_cpu, m.stack_cpu
    else:
        m.wall_ns += value
        if leaf is None:
            return 0
        fns, stacks = m.self_wall, m.stack_wall
    new = 0
    got = fns.get(leaf)
    if got is None:
        fns[leaf] = value
        new += 1
    else:
        fns[leaf] = got + value
    got = stacks.get(stack)
    if got is None:
        stacks[stack] = value
        new += 1
    else:
        stacks[stack] = got + value
    return new


def _span_cost(info: _SpanInfo, slots: int) -> int:
    return (SPAN_BYTES + SLOT_BYTES * slots + len(info.name) + len(info.service)
            + len(info.host))


def random_source() -> int:
    """A fresh id for a row that summarises in-memory state (never deduplicated away)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def _rows(key: Key, info: _SpanInfo | None, acc: _Acc) -> list[Attribution]:
    """A span's rows: one per method that joined something to it. A span without CPU has
    none: its name, duration and off-CPU time are read from ``otel_traces``."""
    out = []
    for method, m in acc.by.items():
        if not (m.cpu_ns or m.wall_ns or m.count or m.incl_cpu):
            continue
        if info is None:
            out.append(Attribution(key[0], key[1], method, acc.service, "", b"", 0, 0, False,
                                   m.cpu_ns, m.wall_ns, m.count, m.self_cpu, m.self_wall,
                                   random_source(), m.incl_cpu, m.stack_cpu, m.stack_wall))
        else:
            out.append(Attribution(key[0], key[1], method, info.service, info.name,
                                   info.parent_span_id, info.start_ns, info.duration_ns, True,
                                   m.cpu_ns, m.wall_ns, m.count, m.self_cpu, m.self_wall,
                                   random_source(), m.incl_cpu, m.stack_cpu, m.stack_wall))
    return out


def source_id(origin: str) -> int:
    """Deterministic 63-bit id of a Kafka message ("topic/partition/offset")."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(origin.encode(), digest_size=8).digest(),
                          "little") >> 1


def attribute_block(batch: SpanBatch | ProfileBatch,
                    spans: SpanLookup | None = None) -> AttributionBatch:
    """The rows of a Kafka block: each message's rows (``attribute_message``, under the
    message's own ``source``), as one batch named by the block, so that the exporter
    inserts them as one deduplicated block."""
    rows: list[Attribution] = []
    unattributed: list[Unattributed] = []
    parts = batch.parts or [(batch.origin, len(batch))]
    at = 0
    for origin, n in parts:
        if isinstance(batch, SpanBatch):
            piece: SpanBatch | ProfileBatch = SpanBatch(batch.spans[at:at + n])
        else:
            piece = ProfileBatch(batch.samples[at:at + n], batch.stacks)
        at += n
        got = attribute_message(piece, source_id(origin), spans)
        rows.extend(got.attributions)
        unattributed.extend(got.unattributed)
    return AttributionBatch(rows, unattributed, origin=batch.origin)


SpanLookup = dict[bytes, tuple[bytes, "_SpanInfo"]]  # span id -> (trace id, span)


def span_lookup_add(lookup: SpanLookup, batch: SpanBatch, bound: int) -> None:
    """Remember the spans of a message (bounded, oldest forgotten first), so that sample
    rows of later messages can name their span's operation and time."""
    for s in batch.spans:
        lookup.pop(s.span_id, None)
        lookup[s.span_id] = (s.trace_id, _SpanInfo(s.service, s.name, s.parent_span_id,
                                                   s.start_ns, s.duration_ns))
    while len(lookup) > bound:
        del lookup[next(iter(lookup))]


def attribute_message(batch: SpanBatch | ProfileBatch, source: int,
                      spans: SpanLookup | None = None) -> AttributionBatch:
    """The attribution rows one message contributes, as a pure function of the message.

    The Kafka tier writes these before committing the message's offset. A worker that dies
    before the commit leaves the message to be read again, by itself or by whichever worker
    takes the partition, and the redelivered message yields the very same rows (same
    ``source``), which ClickHouse's ReplacingMergeTree keeps once: exactly one contribution
    per (span, message), whatever crashed where. A span's totals are the sum over messages.
    """
    if isinstance(batch, SpanBatch):
        return AttributionBatch([])  # a span's name and duration are in otel_traces
    accs: dict[Key, _M] = {}
    unlinked: dict[tuple[str, int], _M] = {}
    services: dict[Key, str] = {}
    for smp in batch.samples:
        if smp.measure != "cpu" and smp.measure != "wall":
            continue
        if not smp.span_id:
            ukey = (smp.service, smp.time_ns - smp.time_ns % MINUTE_NS)
            um = unlinked.get(ukey) or unlinked.setdefault(ukey, _M())
            _add(um, smp.measure, smp.value, smp.count, None)
            continue
        key = (smp.trace_id, smp.span_id)
        m = accs.get(key)
        if m is None:
            m = accs[key] = _M()
            services[key] = smp.service
        _add(m, smp.measure, smp.value, smp.count, _leaf(batch, smp), smp.stack_id)
    rows = []
    for k, m in accs.items():
        # a span this worker has seen (same partition, usually earlier) gives the row its
        # operation and time, so its CPU reaches the per-operation aggregates. The row
        # stays the same on redelivery as far as ClickHouse is concerned: the message's
        # insert_deduplication_token drops the second block whatever it holds.
        # Only rows that carry their trace: a span-only row keeps trace '' whatever this
        # worker knows, so that a redelivery to another worker writes the very same key
        # (trace_id, span_id, method, source) and ReplacingMergeTree keeps one copy.
        known = spans.get(k[1]) if spans is not None and k[0] else None
        if known is not None and known[0] == k[0]:
            tid, info = known
            rows.append(Attribution(tid, k[1], LINK, info.service, info.name,
                                    info.parent_span_id, info.start_ns, info.duration_ns,
                                    True, m.cpu_ns, m.wall_ns, m.count, m.self_cpu,
                                    m.self_wall, source, m.incl_cpu, m.stack_cpu,
                                    m.stack_wall))
        else:
            rows.append(Attribution(k[0], k[1], LINK, services[k], "", b"", 0, 0, False,
                                    m.cpu_ns, m.wall_ns, m.count, m.self_cpu, m.self_wall,
                                    source, m.incl_cpu, m.stack_cpu, m.stack_wall))
    return AttributionBatch(
        rows,
        [Unattributed(svc, minute, m.cpu_ns, m.wall_ns, m.count, source)
         for (svc, minute), m in unlinked.items()])

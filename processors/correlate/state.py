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
``thread``, ``window``), is in ``placement`` (and ``timed``: timed samples), which reads the
index of known spans (``known``: ``trees``, ``trace_of`` and the spans open each second).
When what is held is reported (its windows, and the bounds on memory: ``max_entries`` and
``max_bytes``), as delta rows that conserve CPU, is in ``windows``. ``CorrelatorState``
declares the tables and takes the input; its other methods are those parts'.

What the state holds per span is in ``accumulators`` and ``spans``; the Kafka tier, which
holds nothing, computes each message's rows alone (``messages``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec

from pipeline.records import ATTRIBUTED, ProfileBatch, Sample, Span
from processors.correlate.accumulators import UNKNOWN_FRAME, Acc, Key
from processors.correlate.frames import Frames
from processors.correlate.skew import Skew
from processors.correlate.spans import Orphan, Pending, SpanInfo, Tree
from processors.correlate.windows import Windows


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


# operation names shared (at most this many, of at most this length: a few MiB); beyond,
# the table starts again. Held only while spans hold them, but not in ``bytes``
MAX_NAMES = 32_768
MAX_NAME_CHARS = 128


def _int_attr(v: str) -> int:
    """An attribute's value as a number (thread.id, process.pid); 0 when it is not one."""
    return int(v) if v.isdigit() else 0


@dataclass
class CorrelatorState(Windows):
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
    _names: dict[str, str] = field(default_factory=dict)  # operation names (``add_spans``)

    def __repr__(self) -> str:
        return (f"<CorrelatorState spans={len(self.spans)} orphans={len(self.orphans)} "
                f"late={len(self.late)} emitted={len(self.emitted)} "
                f"evicted={self.stats.evicted}>")

    # ---- input -------------------------------------------------------------------------

    def add_spans(self, spans: list[Span], now: float) -> None:
        adopted: list[Key] = []  # spans whose untimed samples came first
        ready_at = now + self.grace  # one float for the batch, not one per held span
        names = self._names
        for s in spans:
            key = (s.trace_id, s.span_id)
            self.stats.spans_in += 1
            if key in self.spans or key in self.emitted:
                self.stats.spans_duplicate += 1  # a retried export: the first copy stands
                continue
            res, start = s.resource_attributes, s.start_ns
            thread = s.attributes.get("thread.id")
            pid = res.get("process.pid")
            # one string per operation name, shared by the held spans (a string each was
            # 50-80 B of a held span's ~1 500, and names are few); a table of its own, not
            # sys.intern: bounded, and freed by refcount whatever the Python version
            name = names.get(s.name)
            if name is None:
                name = s.name
                if len(name) <= MAX_NAME_CHARS:  # a long one (SQL text...) stays its own
                    if len(names) >= MAX_NAMES:
                        names.clear()
                    names[name] = name
            info = SpanInfo(s.service, name, s.parent_span_id, start,
                            max(0, s.end_ns - start),  # Span.duration_ns, without the call
                            _int_attr(thread) if thread else 0,
                            _int_attr(pid) if pid else 0, res.get("host.name", ""))
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
            self.spans[key] = Pending(info, acc, ready_at)
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

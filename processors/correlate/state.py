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
* ``late``     - those late samples, not yet reported.

Every report is a *delta* row and a span's totals are the sum of its rows, so a late sample
adds to the span rather than replacing or vanishing, and CPU is conserved: what comes in is
reported on a span or as unattributed, exactly once. Memory is bounded by ``max_entries``:
beyond it the oldest entries are reported early, counted in ``evicted``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Span,
    SpanBatch,
    Unattributed,
)

Key = tuple[bytes, bytes]
MINUTE_NS = 60_000_000_000
UNKNOWN_FRAME = "[unknown]"


class _Acc:
    """CPU and wall time joined to one span since it was last reported."""

    __slots__ = ("cpu_ns", "wall_ns", "count", "self_cpu", "self_wall", "since", "service")

    def __init__(self, since: float, service: str = "") -> None:
        self.cpu_ns = 0
        self.wall_ns = 0
        self.count = 0
        self.self_cpu: dict[str, int] = {}
        self.self_wall: dict[str, int] = {}
        self.since = since
        self.service = service

    def empty(self) -> bool:
        return not (self.cpu_ns or self.wall_ns or self.count)


@dataclass(slots=True)
class _SpanInfo:
    service: str
    name: str
    parent_span_id: bytes
    start_ns: int
    duration_ns: int


@dataclass(slots=True)
class _Pending:
    info: _SpanInfo
    acc: _Acc
    ready_at: float


@dataclass
class Stats:
    spans_in: int = 0
    spans_duplicate: int = 0
    samples_in: int = 0
    samples_linked: int = 0
    samples_unlinked: int = 0
    rows_out: int = 0
    orphans_reported: int = 0
    late_reported: int = 0
    evicted: int = 0  # entries reported before their window because of max_entries


@dataclass
class CorrelatorState:
    grace: float = 10.0
    orphan_timeout: float = 60.0
    late_window: float = 600.0
    max_entries: int = 200_000
    spans: dict[Key, _Pending] = field(default_factory=dict)
    orphans: dict[Key, _Acc] = field(default_factory=dict)
    emitted: OrderedDict[Key, tuple[float, _SpanInfo]] = field(default_factory=OrderedDict)
    late: dict[Key, _Pending] = field(default_factory=dict)  # info kept with the data
    unattributed: dict[tuple[str, int], _Acc] = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    _evicted: list[tuple[Key, _SpanInfo | None, _Acc]] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"<CorrelatorState spans={len(self.spans)} orphans={len(self.orphans)} "
                f"late={len(self.late)} emitted={len(self.emitted)} "
                f"evicted={self.stats.evicted}>")

    @property
    def entries(self) -> int:
        """Entries held for their window (what ``max_entries`` bounds)."""
        return len(self.spans) + len(self.orphans) + len(self.late)

    # ---- input -------------------------------------------------------------------------

    def add_spans(self, spans: list[Span], now: float) -> None:
        for s in spans:
            key = (s.trace_id, s.span_id)
            self.stats.spans_in += 1
            if key in self.spans or key in self.emitted:
                self.stats.spans_duplicate += 1  # a retried export: the first copy stands
                continue
            info = _SpanInfo(s.service, s.name, s.parent_span_id, s.start_ns, s.duration_ns)
            acc = self.orphans.pop(key, None) or _Acc(now, s.service)
            self.spans[key] = _Pending(info, acc, now + self.grace)
        self._bound(now)

    def add_samples(self, batch: ProfileBatch, now: float) -> None:
        stacks = batch.stacks
        for smp in batch.samples:
            self.stats.samples_in += 1
            if smp.measure != "cpu" and smp.measure != "wall":
                continue  # off_cpu/other measures are stored raw, not attributed
            if not smp.span_id:
                self.stats.samples_unlinked += 1
                ukey = (smp.service, smp.time_ns - smp.time_ns % MINUTE_NS)
                acc = self.unattributed.get(ukey)
                if acc is None:
                    acc = self.unattributed[ukey] = _Acc(now, smp.service)
                _add(acc, smp.measure, smp.value, smp.count, None)
                continue
            self.stats.samples_linked += 1
            key = (smp.trace_id, smp.span_id)
            pending = self.spans.get(key)
            if pending is not None:
                acc = pending.acc
            elif key in self.emitted:
                late = self.late.get(key)
                if late is None:
                    late = self.late[key] = _Pending(self.emitted[key][1],
                                                     _Acc(now, smp.service), now)
                acc = late.acc
            else:
                acc = self.orphans.get(key) or self.orphans.setdefault(key, _Acc(now, smp.service))
            stack = stacks.get(smp.stack_id)
            leaf = stack.functions[0] if stack is not None and stack.functions else UNKNOWN_FRAME
            _add(acc, smp.measure, smp.value, smp.count, leaf)
        self._bound(now)

    # ---- output ------------------------------------------------------------------------

    def take_due(self, now: float, force: bool = False) -> AttributionBatch:
        """Remove and return every report that is due (all of them when ``force``)."""
        rows: list[Attribution] = []
        for key, info, acc in self._evicted:
            rows.append(_row(key, info, acc))
        self._evicted.clear()

        for key in [k for k, p in self.spans.items() if force or p.ready_at <= now]:
            p = self.spans.pop(key)
            rows.append(_row(key, p.info, p.acc))
            self.emitted[key] = (now + self.late_window, p.info)
        for key, late in self.late.items():
            rows.append(_row(key, late.info, late.acc))
            self.stats.late_reported += 1
        self.late.clear()
        for key in [k for k, a in self.orphans.items()
                    if force or a.since + self.orphan_timeout <= now]:
            rows.append(_row(key, None, self.orphans.pop(key)))
            self.stats.orphans_reported += 1

        unattributed = [Unattributed(svc, minute, a.cpu_ns, a.wall_ns, a.count,
                                     random_source())
                        for (svc, minute), a in self.unattributed.items()]
        self.unattributed.clear()
        while self.emitted:
            key, (expires, _) = next(iter(self.emitted.items()))
            if expires > now:
                break
            del self.emitted[key]
        self.stats.rows_out += len(rows)
        return AttributionBatch(rows, unattributed)

    def _bound(self, now: float) -> None:
        """Keep held entries within ``max_entries`` by reporting the oldest ones early."""
        while len(self.emitted) and self.entries + len(self.emitted) > self.max_entries:
            self.emitted.popitem(last=False)  # losing a marker loses no data
        while self.entries > self.max_entries:
            # the oldest held entry of the three kinds is reported first
            heads: list[tuple[float, str, Key]] = []
            for kind, table in (("span", self.spans), ("late", self.late)):
                first = next(iter(table.items()), None)
                if first is not None:
                    heads.append((first[1].acc.since, kind, first[0]))
            first_orphan = next(iter(self.orphans.items()), None)
            if first_orphan is not None:
                heads.append((first_orphan[1].since, "orphan", first_orphan[0]))
            _, kind, key = min(heads)
            if kind == "orphan":
                self._evicted.append((key, None, self.orphans.pop(key)))
            else:
                p = (self.spans if kind == "span" else self.late).pop(key)
                self._evicted.append((key, p.info, p.acc))
                self.emitted[key] = (now + self.late_window, p.info)
                self.emitted.move_to_end(key)
            self.stats.evicted += 1


def _add(acc: _Acc, measure: str, value: int, count: int, leaf: str | None) -> None:
    if measure == "cpu":
        acc.cpu_ns += value
        acc.count += count
        if leaf is not None:
            acc.self_cpu[leaf] = acc.self_cpu.get(leaf, 0) + value
    else:
        acc.wall_ns += value
        if leaf is not None:
            acc.self_wall[leaf] = acc.self_wall.get(leaf, 0) + value


def random_source() -> int:
    """A fresh id for a row that summarises in-memory state (never deduplicated away)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def _row(key: Key, info: _SpanInfo | None, acc: _Acc) -> Attribution:
    if info is None:
        return Attribution(key[0], key[1], "link", acc.service, "", b"", 0, 0, False,
                           acc.cpu_ns, acc.wall_ns, acc.count, acc.self_cpu, acc.self_wall,
                           random_source())
    return Attribution(key[0], key[1], "link", info.service, info.name, info.parent_span_id,
                       info.start_ns, info.duration_ns, True, acc.cpu_ns, acc.wall_ns,
                       acc.count, acc.self_cpu, acc.self_wall, random_source())


def source_id(origin: str) -> int:
    """Deterministic 63-bit id of a Kafka message ("topic/partition/offset")."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(origin.encode(), digest_size=8).digest(),
                          "little") >> 1


def attribute_message(batch: SpanBatch | ProfileBatch, source: int) -> AttributionBatch:
    """The attribution rows one message contributes, as a pure function of the message.

    The Kafka tier writes these before committing the message's offset. A worker that dies
    before the commit leaves the message to be read again, by itself or by whichever worker
    takes the partition, and the redelivered message yields the very same rows (same
    ``source``), which ClickHouse's ReplacingMergeTree keeps once: exactly one contribution
    per (span, message), whatever crashed where. A span's totals are the sum over messages.
    """
    if isinstance(batch, SpanBatch):
        rows = [Attribution(s.trace_id, s.span_id, "link", s.service, s.name, s.parent_span_id,
                            s.start_ns, s.duration_ns, True, 0, 0, 0, {}, {}, source)
                for s in batch.spans]
        return AttributionBatch(rows)
    accs: dict[Key, _Acc] = {}
    unlinked: dict[tuple[str, int], _Acc] = {}
    for smp in batch.samples:
        if smp.measure != "cpu" and smp.measure != "wall":
            continue
        if not smp.span_id:
            ukey = (smp.service, smp.time_ns - smp.time_ns % MINUTE_NS)
            acc = unlinked.get(ukey) or unlinked.setdefault(ukey, _Acc(0.0, smp.service))
            _add(acc, smp.measure, smp.value, smp.count, None)
            continue
        key = (smp.trace_id, smp.span_id)
        acc = accs.get(key) or accs.setdefault(key, _Acc(0.0, smp.service))
        stack = batch.stacks.get(smp.stack_id)
        leaf = stack.functions[0] if stack is not None and stack.functions else UNKNOWN_FRAME
        _add(acc, smp.measure, smp.value, smp.count, leaf)
    return AttributionBatch(
        [Attribution(k[0], k[1], "link", a.service, "", b"", 0, 0, False, a.cpu_ns, a.wall_ns,
                     a.count, a.self_cpu, a.self_wall, source) for k, a in accs.items()],
        [Unattributed(svc, minute, a.cpu_ns, a.wall_ns, a.count, source)
         for (svc, minute), a in unlinked.items()])

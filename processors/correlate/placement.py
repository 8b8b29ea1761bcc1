"""How the correlator places a sample in a span: the ``method`` its row says.

* ``link``      - the sample's link / span label names the span (exact);
* ``link+time`` - a timed sample labelled with a local root span goes to the deepest span of
                  that trace and service open at its instant, on its thread when both say
                  (``thread.id``); where child spans overlap and the thread does not tell
                  them apart, it stays on the deepest span that is unambiguous (``deepest``),
                  unless its stack tells (``link+share`` below);
* ``thread``    - an unlabelled timed sample, matched by process (service, host, pid) and
                  thread to the innermost span running on that thread at that instant;
* ``window``    - an unlabelled timed sample where threads are unknown: given to the innermost
                  spans of the process open at that instant whose operation its stack
                  matches (``frames``), shared equally where it does not tell (approximate);
* ``link+share``- an untimed sample (pprof: Go, Python, Node) labelled with a local root span
                  that has children of its service, from a service whose samples have
                  named only local roots so far (root-only span profilers; an OTLP
                  profiler links every span and is never shared): it cannot be placed by
                  instant, so the labelled
                  span's subtree shares it by self time (each span's duration less its
                  children's), the children's parts under this method (approximate), the
                  labelled span's own part under ``link``, whose inclusive CPU keeps the
                  whole sample (exact: it was taken within that subtree). Shared among the
                  spans known when the sample arrives, or, for samples that came before
                  their span, when it comes (``_share_adopted``, after its whole batch).
                  Also a timed sample whose instant leaves several children open (async
                  tasks on one thread): placed by its stack in the child whose operation's
                  learnt frames it matches (``frames``), its inclusive CPU still on the
                  deepest unambiguous span under its exact method; it stays there when its
                  stack does not tell.

A sample placed in a span is credited to it (self) and to its known ancestors in the same
service (inclusive CPU); a sample of a span not seen yet waits as an orphan, and one that
no known span explains is counted as unattributed, per service and minute.

``Placement`` holds the crediting, the sharing of untimed samples and their orphans, as
methods of ``CorrelatorState``; the placement of timed samples (by instant, then by stack)
is in ``timed``. The tables they read and write are the state's, declared here for the
type checker only (those the index of known spans writes too in ``known``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from pipeline.records import Sample
from processors.correlate.accumulators import (
    LINK,
    MINUTE_NS,
    SHARE,
    Acc,
    Key,
    M,
    add,
)
from processors.correlate.frames import Frames
from processors.correlate.known import KnownSpans
from processors.correlate.sizes import METHOD_ITEMS
from processors.correlate.spans import Orphan, Pending, SpanInfo, Tree

if TYPE_CHECKING:
    from collections import OrderedDict

    from processors.correlate.skew import Skew
    from processors.correlate.state import Stats


# services learnt to label every span (``learn_labels``): a bound, as on every table held
MAX_LEARNT_SERVICES = 100_000



class Placement(KnownSpans):
    """Placing samples in known spans: a part of ``CorrelatorState`` (see the module)."""

    spans: dict[Key, Pending]
    orphans: dict[Key, Orphan]
    emitted: OrderedDict[Key, tuple[float, SpanInfo]]
    late: dict[Key, Pending]
    unattributed: dict[tuple[str, int], Acc]
    skews: dict[tuple[str, int, str], Skew]
    labels_children: set[str]  # services whose untimed samples name non-root spans
    frames: Frames
    stats: Stats
    _orphan_timed: int

    def _key(self, smp: Sample) -> Key:
        """The span a labelled sample names: a span-only label of a known span with its
        trace (``b""`` for the trace where it is not known)."""
        return (smp.trace_id or self.trace_of.get(smp.span_id, b""), smp.span_id)

    def _resolve(self, smp: Sample) -> Sample:
        """A span-only sample of a known span, given its trace."""
        if not smp.trace_id and smp.span_id:
            tid = self.trace_of.get(smp.span_id)
            if tid is not None:
                return msgspec.structs.replace(smp, trace_id=tid)
        return smp

    def _acc_of(self, key: Key, now: float) -> Acc | None:
        """The accumulator of a known span: held, or (reported) its late entry."""
        pending = self.spans.get(key)
        if pending is not None:
            return pending.acc
        em = self.emitted.get(key)
        if em is None:
            return None
        late = self.late.get(key)
        if late is None:
            late = self.late[key] = Pending(em[1], Acc(now, em[1].service), now)
        return late.acc

    def _info(self, key: Key) -> SpanInfo | None:
        tree = self.trees.get(key[0])
        return tree.spans.get(key[1]) if tree is not None else None

    def _credit(self, key: Key, method: str, smp: Sample, value: int, count: int,
                leaf: str, now: float) -> None:
        """Add a sample's value to a known span (self) and its known ancestors in the same
        service (inclusive)."""
        acc = self._acc_of(key, now)
        assert acc is not None
        self._items += acc.add(method, smp.measure, value, count, leaf, smp.stack_id)
        if smp.measure == "cpu":
            self._lift(key, method, value, now)

    def _lift(self, key: Key, method: str, value: int, now: float) -> None:
        """Add CPU of the known span ``key`` to the inclusive CPU of its known ancestors in
        the same service. Where the chain meets a parent not known yet, the CPU waits for
        it in the trace's tree (``Tree.waiting``): whichever comes first, the span, its
        parent or its samples, every ancestor gets its descendants' CPU."""
        tree = self.trees.get(key[0])
        info = tree.spans.get(key[1]) if tree is not None else None
        seen = {key[1]}
        while tree is not None and info is not None and info.parent_span_id:
            parent_id = info.parent_span_id
            parent = tree.spans.get(parent_id)
            if parent is None:
                if tree.waiting is None:
                    tree.waiting = {}
                waiting = tree.waiting.setdefault(parent_id, {})
                wkey = (info.service, method)
                if wkey not in waiting:
                    self._items += 1
                waiting[wkey] = waiting.get(wkey, 0) + value
                break
            if parent.service != info.service or parent_id in seen:
                break
            seen.add(parent_id)
            pacc = self._acc_of((key[0], parent_id), now)
            if pacc is None:
                break
            methods = pacc.count()
            pacc.m(method).incl_cpu += value
            self._items += METHOD_ITEMS * (pacc.count() - methods)
            info = parent

    def _adopt(self, key: Key, info: SpanInfo, acc: Acc, now: float) -> None:
        """A span just known: the CPU it already holds (its samples came first) goes up
        to its ancestors, and the CPU of its descendants that waited for it comes in."""
        for method, m in acc.methods():
            if m.cpu_ns:
                self._lift(key, method, m.cpu_ns, now)
        tree = self.trees.get(key[0])
        waiting = tree.waiting.pop(key[1], None) if tree is not None and tree.waiting \
            else None
        if not waiting:
            return
        self._items -= len(waiting)
        for (service, method), value in waiting.items():
            if service != info.service:
                continue  # inclusive CPU stays within a service
            methods = acc.count()
            acc.m(method).incl_cpu += value
            self._items += METHOD_ITEMS * (acc.count() - methods)
            self._lift(key, method, value, now)

    def _add_linked(self, key: Key, service: str, group: list[tuple[Sample, str]],
                    now: float) -> None:
        """Untimed samples of one batch labelled ``key`` (resolved) by ``service``, with
        their leaf functions: credited to the span together (one lookup, one share of the
        subtree, one lift of their CPU), or kept as its orphan until it comes."""
        acc = self._acc_of(key, now)
        if acc is None:
            orphan = self.orphans.get(key)
            if orphan is None:
                orphan = self.orphans[key] = Orphan(Acc(now, service))
            oacc = orphan.acc
            self._items += sum(oacc.add(LINK, smp.measure, smp.value, smp.count, leaf,
                                        smp.stack_id) for smp, leaf in group)
            return
        cpu = [smp.value for smp, _ in group if smp.measure == "cpu"]
        parts, total = self._parts(key, service, now)
        if parts:
            self.stats.samples_shared += len(group)
            m = M()
            for smp, leaf in group:
                add(m, smp.measure, smp.value, smp.count, leaf, smp.stack_id)
            self._split(key, m, parts, total, now)
            before = acc.items()
            rest = Acc(now)
            rest.link = m  # the labelled span's own part, and the whole inclusive CPU
            acc.merge(rest)
            self._items += acc.items() - before
        else:
            self._items += sum(acc.add(LINK, smp.measure, smp.value, smp.count, leaf,
                                       smp.stack_id) for smp, leaf in group)
        if cpu:
            self._lift(key, LINK, sum(cpu), now)

    def _parts(self, key: Key, service: str, now: float
               ) -> tuple[list[tuple[bytes, int]], int]:
        """How untimed samples labelled ``key`` are shared (``link+share``): the known
        descendants that take a part, with their weights, and the weights' total (the
        labelled span's own included); none where they stay on the label."""
        tree = self.trees.get(key[0])
        if tree is None or service in self.labels_children:
            return [], 0
        shares = tree.shares(key[1])
        if not shares or not self._local_root(tree, key[1]):
            return [], 0
        parts = [(sid, w) for sid, w in shares[1:]
                 if self._acc_of((key[0], sid), now) is not None]
        total = shares[0][1] + sum(w for _, w in parts)
        return (parts, total) if parts and total > 0 else ([], 0)

    def _local_root(self, tree: Tree, span_id: bytes) -> bool:
        """Whether the span has no parent of its service known (what root-only span
        profilers label)."""
        info = tree.spans[span_id]
        parent = tree.spans.get(info.parent_span_id) if info.parent_span_id else None
        return parent is None or parent.service != info.service

    def learn_labels(self, key: Key, service: str) -> None:
        """Untimed samples of ``service`` labelled with ``key``, a span below another of its
        service: that profiler labels every span (OTLP links), not the local root only, so
        that service's untimed samples are never shared (``link+share``) from now on."""
        tree = self.trees.get(key[0])
        if tree is None or key[1] not in tree.spans:
            return
        if not self._local_root(tree, key[1]) and \
                len(self.labels_children) < MAX_LEARNT_SERVICES:
            self.labels_children.add(service)

    def _share_adopted(self, key: Key, now: float) -> None:
        """The untimed samples that came before their span (its ``link`` row so far),
        shared as ``_add_linked`` shares a batch's samples, by the same weights."""
        pending = self.spans.get(key)
        m = pending.acc.link if pending is not None else None
        if pending is None or m is None:
            return
        parts, total = self._parts(key, pending.info.service, now)
        if parts:
            self.stats.samples_shared += m.count
            self._split(key, m, parts, total, now)

    def _split(self, key: Key, m: M, parts: list[tuple[bytes, int]], total: int,
               now: float) -> None:
        """Move each descendant's part (``w / total``, rounded down) of the ``link`` data
        ``m`` of ``key`` into that descendant's ``link+share`` row, per function and stack
        too, its CPU up to the labelled span; what stays in ``m`` is the labelled span's
        own part (its inclusive CPU, the whole, is unchanged)."""
        cpu0, wall0, count0 = m.cpu_ns, m.wall_ns, m.count  # parts of the whole, not the rest
        lock0, alloc0 = m.lock_ns, m.alloc_bytes
        cpu_map0, wall_map0 = dict(m.cpu), dict(m.wall or {})
        lock_fns0, alloc_fns0 = dict(m.self_lock or {}), dict(m.self_alloc or {})
        for sid, w in parts:
            cpu, wall, count = cpu0 * w // total, wall0 * w // total, count0 * w // total
            lock, alloc = lock0 * w // total, alloc0 * w // total
            if not (cpu or wall or count or lock or alloc):
                continue
            ckey = (key[0], sid)
            acc = self._acc_of(ckey, now)
            assert acc is not None
            before = acc.items()
            c = acc.m(SHARE)
            m.cpu_ns -= cpu
            c.cpu_ns += cpu
            c.incl_cpu += cpu
            m.wall_ns -= wall
            c.wall_ns += wall
            m.count -= count
            c.count += count
            _move(cpu_map0, m.cpu, c.cpu, w, total)  # per function and stack
            if m.wall:  # wall time per function and stack, when the span has some
                c.wall = c.wall if c.wall is not None else {}
                _move(wall_map0, m.wall, c.wall, w, total)
            if lock or alloc:
                m.lock_ns -= lock
                c.lock_ns += lock
                m.alloc_bytes -= alloc
                c.alloc_bytes += alloc
                if lock_fns0 and m.self_lock is not None:
                    c.self_lock = c.self_lock if c.self_lock is not None else {}
                    _move(lock_fns0, m.self_lock, c.self_lock, w, total)
                if alloc_fns0 and m.self_alloc is not None:
                    c.self_alloc = c.self_alloc if c.self_alloc is not None else {}
                    _move(alloc_fns0, m.self_alloc, c.self_alloc, w, total)
            self._items += acc.items() - before
            if cpu:
                self._lift_to(ckey, key[1], cpu, now)

    def _lift_to(self, key: Key, stop: bytes, value: int, now: float) -> None:
        """``link+share`` CPU of ``key`` into the inclusive CPU of its ancestors below
        ``stop`` (all known: the share was computed over the known subtree of ``stop``)."""
        tree = self.trees[key[0]]
        parent_id = tree.spans[key[1]].parent_span_id
        while parent_id and parent_id != stop:
            pacc = self._acc_of((key[0], parent_id), now)
            info = tree.spans.get(parent_id)
            if pacc is None or info is None:
                break
            methods = pacc.count()
            pacc.m(SHARE).incl_cpu += value
            self._items += METHOD_ITEMS * (pacc.count() - methods)
            parent_id = info.parent_span_id

    def _unattributed(self, smp: Sample, now: float) -> None:
        ukey = (smp.service, smp.time_ns - smp.time_ns % MINUTE_NS)
        acc = self.unattributed.get(ukey)
        if acc is None:
            acc = self.unattributed[ukey] = Acc(now, smp.service)
        add(acc.m(LINK), smp.measure, smp.value, smp.count, None)


def _move(whole: dict[Any, int], src: dict[Any, int], dst: dict[Any, int], w: int,
          total: int) -> None:
    """Move ``w / total`` of each of ``whole``'s values (rounded down) from ``src`` into
    ``dst``."""
    for k, v in whole.items():
        part = v * w // total
        if part:
            src[k] -= part
            dst[k] = dst.get(k, 0) + part

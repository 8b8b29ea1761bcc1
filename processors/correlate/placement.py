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

Timed samples are placed a flush at a time (``_place_due``): first the ones their instant
places without doubt, from which ``frames`` learns what each operation runs, then the
ambiguous ones by stack; which samples are placed exactly, and where, does not depend on
the ambiguous ones or on what was learnt.

A sample placed in a span is credited to it (self) and to its known ancestors in the same
service (inclusive CPU); a sample of a span not seen yet waits as an orphan, and one that
no known span explains is counted as unattributed, per service and minute.

``Placement`` holds these methods of ``CorrelatorState``; the tables they read and write
are the state's, declared here for the type checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from pipeline.records import Sample
from processors.correlate.accumulators import (
    LINK,
    LINK_TIME,
    MINUTE_NS,
    SHARE,
    THREAD,
    WINDOW,
    Acc,
    Key,
    M,
    add,
)
from processors.correlate.frames import Frames
from processors.correlate.sizes import METHOD_ITEMS
from processors.correlate.spans import SLOT_NS, Orphan, Pending, SpanInfo, Tree

if TYPE_CHECKING:
    from collections import OrderedDict

    from processors.correlate.skew import Skew
    from processors.correlate.state import Stats


# services learnt to label every span (``learn_labels``): a bound, as on every table held
MAX_LEARNT_SERVICES = 100_000

# a timed sample its instant cannot place (``_place_due``): the sample and its leaf; for a
# labelled one the deepest unambiguous span, its exact method and its open children; for an
# unlabelled one (None, WINDOW and) the innermost spans open
Ambiguous = tuple[Sample, str, Key | None, str, list[tuple[Key, SpanInfo]]]


class Placement:
    """Placing samples in known spans: a part of ``CorrelatorState`` (see the module)."""

    spans: dict[Key, Pending]
    orphans: dict[Key, Orphan]
    emitted: OrderedDict[Key, tuple[float, SpanInfo]]
    late: dict[Key, Pending]
    unattributed: dict[tuple[str, int], Acc]
    trees: dict[bytes, Tree]
    slots: dict[tuple[str, int], dict[Key, None]]
    skews: dict[tuple[str, int, str], Skew]
    trace_of: dict[bytes, bytes]
    labels_children: set[str]  # services whose untimed samples name non-root spans
    frames: Frames
    stats: Stats
    _orphan_timed: int
    _items: int

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
        maps0 = [dict(d) for d in (m.self_cpu, m.self_wall, m.stack_cpu, m.stack_wall)]
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
            _move(maps0[0], m.self_cpu, c.self_cpu, w, total)
            _move(maps0[1], m.self_wall, c.self_wall, w, total)
            _move(maps0[2], m.stack_cpu, c.stack_cpu, w, total)
            _move(maps0[3], m.stack_wall, c.stack_wall, w, total)
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

    def _op(self, trace_id: bytes, info: SpanInfo) -> str:
        """What ``frames`` learns a span's samples under: its operation where it was called
        from (its parent's operation in the same service), as a synchronous call's stack
        shows its callers' frames: two spans of one name under different callers differ."""
        tree = self.trees.get(trace_id)
        parent = tree.spans.get(info.parent_span_id) if tree is not None and \
            info.parent_span_id else None
        caller = parent.name if parent is not None and parent.service == info.service else ""
        return f"{info.name}\x1f{caller}"

    def _skew_of(self, smp: Sample) -> int:
        sk = self.skews.get((smp.service, smp.pid, smp.host))
        return sk.estimate if sk is not None else 0

    def _place_due(self, due: list[tuple[Sample, str]], now: float) -> None:
        """Timed samples due: those their instant places first, then the ambiguous ones by
        stack, with what ``frames`` learnt from the first (for the services where samples
        were ambiguous: elsewhere nothing is learnt)."""
        exact: list[tuple[Sample, SpanInfo]] = []  # placed exactly: in that span
        ambiguous: list[Ambiguous] = []
        for smp, leaf in due:
            got = (self._place_linked(smp, leaf, now, exact) if smp.span_id
                   else self._place_unlinked(smp, leaf, now))
            if got is not None:
                ambiguous.append(got)
        frames = self.frames
        for a in ambiguous:
            frames.ambiguous(a[0].service)
        if frames.services:
            for smp, info in exact:
                if smp.service in frames.services:
                    frames.learn(smp.service, {self._op(smp.trace_id, info): 1.0},
                                 smp.stack_id)
        # then from the ambiguous ones, by what it believes of each (its posterior), before
        # any is placed: the first of a flush are placed as well as the last
        for smp, _, dkey, _, open_ in ambiguous:
            names = [self._op(k[0], i) for k, i in open_]
            if dkey is not None:
                dinfo = self._info(dkey)
                names.append(self._op(dkey[0], dinfo) if dinfo is not None else "")
            posterior = frames.choose(smp.service, names, smp.stack_id)[1]
            if posterior:
                frames.learn(smp.service, posterior, smp.stack_id)
        for smp, leaf, dkey, method, open_ in ambiguous:
            if dkey is None:
                self._window(smp, leaf, open_, now)
            else:
                self._among_children(smp, leaf, dkey, method, open_, now)

    def _place_linked(self, smp: Sample, leaf: str, now: float,
                      exact: list[tuple[Sample, SpanInfo]]) -> Ambiguous | None:
        """A timed, labelled sample: into the deepest span open at its instant (its
        operation and stack added to ``exact``), or, where children open then cannot be
        told apart by thread, returned to be placed by stack."""
        smp = self._resolve(smp)
        key = (smp.trace_id, smp.span_id)
        tree = self.trees.get(smp.trace_id)
        label = tree.spans.get(smp.span_id) if tree is not None else None
        if tree is None or label is None:
            orphan = self.orphans.get(key)
            if orphan is None:
                orphan = self.orphans[key] = Orphan(Acc(now, smp.service))
            orphan.timed.append((smp, leaf))
            self._orphan_timed += 1
            return None
        t = smp.time_ns - self._skew_of(smp)
        target, info, open_ = deepest(tree, smp.span_id, label, t, smp.thread_id)
        method = LINK if target == smp.span_id else LINK_TIME
        if open_:
            return (smp, leaf, (smp.trace_id, target), method,
                    [((smp.trace_id, cid), c) for cid, c in open_])
        if method == LINK_TIME:
            self.stats.samples_placed_in_child += 1
        self._credit((smp.trace_id, target), method, smp, smp.value, smp.count, leaf, now)
        exact.append((smp, info))
        return None

    def _among_children(self, smp: Sample, leaf: str, dkey: Key, method: str,
                        open_: list[tuple[Key, SpanInfo]], now: float) -> None:
        """A labelled sample whose instant leaves ``open_``, children of ``dkey`` (the
        deepest span it is surely in), open at once: in the children of the operation its
        stack matches (``link+share``, shared equally where several are of it), then down
        to their deepest span open then; on ``dkey`` under ``method`` where the stack does
        not tell (or matches ``dkey``'s own operation). ``dkey`` keeps the inclusive CPU
        under ``method`` either way (it was taken in its subtree: exact)."""
        info = self._info(dkey)
        assert info is not None
        names = [self._op(dkey[0], info), *(self._op(k[0], c) for k, c in open_)]
        best = self.frames.choose(smp.service, names, smp.stack_id)[0]
        targets = [k for k, op in zip((k for k, _ in open_), names[1:], strict=True)
                   if op == best] if best not in (None, names[0]) else []
        if not targets:
            if method == LINK_TIME:
                self.stats.samples_placed_in_child += 1
            self._credit(dkey, method, smp, smp.value, smp.count, leaf, now)
            return
        self.stats.samples_by_stack += 1
        if len(targets) == 1:  # and down, where the instant tells
            tree = self.trees[dkey[0]]
            t = smp.time_ns - self._skew_of(smp)
            cid = targets[0][1]
            targets = [(dkey[0], deepest(tree, cid, tree.spans[cid], t, smp.thread_id)[0])]
        n = len(targets)
        for i, ckey in enumerate(targets):
            share = smp.value // n + (1 if i < smp.value % n else 0)
            ticks = smp.count // n + (1 if i < smp.count % n else 0)
            if not (share or ticks):
                continue
            acc = self._acc_of(ckey, now)
            assert acc is not None
            self._items += acc.add(SHARE, smp.measure, share, ticks, leaf, smp.stack_id)
            if smp.measure == "cpu" and share:
                self._lift_to(ckey, dkey[1], share, now)
        if smp.measure == "cpu":
            dacc = self._acc_of(dkey, now)
            assert dacc is not None
            methods = dacc.count()
            dacc.m(method).incl_cpu += smp.value
            self._items += METHOD_ITEMS * (dacc.count() - methods)
            self._lift(dkey, method, smp.value, now)

    def _place_unlinked(self, smp: Sample, leaf: str, now: float) -> Ambiguous | None:
        """A timed sample without a label: by process and thread, else by time window
        (where several spans are open then, returned to be placed by stack)."""
        t = smp.time_ns - self._skew_of(smp)
        open_: list[tuple[Key, SpanInfo]] = []
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
            return None
        if any(info.thread_id for _, info in open_):
            if not smp.thread_id:
                on_thread: list[tuple[Key, SpanInfo]] = []
            else:
                on_thread = [(k, i) for k, i in open_ if i.thread_id == smp.thread_id]
            if smp.thread_id and on_thread:
                # the innermost span running on that thread: the latest to have started
                key = max(on_thread, key=lambda ki: (ki[1].start_ns, -ki[1].duration_ns))[0]
                self.stats.samples_by_thread += 1
                self._credit(key, THREAD, smp, smp.value, smp.count, leaf, now)
                return None
            if smp.thread_id:
                self._unattributed(smp, now)  # its thread ran none of the known spans
                return None
        # only time is known: the innermost open spans (approximate)
        parents = {(k[0], i.parent_span_id) for k, i in open_}
        leaves = sorted((ki for ki in open_ if ki[0] not in parents), key=lambda ki: ki[0])
        if len(leaves) > 1:
            return (smp, leaf, None, WINDOW, leaves)
        self._window(smp, leaf, leaves, now)
        return None

    def _window(self, smp: Sample, leaf: str, leaves: list[tuple[Key, SpanInfo]],
                now: float) -> None:
        """An unlabelled sample among the innermost spans open at its instant: given to
        those of the operation its stack matches, else shared equally by all."""
        keys = [k for k, _ in leaves]
        if len(leaves) > 1:
            names = [self._op(k[0], i) for k, i in leaves]
            best = self.frames.choose(smp.service, names, smp.stack_id)[0]
            if best is not None:
                keys = [k for k, op in zip(keys, names, strict=True) if op == best]
                self.stats.samples_by_stack += 1
        n = len(keys)
        self.stats.samples_by_window += 1
        for i, key in enumerate(keys):
            share = smp.value // n + (1 if i < smp.value % n else 0)
            ticks = smp.count // n + (1 if i < smp.count % n else 0)
            if share or ticks:
                self._credit(key, WINDOW, smp, share, ticks, leaf, now)

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


def deepest(tree: Tree, span_id: bytes, info: SpanInfo, t: int, thread: int
            ) -> tuple[bytes, SpanInfo, list[tuple[bytes, SpanInfo]]]:
    """From the labelled span down: the deepest span of its service open at ``t``,
    descending only while the choice is unambiguous (on ``thread`` when spans say theirs);
    with it, its children open at ``t`` where there are several it cannot tell apart."""
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
            return span_id, info, open_ if len(open_) > 1 else []
        span_id, info = open_[0]
        seen.add(span_id)

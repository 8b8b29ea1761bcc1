"""Timed samples placed by their instant, and by their stack where it is not enough: the
``link+time``, ``thread`` and ``window`` methods, and ``link+share`` by stack, of
``placement`` (see its docstring for each method). ``TimedPlacement`` holds these methods
of ``CorrelatorState``; ``Placement`` the crediting they share with untimed samples.

Timed samples are placed a flush at a time (``_place_due``): first the ones their instant
places without doubt, from which ``frames`` learns what each operation runs, then the
ambiguous ones by stack; which samples are placed exactly, and where, does not depend on
the ambiguous ones or on what was learnt.
"""

from __future__ import annotations

from pipeline.records import Sample
from processors.correlate.accumulators import LINK, LINK_TIME, SHARE, THREAD, WINDOW, Acc, Key
from processors.correlate.placement import Placement
from processors.correlate.sizes import METHOD_ITEMS
from processors.correlate.spans import SLOT_NS, Orphan, SpanInfo, Tree

# a timed sample its instant cannot place (``_place_due``): the sample and its leaf; for a
# labelled one the deepest unambiguous span, its exact method and its open children; for an
# unlabelled one (None, WINDOW and) the innermost spans open
Ambiguous = tuple[Sample, str, Key | None, str, list[tuple[Key, SpanInfo]]]


class TimedPlacement(Placement):
    """Placing timed samples in known spans: a part of ``CorrelatorState``."""

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
        for ckey, (share, ticks) in zip(targets, equal_parts(smp, len(targets)), strict=True):
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
        self.stats.samples_by_window += 1
        for key, (share, ticks) in zip(keys, equal_parts(smp, len(keys)), strict=True):
            if share or ticks:
                self._credit(key, WINDOW, smp, share, ticks, leaf, now)


def equal_parts(smp: Sample, n: int) -> list[tuple[int, int]]:
    """A sample's value and count in ``n`` parts as equal as whole numbers allow (the
    remainders to the first parts): they add up to the sample's exactly."""
    return [(smp.value // n + (1 if i < smp.value % n else 0),
             smp.count // n + (1 if i < smp.count % n else 0)) for i in range(n)]


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

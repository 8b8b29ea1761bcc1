"""Lock wait and allocated bytes joined to spans like CPU (issue #21): by label, by the
instant in a child span (``link+time``), by thread, by time window, shared to children
(``link+share``), as orphans; never added to CPU or its sample count; and crash
recovery's reconciliation carries them."""

from __future__ import annotations

from pipeline.records import Attribution, AttributionBatch, ProfileBatch, Sample, Span, Stack
from processors.correlate.reconcile import Stored, deltas, expected
from processors.correlate.state import CorrelatorState
from tests.processors.test_placement import (
    CHILD,
    GRANDCHILD,
    MS,
    ROOT,
    SIBLING,
    STACKS,
    T0,
    TRACE,
    smp,
    span,
    totals,
    tree,
)

KB = 1024
LOCK_STACKS = {**STACKS, 2: Stack(2, ["Mutex.lock", "update", "main"], ["m.go"] * 3, [1, 2, 3]),
               3: Stack(3, ["make_slice", "build", "main"], ["b.go"] * 3, [1, 2, 3])}


def lock(at_ms: float, ns: int, label: bytes | None = ROOT, thread: int = 0,
         timed: bool = True) -> Sample:
    s = smp(at_ms, label, thread=thread, value=ns, timed=timed, measure="lock")
    s.stack_id = 2
    return s


def alloc(at_ms: float, n: int, label: bytes | None = ROOT, thread: int = 0,
          timed: bool = True) -> Sample:
    s = smp(at_ms, label, thread=thread, value=n, timed=timed, measure="alloc")
    s.stack_id, s.unit = 3, "bytes"
    return s


def run_state(spans: list[Span], samples: list[Sample]) -> AttributionBatch:
    st = CorrelatorState(grace=1.0)
    st.add_spans(spans, 0.0)
    st.add_samples(ProfileBatch(samples, LOCK_STACKS), 0.5)
    first = st.take_due(now=5.0)
    rest = st.take_due(now=1000.0, force=True)
    return AttributionBatch(first.attributions + rest.attributions,
                            first.unattributed + rest.unattributed)


def state_run(spans: list[Span], samples: list[Sample]) -> list[Attribution]:
    return run_state(spans, samples).attributions


class TestJoined:
    def test_labelled_untimed_lock_and_alloc_join_their_span(self) -> None:
        """A span's lock wait and bytes, in all and per leaf function; its CPU, wall and
        sample count are only the CPU samples'."""
        spans = [span(ROOT, b"", 0, 100)]
        rows = state_run(spans, [lock(0, 30 * MS, timed=False), lock(0, 5 * MS, timed=False),
                                 alloc(0, 64 * KB, timed=False), smp(0, timed=False)])
        (row,) = rows
        assert (row.span_id, row.method) == (ROOT, "link")
        assert (row.lock_ns, row.alloc_bytes) == (35 * MS, 64 * KB)
        assert row.self_lock_ns == {"Mutex.lock": 35 * MS}
        assert row.self_alloc_bytes == {"make_slice": 64 * KB}
        assert (row.cpu_ns, row.sample_count, row.wall_ns) == (10 * MS, 1, 0)
        assert row.self_cpu_ns == {"work": 10 * MS}

    def test_lock_alone_makes_a_row(self) -> None:
        """A span that only waited (no CPU sample) still gets a row with its lock wait."""
        rows = state_run([span(ROOT, b"", 0, 100)], [lock(50, 80 * MS, timed=False)])
        assert [(r.method, r.lock_ns, r.cpu_ns, r.span_known) for r in rows] == \
            [("link", 80 * MS, 0, True)]

    def test_timed_in_the_child_running_then(self) -> None:
        """Labelled with the root, taken at 25 ms: the grandchild's (``link+time``)."""
        out = run_state(tree(), [lock(25, 7 * MS), alloc(75, 3 * KB)])
        assert totals(out, "lock_ns") == {(GRANDCHILD, "link+time"): 7 * MS}
        assert totals(out, "alloc_bytes") == {(SIBLING, "link+time"): 3 * KB}

    def test_unlabelled_by_thread_then_window(self) -> None:
        """No label: the innermost span on the sample's thread, else the open spans by
        time (approximate methods, as for CPU)."""
        out = run_state(tree(), [lock(15, 4 * MS, None, thread=7)])
        assert totals(out, "lock_ns") == {(CHILD, "thread"): 4 * MS}
        plain = [span(ROOT, b"", 0, 100), span(CHILD, ROOT, 10, 60)]
        out = run_state(plain, [alloc(20, 1000, None)])
        assert totals(out, "alloc_bytes") == {(CHILD, "window"): 1000}

    def test_untimed_shared_with_children_by_self_time(self) -> None:
        """An untimed root-labelled profile is shared with the children by their self
        time, lock and bytes as CPU, and the parts add up to what was sent."""
        spans = [span(ROOT, b"", 0, 100), span(CHILD, ROOT, 0, 50)]
        out = run_state(spans, [lock(0, 100 * MS, timed=False), alloc(0, 1000, timed=False),
                                smp(0, timed=False)])
        lk = totals(out, "lock_ns")
        assert lk == {(ROOT, "link"): 50 * MS, (CHILD, "link+share"): 50 * MS}
        assert sum(totals(out, "alloc_bytes").values()) == 1000
        shared = [r for r in out.attributions if r.method == "link+share"]
        assert shared[0].self_lock_ns == {"Mutex.lock": 50 * MS}

    def test_orphans_keep_them(self) -> None:
        """Lock wait of a span never seen is reported as an orphan row, as CPU is."""
        st = CorrelatorState(grace=1.0, orphan_timeout=5.0)
        st.add_samples(ProfileBatch([lock(0, 9 * MS, timed=False)], LOCK_STACKS), 0.0)
        rows = st.take_due(now=100.0, force=True).attributions
        assert [(r.span_known, r.lock_ns, r.self_lock_ns) for r in rows] == \
            [(False, 9 * MS, {"Mutex.lock": 9 * MS})]

    def test_off_cpu_and_other_still_ignored(self) -> None:
        s = smp(0, timed=False, measure="other")
        assert state_run([span(ROOT, b"", 0, 100)], [s]) == []


class TestRecovery:
    def test_deltas_bring_lock_and_bytes_up_to_expected(self) -> None:
        """What is stored is not written again; the rest is, per function too."""
        spans = [span(ROOT, b"", 0, 100)]
        samples = [lock(0, 30 * MS, timed=False), alloc(0, 4 * KB, timed=False),
                   smp(0, timed=False)]
        rows = expected(spans, samples, LOCK_STACKS)
        out = deltas(rows, Stored())
        assert [(r.lock_ns, r.alloc_bytes, r.self_lock_ns) for r in out] == \
            [(30 * MS, 4 * KB, {"Mutex.lock": 30 * MS})]
        key = (TRACE, ROOT, "link")
        stored = Stored(rows={key: [10 * MS, 0, 1, 10 * MS, 20 * MS, 4 * KB, 1]},
                        functions={(key, "Mutex.lock"): (0, 0, 20 * MS, 0),
                                   (key, "make_slice"): (0, 0, 0, 4 * KB),
                                   (key, "work"): (10 * MS, 0, 0, 0)})
        out = deltas(rows, stored)
        assert [(r.cpu_ns, r.lock_ns, r.alloc_bytes, r.self_lock_ns, r.self_alloc_bytes)
                for r in out] == [(0, 10 * MS, 0, {"Mutex.lock": 10 * MS}, {})]
        assert T0  # the spans' times are the placement tests' (T0)

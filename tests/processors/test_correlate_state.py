"""processors/correlate/state.py: the join of spans and samples (``CorrelatorState``).

The state is pure and driven by an explicit clock, so every test passes ``now`` by hand:
times are seconds on that clock, and the windows are the defaults unless a test says so
(grace 10 s, orphan_timeout 60 s, late_window 600 s).
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.records import (
    Attribution,
    AttributionBatch,
    Measure,
    ProfileBatch,
    Sample,
    Span,
    Stack,
)
from processors.correlate.accumulators import MINUTE_NS, UNKNOWN_FRAME
from processors.correlate.state import CorrelatorState

TRACE = bytes(range(1, 17))
OTHER_TRACE = bytes(range(101, 117))
SPAN_A = bytes(range(1, 9))
SPAN_B = bytes(range(11, 19))
SPAN_C = bytes(range(21, 29))
PARENT = bytes(range(31, 39))
T0_NS = 1_700_000_000 * 1_000_000_000  # a wall-clock time for spans and samples

LEAF_STACK = Stack(1, ["leaf", "handler", "main"], ["a.py", "b.py", "c.py"], [1, 2, 3])
OTHER_STACK = Stack(2, ["other_leaf", "handler", "main"], ["d.py", "b.py", "c.py"], [4, 2, 3])
SAME_LEAF_STACK = Stack(3, ["leaf", "worker", "main"], ["a.py", "e.py", "c.py"], [1, 5, 3])
EMPTY_STACK = Stack(4, [], [], [])
STACKS = {s.stack_id: s for s in (LEAF_STACK, OTHER_STACK, SAME_LEAF_STACK, EMPTY_STACK)}


def span(span_id: bytes = SPAN_A, name: str = "GET /users", trace_id: bytes = TRACE,
         service: str = "api", start_ns: int = T0_NS, duration_ns: int = 5_000_000) -> Span:
    return Span(trace_id, span_id, PARENT, name, 2, service, start_ns, start_ns + duration_ns)


def sample(value: int, span_id: bytes = SPAN_A, measure: Measure = "cpu", stack_id: int = 1,
           trace_id: bytes = TRACE, service: str = "api", time_ns: int = T0_NS,
           count: int = 1) -> Sample:
    return Sample(trace_id, span_id, service, time_ns, stack_id, measure, value, count,
                  measure, "nanoseconds")


def samples(*items: Sample) -> ProfileBatch:
    return ProfileBatch(list(items), dict(STACKS))


def rows_of(batch: AttributionBatch, span_id: bytes = SPAN_A,
            trace_id: bytes = TRACE) -> list[Attribution]:
    return [a for a in batch.attributions if (a.trace_id, a.span_id) == (trace_id, span_id)]


def only_row(batch: AttributionBatch) -> Attribution:
    assert len(batch.attributions) == 1, batch.attributions
    return batch.attributions[0]


class TestSamplesBeforeSpan:
    def test_samples_merge_into_the_span_row(self) -> None:
        """Samples that arrive first are joined to the span that follows: one row, known."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(300), sample(200)), now=0.0)
        st_.add_spans([span()], now=5.0)
        row = only_row(st_.take_due(now=15.0))
        assert row.span_known is True
        assert (row.name, row.service, row.parent_span_id) == ("GET /users", "api", PARENT)
        assert (row.start_ns, row.duration_ns) == (T0_NS, 5_000_000)
        assert (row.cpu_ns, row.sample_count) == (500, 2)
        assert st_.stats.orphans_reported == 0

    def test_span_arriving_just_before_orphan_timeout_still_merges(self) -> None:
        """A span 59 s after its samples (timeout 60 s) takes them: no orphan row at 60 s."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(700)), now=0.0)
        st_.add_spans([span()], now=59.0)
        assert st_.take_due(now=60.0).attributions == []
        row = only_row(st_.take_due(now=69.0))
        assert (row.span_known, row.cpu_ns) == (True, 700)

    def test_samples_for_another_span_are_not_merged(self) -> None:
        """Only the samples with the span's own (trace_id, span_id) are joined to it."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(100), sample(900, span_id=SPAN_B),
                                sample(50, trace_id=OTHER_TRACE)), now=0.0)
        st_.add_spans([span()], now=1.0)
        out = st_.take_due(now=11.0)
        assert [r.cpu_ns for r in out.attributions] == [100]


class TestLateSamples:
    def test_late_sample_adds_a_delta_row(self) -> None:
        """A sample after the span's row was reported is a second row; the rows sum up."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(samples(sample(400)), now=1.0)
        first = only_row(st_.take_due(now=10.0))
        assert first.cpu_ns == 400
        st_.add_samples(samples(sample(250), sample(50)), now=20.0)
        second = only_row(st_.take_due(now=20.0))
        assert (second.span_known, second.name, second.cpu_ns) == (True, "GET /users", 300)
        assert (second.start_ns, second.duration_ns) == (T0_NS, 5_000_000)
        assert first.cpu_ns + second.cpu_ns == 700
        assert first.sample_count + second.sample_count == 3
        assert st_.stats.late_reported == 1

    def test_late_sample_is_reported_at_the_next_take_due(self) -> None:
        """A late sample waits for neither grace nor orphan_timeout."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.take_due(now=10.0)
        st_.add_samples(samples(sample(10)), now=10.5)
        assert st_.entries == 1
        assert [r.cpu_ns for r in st_.take_due(now=10.5).attributions] == [10]
        assert st_.entries == 0

    def test_after_late_window_sample_waits_as_orphan(self) -> None:
        """Once late_window has passed, the span is forgotten: its samples become orphans."""
        st_ = CorrelatorState(late_window=100.0)
        st_.add_spans([span()], now=0.0)
        st_.take_due(now=10.0)  # reported; remembered until 110
        st_.take_due(now=110.0)  # forgotten
        st_.add_samples(samples(sample(5)), now=111.0)
        assert st_.take_due(now=112.0).attributions == []
        row = only_row(st_.take_due(now=171.0))
        assert (row.span_known, row.cpu_ns) == (False, 5)


class TestOrphans:
    def test_orphan_reported_unknown_after_timeout(self) -> None:
        """Samples whose span never comes are reported with span_known=False at the timeout."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(800, service="worker")), now=0.0)
        assert st_.take_due(now=59.9).attributions == []
        row = only_row(st_.take_due(now=60.0))
        assert (row.trace_id, row.span_id) == (TRACE, SPAN_A)
        assert (row.span_known, row.name, row.service) == (False, "", "worker")
        assert (row.parent_span_id, row.start_ns, row.duration_ns) == (b"", 0, 0)
        assert (row.cpu_ns, row.sample_count) == (800, 1)
        assert st_.stats.orphans_reported == 1
        assert st_.entries == 0

    def test_orphan_timeout_counts_from_first_sample(self) -> None:
        """More samples for the same orphan do not push its report back."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(1)), now=0.0)
        st_.add_samples(samples(sample(2)), now=50.0)
        assert only_row(st_.take_due(now=60.0)).cpu_ns == 3

    def test_span_after_orphan_report_adds_no_row(self) -> None:
        """A span that comes after its orphan was reported adds no row (CPU not doubled;
        its name and duration are in otel_traces); its later samples are its own."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(800)), now=0.0)
        assert only_row(st_.take_due(now=60.0)).cpu_ns == 800
        st_.add_spans([span()], now=70.0)
        assert st_.take_due(now=80.0, force=True).attributions == []
        st_.add_spans([span(SPAN_B)], now=90.0)
        st_.add_samples(samples(sample(5, SPAN_B)), now=91.0)
        known = only_row(st_.take_due(now=100.0))
        assert (known.span_known, known.name, known.cpu_ns) == (True, "GET /users", 5)


class TestGrace:
    def test_nothing_before_grace(self) -> None:
        """A span is held for ``grace`` after it arrives, waiting for its samples."""
        st_ = CorrelatorState(grace=10.0)
        st_.add_spans([span()], now=100.0)
        assert st_.take_due(now=100.0).attributions == []
        assert st_.take_due(now=109.99).attributions == []
        assert st_.entries == 1

    def test_reported_once_grace_passed(self) -> None:
        """At ``arrival + grace`` the span is reported, exactly once."""
        st_ = CorrelatorState(grace=10.0)
        st_.add_spans([span()], now=100.0)
        st_.add_samples(samples(sample(42)), now=105.0)
        row = only_row(st_.take_due(now=110.0))
        assert (row.span_known, row.cpu_ns) == (True, 42)
        assert st_.take_due(now=200.0).attributions == []

    def test_grace_counts_per_span(self) -> None:
        """Two spans arriving at different times are reported at their own deadlines."""
        st_ = CorrelatorState(grace=10.0)
        st_.add_spans([span(SPAN_A)], now=0.0)
        st_.add_spans([span(SPAN_B)], now=5.0)
        st_.add_samples(samples(sample(1, SPAN_A), sample(2, SPAN_B)), now=6.0)
        assert [r.span_id for r in st_.take_due(now=10.0).attributions] == [SPAN_A]
        assert [r.span_id for r in st_.take_due(now=15.0).attributions] == [SPAN_B]


class TestForce:
    def test_force_reports_everything(self) -> None:
        """force=True reports pending spans, orphans, late samples and unattributed at once."""
        st_ = CorrelatorState()
        st_.add_spans([span(SPAN_A)], now=0.0)
        st_.take_due(now=10.0)  # SPAN_A reported, now remembered
        st_.add_spans([span(SPAN_B, name="B")], now=10.0)
        st_.add_samples(samples(sample(1, SPAN_A), sample(2, SPAN_B), sample(4, SPAN_C),
                                sample(8, span_id=b"")), now=10.0)
        out = st_.take_due(now=10.0, force=True)
        by_span = {r.span_id: r for r in out.attributions}
        assert set(by_span) == {SPAN_A, SPAN_B, SPAN_C}
        assert (by_span[SPAN_A].span_known, by_span[SPAN_A].cpu_ns) == (True, 1)
        assert (by_span[SPAN_B].span_known, by_span[SPAN_B].cpu_ns) == (True, 2)
        assert (by_span[SPAN_C].span_known, by_span[SPAN_C].cpu_ns) == (False, 4)
        assert [u.cpu_ns for u in out.unattributed] == [8]
        assert st_.entries == 0
        assert st_.take_due(now=10.0, force=True).attributions == []


class TestDuplicates:
    def test_duplicate_while_pending_is_ignored(self) -> None:
        """A retried export of a held span keeps the first copy: one row, counted duplicate."""
        st_ = CorrelatorState()
        st_.add_spans([span(name="first")], now=0.0)
        st_.add_samples(samples(sample(10)), now=1.0)
        st_.add_spans([span(name="second")], now=2.0)
        row = only_row(st_.take_due(now=10.0))
        assert (row.name, row.cpu_ns) == ("first", 10)
        assert (st_.stats.spans_in, st_.stats.spans_duplicate) == (2, 1)

    def test_duplicate_after_report_is_ignored(self) -> None:
        """A copy arriving after the span was reported (within late_window) adds no row."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(samples(sample(3)), now=1.0)
        only_row(st_.take_due(now=10.0))
        st_.add_spans([span()], now=20.0)
        assert st_.take_due(now=1000.0, force=True).attributions == []
        assert st_.stats.spans_duplicate == 1

    def test_duplicate_in_one_batch(self) -> None:
        """The same span twice in one batch is one span."""
        st_ = CorrelatorState()
        st_.add_spans([span(), span()], now=0.0)
        st_.add_samples(samples(sample(3)), now=1.0)
        assert len(st_.take_due(now=10.0).attributions) == 1
        assert st_.stats.spans_duplicate == 1


class TestUnlinked:
    def test_unlinked_go_to_unattributed_per_service_and_minute(self) -> None:
        """Samples without a span id are summed per (service, minute), not attributed."""
        minute = T0_NS - T0_NS % MINUTE_NS
        st_ = CorrelatorState()
        st_.add_samples(samples(
            sample(100, span_id=b"", time_ns=minute + 1),
            sample(200, span_id=b"", time_ns=minute + MINUTE_NS - 1, count=2),
            sample(400, span_id=b"", time_ns=minute + MINUTE_NS),
            sample(800, span_id=b"", service="worker", time_ns=minute + 5),
        ), now=0.0)
        out = st_.take_due(now=0.0)
        assert out.attributions == []
        got = {(u.service, u.minute_ns): (u.cpu_ns, u.sample_count) for u in out.unattributed}
        assert got == {
            ("api", minute): (300, 3),
            ("api", minute + MINUTE_NS): (400, 1),
            ("worker", minute): (800, 1),
        }
        assert (st_.stats.samples_unlinked, st_.stats.samples_linked) == (4, 0)
        assert st_.take_due(now=1.0).unattributed == []

    def test_unlinked_with_trace_id_is_still_unlinked(self) -> None:
        """A trace id alone does not name a span: the sample is unattributed."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(5, span_id=b"", trace_id=TRACE)), now=0.0)
        out = st_.take_due(now=0.0, force=True)
        assert out.attributions == []
        assert [u.cpu_ns for u in out.unattributed] == [5]

    def test_unlinked_wall_goes_to_wall(self) -> None:
        """Unlinked wall time is kept apart from unlinked CPU."""
        st_ = CorrelatorState()
        st_.add_samples(samples(sample(5, span_id=b""),
                                sample(70, span_id=b"", measure="wall")), now=0.0)
        (u,) = st_.take_due(now=0.0).unattributed
        assert (u.cpu_ns, u.wall_ns) == (5, 70)


class TestMeasures:
    def test_wall_goes_to_wall_ns(self) -> None:
        """Wall samples add to wall_ns and self_wall_ns, never to cpu_ns."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(samples(sample(1000, measure="wall"), sample(30)), now=0.0)
        row = only_row(st_.take_due(now=10.0))
        assert (row.cpu_ns, row.wall_ns) == (30, 1000)
        assert row.self_wall_ns == {"leaf": 1000}
        assert row.self_cpu_ns == {"leaf": 30}

    def test_off_cpu_and_other_are_not_attributed(self) -> None:
        """off_cpu and other samples are counted in but add nothing to any row."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(samples(sample(1000, measure="off_cpu"), sample(7, measure="other"),
                                sample(9, span_id=SPAN_B, measure="off_cpu"),
                                sample(3, span_id=b"", measure="other")), now=0.0)
        assert st_.entries == 1  # no orphan for SPAN_B
        out = st_.take_due(now=10.0, force=True)
        assert out.attributions == []  # a span without CPU or wall time has no row
        assert out.unattributed == []
        assert st_.stats.samples_in == 4
        assert (st_.stats.samples_linked, st_.stats.samples_unlinked) == (0, 0)


class TestSelfCpu:
    def test_keyed_by_leaf_function(self) -> None:
        """self_cpu_ns is keyed by stack.functions[0]; equal leaves add up."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(samples(sample(10, stack_id=LEAF_STACK.stack_id),
                                sample(20, stack_id=OTHER_STACK.stack_id),
                                sample(40, stack_id=SAME_LEAF_STACK.stack_id)), now=0.0)
        row = only_row(st_.take_due(now=10.0))
        assert row.self_cpu_ns == {"leaf": 50, "other_leaf": 20}
        assert sum(row.self_cpu_ns.values()) == row.cpu_ns

    def test_missing_or_empty_stack_is_unknown_frame(self) -> None:
        """A stack id not in the batch, or an empty stack, counts under ``[unknown]``."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(samples(sample(3, stack_id=999),
                                sample(4, stack_id=EMPTY_STACK.stack_id)), now=0.0)
        row = only_row(st_.take_due(now=10.0))
        assert row.self_cpu_ns == {UNKNOWN_FRAME: 7}

    def test_stacks_come_from_the_samples_own_batch(self) -> None:
        """The leaf is looked up in the batch that carried the sample."""
        st_ = CorrelatorState()
        st_.add_spans([span()], now=0.0)
        st_.add_samples(ProfileBatch([sample(5, stack_id=77)],
                                     {77: Stack(77, ["mine"], ["m.py"], [1])}), now=0.0)
        st_.add_samples(ProfileBatch([sample(6, stack_id=77)], {}), now=0.0)
        row = only_row(st_.take_due(now=10.0))
        assert row.self_cpu_ns == {"mine": 5, UNKNOWN_FRAME: 6}


class TestMaxEntries:
    def test_spans_beyond_bound_are_evicted_and_reported(self) -> None:
        """Five spans into a bound of two: three are reported early, none is lost."""
        st_ = CorrelatorState(max_entries=2)
        ids = [bytes([i]) * 8 for i in range(1, 6)]
        st_.add_samples(samples(*(sample(10 * (i + 1), span_id=s) for i, s in enumerate(ids))),
                        now=0.0)
        assert st_.entries <= 2
        st_.add_spans([span(s, name=f"op{i}") for i, s in enumerate(ids)], now=1.0)
        assert st_.entries <= 2
        assert st_.stats.evicted >= 3
        early = st_.take_due(now=1.0)  # before grace and orphan_timeout
        assert early.attributions, "evicted entries are reported at the next take_due"
        rest = st_.take_due(now=1.0, force=True)
        rows = early.attributions + rest.attributions
        cpu: dict[bytes, int] = defaultdict(int)
        for r in rows:
            cpu[r.span_id] += r.cpu_ns
        assert cpu == {s: 10 * (i + 1) for i, s in enumerate(ids)}
        # rows of spans known when reported carry their names (the others, reported as
        # orphans before their span came, are named from otel_traces by queries)
        known = {r.span_id: r.name for r in rows if r.span_known}
        assert known and all(known[s] == f"op{i}" for i, s in enumerate(ids) if s in known)

    def test_span_eviction_reports_oldest_first(self) -> None:
        """Eviction takes the oldest span; the newest stay held for their window."""
        st_ = CorrelatorState(max_entries=2)
        for i, sid in enumerate((SPAN_A, SPAN_B, SPAN_C)):
            st_.add_spans([span(sid)], now=float(i))
            st_.add_samples(samples(sample(1, sid)), now=float(i))
        assert st_.entries == 2
        assert st_.stats.evicted == 1
        assert [r.span_id for r in st_.take_due(now=2.0).attributions] == [SPAN_A]
        assert repr(st_).startswith("<CorrelatorState spans=2 orphans=0 late=0 ")

    def test_orphans_beyond_bound_are_evicted_with_their_cpu(self) -> None:
        """Orphans beyond the bound are reported early as unknown, CPU intact."""
        st_ = CorrelatorState(max_entries=1)
        st_.add_samples(samples(sample(1, SPAN_A), sample(2, SPAN_B), sample(4, SPAN_C)),
                        now=0.0)
        assert st_.entries == 1
        assert st_.stats.evicted == 2
        out = st_.take_due(now=0.0)
        assert {(r.span_id, r.cpu_ns, r.span_known) for r in out.attributions} == {
            (SPAN_A, 1, False), (SPAN_B, 2, False)}

    def test_samples_after_eviction_are_late_not_orphans(self) -> None:
        """An evicted span is remembered: its later samples go out at the next take_due,
        not after orphan_timeout."""
        st_ = CorrelatorState(max_entries=1)
        st_.add_spans([span(SPAN_A), span(SPAN_B)], now=0.0)
        assert st_.stats.evicted == 1
        assert st_.take_due(now=0.0).attributions == []  # evicted without CPU: no row
        st_.add_samples(samples(sample(9, SPAN_A)), now=1.0)
        assert st_.orphans == {}
        out = st_.take_due(now=1.0)  # long before orphan_timeout (60 s)
        assert [r.cpu_ns for r in rows_of(out, SPAN_A)] == [9]
        assert st_.stats.late_reported == 1

    def test_late_row_stays_known_when_bound_drops_markers(self) -> None:
        """A late sample joined to a reported span is reported as that span (known, named),
        even when the bound has to forget reported spans."""
        st_ = CorrelatorState(max_entries=2)
        st_.add_spans([span(SPAN_A, name="A")], now=0.0)
        st_.take_due(now=10.0)  # A reported and remembered
        st_.add_samples(samples(sample(9, SPAN_A), sample(1, SPAN_B)), now=11.0)
        assert st_.late != {}  # the sample for A was taken as late, not as an orphan
        (row,) = rows_of(st_.take_due(now=11.0), SPAN_A)
        assert (row.span_known, row.name, row.cpu_ns) == (True, "A", 9)

    def test_bound_holds_with_late_samples(self) -> None:
        """Late samples count as entries too: they are bounded by max_entries as well."""
        st_ = CorrelatorState(max_entries=1)
        st_.add_spans([span(SPAN_A), span(SPAN_B)], now=0.0)
        assert st_.entries <= 1
        st_.take_due(now=0.0, force=True)  # both reported and remembered
        st_.add_samples(samples(sample(1, SPAN_A), sample(2, SPAN_B)), now=1.0)
        assert st_.entries <= st_.max_entries, repr(st_)


# ---- property: CPU is conserved ---------------------------------------------------------

KEYS = [(bytes([t]) * 16, bytes([s]) * 8) for t in (1, 2) for s in (1, 2, 3, 4)]
KEY_IDX = st.integers(0, len(KEYS) - 1)
SAMPLE = st.tuples(
    st.one_of(st.none(), KEY_IDX),  # None: unlinked
    st.sampled_from(["cpu", "cpu", "wall", "off_cpu", "other"]),
    st.integers(0, 10_000),
    st.sampled_from([1, 2, 3, 4, 999]),
)
OP = st.one_of(
    st.tuples(st.just("spans"), st.floats(0, 30), st.lists(KEY_IDX, max_size=5)),
    st.tuples(st.just("samples"), st.floats(0, 30), st.lists(SAMPLE, max_size=6)),
    st.tuples(st.just("take"), st.floats(0, 30), st.booleans()),
)


class TestConservation:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=st.lists(OP, max_size=30), max_entries=st.integers(1, 6),
           grace=st.floats(0, 20), orphan_timeout=st.floats(0, 60),
           late_window=st.floats(0, 120))
    def test_cpu_in_equals_cpu_out(self, ops: list[tuple[str, float, object]],
                                   max_entries: int, grace: float, orphan_timeout: float,
                                   late_window: float) -> None:
        """Any interleaving: per span, CPU out equals CPU in; unlinked CPU is unattributed;
        a row is known only for a span fed in, under its name."""
        state = CorrelatorState(grace=grace, orphan_timeout=orphan_timeout,
                                late_window=late_window, max_entries=max_entries)
        now = 0.0
        cpu_in: dict[tuple[bytes, bytes], int] = defaultdict(int)
        wall_in: dict[tuple[bytes, bytes], int] = defaultdict(int)
        unlinked_cpu = 0
        names: dict[tuple[bytes, bytes], str] = {}
        out: list[AttributionBatch] = []
        for kind, dt, arg in ops:
            now += dt
            if kind == "spans":
                batch = [Span(KEYS[i][0], KEYS[i][1], b"", f"op{i}", 1, "svc", 0, 10)
                         for i in arg]  # type: ignore[attr-defined]
                names.update({KEYS[i]: f"op{i}" for i in arg})  # type: ignore[attr-defined]
                state.add_spans(batch, now)
            elif kind == "samples":
                smps = []
                for idx, measure, value, stack_id in arg:  # type: ignore[attr-defined]
                    trace_id, span_id = KEYS[idx] if idx is not None else (KEYS[0][0], b"")
                    smps.append(Sample(trace_id, span_id, "svc", now_ns(now), stack_id,
                                       measure, value, 1, measure, "nanoseconds"))
                    if idx is None and measure == "cpu":
                        unlinked_cpu += value
                    elif idx is not None and measure == "cpu":
                        cpu_in[KEYS[idx]] += value
                    elif idx is not None and measure == "wall":
                        wall_in[KEYS[idx]] += value
                state.add_samples(ProfileBatch(smps, dict(STACKS)), now)
            else:
                out.append(state.take_due(now, force=bool(arg)))
        out.append(state.take_due(now, force=True))

        rows = [r for b in out for r in b.attributions]
        cpu_out: dict[tuple[bytes, bytes], int] = defaultdict(int)
        wall_out: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for r in rows:
            cpu_out[(r.trace_id, r.span_id)] += r.cpu_ns
            wall_out[(r.trace_id, r.span_id)] += r.wall_ns
            assert sum(r.self_cpu_ns.values()) == r.cpu_ns
            assert sum(r.self_wall_ns.values()) == r.wall_ns
        assert {k: v for k, v in cpu_out.items() if v} == {k: v for k, v in cpu_in.items() if v}
        assert {k: v for k, v in wall_out.items() if v} == \
            {k: v for k, v in wall_in.items() if v}
        assert sum(u.cpu_ns for b in out for u in b.unattributed) == unlinked_cpu
        for r in rows:
            if r.span_known:
                assert names.get((r.trace_id, r.span_id)) == r.name, (r, names)
            assert r.cpu_ns or r.wall_ns or r.sample_count or r.inclusive_cpu_ns, r
        assert state.entries == 0


def now_ns(now: float) -> int:
    return T0_NS + int(now * 1e9)


# ---- property: inclusive CPU whatever the order of arrival --------------------------------

# span i's parent is PARENTS[i] (an earlier span, or None); span 5 is another service's
PARENTS = [None, 0, 0, 1, 3, 1]
SERVICES = ["svc", "svc", "svc", "svc", "svc", "other"]
IDS = [bytes([40 + i]) * 8 for i in range(len(PARENTS))]


def _subtree_cpu(i: int, self_cpu: dict[int, int]) -> int:
    """Self CPU of span i and of its descendants reached through its own service."""
    kids = [k for k, p in enumerate(PARENTS) if p == i and SERVICES[k] == SERVICES[i]]
    return self_cpu.get(i, 0) + sum(_subtree_cpu(k, self_cpu) for k in kids)


class TestInclusiveInAnyOrder:
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(order=st.permutations(list(range(len(PARENTS)))),
           samples_=st.lists(st.tuples(st.integers(0, len(PARENTS) - 1),
                                       st.integers(1, 1000), st.integers(0, 6)), max_size=12),
           takes=st.lists(st.integers(0, 6), max_size=3))
    def test_every_ancestor_gets_its_descendants_cpu(
            self, order: list[int], samples_: list[tuple[int, int, int]],
            takes: list[int]) -> None:
        """Spans arrive one by one in any order, samples of any span before or after it
        (position ``at``: after that many spans), reports in between: summed over its rows,
        each span's inclusive CPU is its own plus its same-service descendants', and holds
        at least the samples labelled with it."""
        state = CorrelatorState(grace=1.0, orphan_timeout=10_000.0, late_window=10_000.0)
        now = 0.0
        self_cpu: dict[int, int] = defaultdict(int)
        rows: list[Attribution] = []
        for step in range(len(order) + 1):
            for target, value, at in samples_:
                if at == step:
                    sid = IDS[target]
                    state.add_samples(ProfileBatch([Sample(
                        TRACE, sid, SERVICES[target], now_ns(now), 1, "cpu", value, 1, "cpu",
                        "nanoseconds")], dict(STACKS)), now)
                    self_cpu[target] += value
            if step in takes:
                now += 2.0
                rows += state.take_due(now).attributions
            if step < len(order):
                i = order[step]
                parent = IDS[PARENTS[i]] if PARENTS[i] is not None else b""
                state.add_spans([Span(TRACE, IDS[i], parent, f"op{i}", 2, SERVICES[i],
                                      T0_NS, T0_NS + 10)], now)
                now += 0.1
        rows += state.take_due(now + 1.0, force=True).attributions
        incl: dict[bytes, int] = defaultdict(int)
        placed: dict[int, int] = defaultdict(int)  # self CPU where the samples went
        for r in rows:
            incl[r.span_id] += r.inclusive_cpu_ns
            placed[IDS.index(r.span_id)] += r.cpu_ns
        # untimed samples of a span with known children are shared among them (link+share):
        # the CPU moves within the labelled span's subtree, none is lost or made up
        assert sum(placed.values()) == sum(self_cpu.values())
        for i, sid in enumerate(IDS):
            assert incl.get(sid, 0) == _subtree_cpu(i, placed), (i, order, samples_)
            assert _subtree_cpu(i, placed) >= self_cpu.get(i, 0), (i, order, samples_)

"""Crash recovery's pure parts: the checkpoint's oldest held input, and delta rows."""

from __future__ import annotations

from pipeline.records import Attribution, ProfileBatch, Sample, Span, Stack
from processors.correlate.accumulators import MINUTE_NS
from processors.correlate.reconcile import APPROX_METHODS, UNATTRIBUTED, Stored, deltas, expected
from processors.correlate.state import CorrelatorState

T, S1, S2 = b"t" * 16, b"a" * 8, b"b" * 8


def _span(sid: bytes, parent: bytes = b"", start: int = 0, end: int = 100) -> Span:
    return Span(T, sid, parent, "op", 0, "svc", start, end)


def _sample(sid: bytes, value: int, t: int = 50, timed: bool = False,
            trace: bytes = T) -> Sample:
    return Sample(trace, sid, "svc", t, 1, "cpu", value, 1, "cpu", "nanoseconds",
                  timed=timed)


def _batch(*samples: Sample) -> ProfileBatch:
    return ProfileBatch(list(samples), {1: Stack(1, ["leaf", "main"], [], [])})


class TestOldestHeld:
    def test_nothing_held(self) -> None:
        """An empty state holds nothing: the checkpoint says "now"."""
        assert CorrelatorState().oldest_held() is None

    def test_span_and_timed_sample(self) -> None:
        """The oldest of a held span (its arrival) and a held timed sample (its arrival)."""
        st = CorrelatorState(grace=10)
        st.add_spans([_span(S1)], 105.0)
        st.add_samples(_batch(_sample(S1, 5, timed=True)), 103.0)
        assert st.oldest_held() == 103.0

    def test_orphan_is_dated_grace_earlier(self) -> None:
        """An orphan made when a timed sample was placed dates from the placement, up to
        grace after the sample came: grace is taken off."""
        st = CorrelatorState(grace=10, orphan_timeout=60)
        st.add_samples(_batch(_sample(S2, 5)), 200.0)
        assert st.oldest_held() == 190.0

    def test_reported_input_is_not_held(self) -> None:
        """Once everything is reported, nothing is held (the late markers carry no data)."""
        st = CorrelatorState(grace=1)
        st.add_spans([_span(S1)], 0.0)
        st.add_samples(_batch(_sample(S1, 5)), 0.0)
        st.take_due(5.0)
        assert st.oldest_held() is None


    def test_matches_a_scan_of_everything_held(self) -> None:
        """oldest_held reads the first held span and orphan and the spans whose samples
        came first (a heap), not every entry: on random arrivals, with spans adopting older
        orphans, flushes and evictions, it equals the minimum over everything held."""
        import random

        def scanned(st: CorrelatorState) -> float | None:
            times = [p.acc.since for p in st.spans.values()]
            times += [o.acc.since - st.grace for o in st.orphans.values()]
            times += [p.acc.since - st.grace for p in st.late.values()]
            times += [a.since - st.grace for a in st.unattributed.values()]
            times += [a.since - st.grace for _, _, a in st._evicted]
            times += [st.held[0][0]] if st.held else []
            return min(times) if times else None

        rng = random.Random(7)
        st = CorrelatorState(grace=5, orphan_timeout=20, late_window=30, max_entries=60)
        now = 0.0
        for _ in range(400):
            now += rng.random()
            sids = [bytes([rng.randrange(80)]) * 8 for _ in range(rng.randrange(1, 5))]
            if rng.random() < 0.5:
                st.add_samples(_batch(*(_sample(s, 5) for s in sids)), now)
            else:
                st.add_spans([_span(s) for s in sids], now)
            if rng.random() < 0.2:
                st.take_due(now)
            assert st.oldest_held() == scanned(st)
        assert len(st._early) <= len(st.spans) + 60  # pruned as spans are reported


def _row(sid: bytes, method: str, cpu: int, known: bool = True) -> Attribution:
    return Attribution(T, sid, method, "svc", "op", b"", 0, 100, known, cpu, 0, 1,
                       {"leaf": cpu}, {}, 1, cpu, {1: cpu}, {})


class TestDeltas:
    def test_nothing_stored_gives_the_expected_rows(self) -> None:
        """A span the crash lost entirely gets all its CPU, functions and stacks."""
        out = deltas([_row(S1, "link", 30)], Stored())
        assert [(r.span_id, r.cpu_ns, r.self_cpu_ns, r.stack_cpu_ns) for r in out] == \
            [(S1, 30, {"leaf": 30}, {1: 30})]

    def test_stored_part_is_not_written_again(self) -> None:
        """expected - stored, per field, and nothing when they are equal (idempotent)."""
        stored = Stored(rows={(T, S1, "link"): [10, 0, 1, 10, 0, 0, 1]},
                        functions={((T, S1, "link"), "leaf"): (10, 0)},
                        stacks={((T, S1, "link"), 1): (10, 0)})
        out = deltas([_row(S1, "link", 30)], stored)
        assert [(r.cpu_ns, r.self_cpu_ns, r.stack_cpu_ns, r.sample_count) for r in out] == \
            [(20, {"leaf": 20}, {1: 20}, 0)]
        full = Stored(rows={(T, S1, "link"): [30, 0, 1, 30, 0, 0, 1]},
                      functions={((T, S1, "link"), "leaf"): (30, 0)},
                      stacks={((T, S1, "link"), 1): (30, 0)})
        assert deltas([_row(S1, "link", 30)], full) == []

    def test_placed_elsewhere_is_capped_by_the_trace(self) -> None:
        """The live correlator put 30 on the parent (its child came after grace); recovery
        would put it on the child: the trace already has its 30, so nothing is added."""
        stored = Stored(rows={(T, S1, "link"): [30, 0, 1, 30, 0, 0, 1],
                              (T, S2, "link"): [0, 0, 0, 0, 0, 0, 1]})
        out = deltas([_row(S1, "link", 0), _row(S2, "link+time", 30)], stored)
        assert sum(r.cpu_ns for r in out) == 0
        assert all(not r.self_cpu_ns and not r.stack_cpu_ns for r in out)

    def test_missing_span_row_is_written_without_cpu(self) -> None:
        """A known span with no stored row gets one (its name and duration), even at 0."""
        out = deltas([_row(S1, "link", 0)], Stored())
        assert [(r.span_id, r.cpu_ns, r.span_known) for r in out] == [(S1, 0, True)]

    def test_expected_places_timed_samples_in_children(self) -> None:
        """The replay is the correlator's own placement: a timed sample labelled with the
        root goes to the child open at its instant."""
        rows = expected([_span(S1), _span(S2, parent=S1, start=40, end=60)],
                        [_sample(S1, 7, t=50, timed=True), _sample(S1, 3, t=10, timed=True)],
                        {1: Stack(1, ["leaf"], [], [])})
        got = {(r.span_id, r.method): r.cpu_ns for r in rows if r.cpu_ns}
        assert got == {(S2, "link+time"): 7, (S1, "link"): 3}


class TestUnlabelled:
    """Unlabelled samples are reconciled per service: the cap is the service's, and a
    minute's unattributed CPU is a key like a span's."""

    def test_expected_gives_thread_rows_and_unattributed_minutes(self) -> None:
        spans = [Span(T, S1, b"", "op", 0, "svc", 0, 100, attributes={"thread.id": "7"}),
                 Span(T, S2, b"", "op", 0, "svc", 0, 100, attributes={"thread.id": "8"})]
        on7 = Sample(b"", b"", "svc", 50, 1, "cpu", 5, 1, "cpu", "ns", thread_id=7,
                     timed=True)
        idle = Sample(b"", b"", "svc", MINUTE_NS + 5, 1, "cpu", 9, 1, "cpu", "ns")
        rows = expected(spans, [on7, idle], {1: Stack(1, ["leaf"], [], [])})
        got = {(r.span_id, r.method): r.cpu_ns for r in rows if r.method in APPROX_METHODS}
        assert got == {(S1, "thread"): 5, (MINUTE_NS.to_bytes(8, "big"), UNATTRIBUTED): 9}

    def test_placed_in_another_trace_is_capped_by_the_service(self) -> None:
        """The live correlator put 30 on a span of another trace (or in the unattributed
        minute); the replay puts it on S1: per service, nothing is added."""
        other = b"o" * 16
        minute = (b"", (0).to_bytes(8, "big"), UNATTRIBUTED)
        for stored in (Stored(rows={(other, S2, "thread"): [30, 0, 1, 30, 0, 0, 1]}),
                       Stored(rows={minute: [30, 0, 1, 0, 0, 0, 0]})):
            out = deltas([_row(S1, "thread", 30)], stored, APPROX_METHODS, per_trace=False)
            assert sum(r.cpu_ns for r in out) == 0
            # per trace, as for exact methods, it would have been counted twice
            assert sum(r.cpu_ns for r in deltas([_row(S1, "thread", 30)], stored,
                                                APPROX_METHODS)) == 30

    def test_a_lost_minute_is_written_once(self) -> None:
        minute = Attribution(b"", (0).to_bytes(8, "big"), UNATTRIBUTED, "svc", "", b"", 0, 0,
                             False, 40, 0, 2, {}, {})
        stored = Stored(rows={(b"", (0).to_bytes(8, "big"), UNATTRIBUTED): [15, 0, 1, 0, 0, 0, 0]})
        out = deltas([minute], stored, APPROX_METHODS, per_trace=False)
        assert [(r.cpu_ns, r.sample_count) for r in out] == [(25, 1)]

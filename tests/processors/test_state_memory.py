"""The correlator's memory bound (``max_bytes``): the estimate it keeps, and the bound.

``CorrelatorState.bytes`` is an estimate kept as entries come and go; these tests hold it
to what tracemalloc measures for the shapes of state that matter (many short spans, long
spans, spans with many stacks, orphans, held timed samples), check the running counters
against a recount, and check that the bound holds without losing CPU.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.records import ProfileBatch, Sample, Span, Stack
from processors.correlate.state import CorrelatorState

T0 = 1_700_000_000 * 10**9
Input = list[tuple[str, object]]


def _tid(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _sid(i: int) -> bytes:
    return (i + 1).to_bytes(8, "big")


def _stacks(n: int) -> dict[int, Stack]:
    return {j: Stack(j, [f"function_{j}", "main"], ["a.py", "b.py"], [1, 2])
            for j in range(1, n + 1)}


def _spans(n: int, duration_ns: int = 50_000_000, gap_ns: int = 1_000) -> list[Span]:
    return [Span(_tid(i // 5), _sid(i), _sid(i - 1) if i % 5 else b"", f"GET /api/item/{i}",
                 2, "checkout", T0 + i * gap_ns, T0 + i * gap_ns + duration_ns)
            for i in range(n)]


def _samples(n_spans: int, per_span: int, n_stacks: int, timed: bool = False) -> list[Sample]:
    return [Sample(_tid(i // 5), _sid(i), "checkout", T0 + i * 1_000, 1 + (i * 7 + j) % n_stacks,
                   "cpu", 10_000_000, 1, "cpu", "nanoseconds", timed=timed)
            for i in range(n_spans) for j in range(per_span)]


def _short_spans() -> Input:
    return [("spans", _spans(5_000))]


def _long_spans() -> Input:  # ten minutes each: 600 seconds in the time index
    return [("spans", _spans(1_000, duration_ns=600 * 10**9))]


def _sparse_spans() -> Input:  # one span a second, 30 s long: few spans share a second
    return [("spans", _spans(2_000, duration_ns=30 * 10**9, gap_ns=10**9))]


def _spans_with_stacks() -> Input:
    return [("spans", _spans(1_000)),
            ("samples", ProfileBatch(_samples(1_000, 50, 500), _stacks(500)))]


def _orphans() -> Input:
    return [("samples", ProfileBatch(_samples(5_000, 1, 100), _stacks(100)))]


def _held() -> Input:
    return [("samples", ProfileBatch(_samples(5_000, 1, 100, timed=True), _stacks(100)))]


def _feed(state: CorrelatorState, items: Input, now: float = 1.0) -> None:
    for kind, x in items:
        if kind == "spans":
            state.add_spans(x, now)  # type: ignore[arg-type]
        else:
            state.add_samples(x, now)  # type: ignore[arg-type]


@pytest.mark.parametrize("build", [_short_spans, _long_spans, _sparse_spans,
                                   _spans_with_stacks, _orphans, _held],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_estimate_is_within_half_of_what_tracemalloc_measures(
        build: Callable[[], Input]) -> None:
    gc.collect()
    state = CorrelatorState(max_entries=1 << 62, max_bytes=1 << 62)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        items = build()  # decoded inside the measurement: the state keeps parts of it
        _feed(state, items)
        del items
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert state.entries > 0
    assert measured / 1.5 <= state.bytes <= measured * 1.5, (state.bytes, measured)


def _recount(state: CorrelatorState) -> int:
    accs = [p.acc for p in state.spans.values()] + [o.acc for o in state.orphans.values()]
    accs += [p.acc for p in state.late.values()]
    waiting = sum(len(w) for t in state.trees.values() for w in (t.waiting or {}).values())
    return sum(a.items() for a in accs) + waiting


ops = st.lists(st.tuples(st.sampled_from(["spans", "samples", "timed", "flush"]),
                         st.integers(0, 30), st.integers(1, 8)), max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, max_bytes=st.sampled_from([1 << 62, 20_000, 3_000]),
       limit=st.sampled_from([None, 1, 3]))
def test_the_running_counts_match_a_recount_and_nothing_is_lost(
        ops: list[tuple[str, int, int]], max_bytes: int, limit: int | None) -> None:
    """Whatever the order of spans, samples (labelled or timed) and flushes, and however
    small the bound, and whether reports are taken whole or a few entries at a time
    (``limit``, as the connector does): the counters match a recount, every sample's CPU
    is reported exactly once, and a forced flush leaves nothing counted."""
    state = CorrelatorState(max_bytes=max_bytes)
    stacks = _stacks(8)
    cpu_in = cpu_out = 0
    now = 0.0
    for op, first, n in ops:
        now += 3.0
        ids = range(first, first + n)
        if op == "spans":
            state.add_spans([s for s in _spans(40) if int.from_bytes(s.span_id, "big") - 1
                             in ids], now)
        elif op in ("samples", "timed"):
            smp = [Sample(_tid(i // 5), _sid(i), "checkout", T0 + i * 1_000 + 1, 1 + i % 8,
                          "cpu", 1_000 + i, 1, "cpu", "nanoseconds", timed=op == "timed")
                   for i in ids]
            cpu_in += sum(s.value for s in smp)
            state.add_samples(ProfileBatch(smp, stacks), now)
        else:
            cpu_out += sum(a.cpu_ns for a in state.take_due(now, limit=limit).attributions)
        assert state._items == _recount(state)
        assert state.bytes >= 0
    end = now + 1e6
    while True:
        evicted = len(state._evicted)  # reported early already: not counted in ``limit``
        rows = state.take_due(end, force=True, limit=limit).attributions
        cpu_out += sum(a.cpu_ns for a in rows)
        assert limit is None or len({(a.trace_id, a.span_id) for a in rows}) <= limit + evicted
        if not state.has_due(end, force=True):
            break
    assert state.entries == 0
    assert cpu_out == cpu_in
    assert state._items == 0 and state.bytes == 0


def test_the_bound_holds_and_evicted_cpu_is_reported_not_dropped() -> None:
    bound = 2 << 20
    state = CorrelatorState(max_bytes=bound)
    stacks = _stacks(300)
    cpu_in = cpu_out = 0
    for round_ in range(20):  # each round its own traces: 500 spans, 20 samples each
        def ours(tid: bytes, r: int = round_) -> bytes:
            return bytes([r]) + tid[1:]
        spans = [msgspec.structs.replace(s, trace_id=ours(s.trace_id)) for s in _spans(500)]
        smp = [msgspec.structs.replace(x, trace_id=ours(x.trace_id))
               for x in _samples(500, 20, 300)]
        cpu_in += sum(s.value for s in smp)
        state.add_spans(spans, float(round_))
        state.add_samples(ProfileBatch(smp, stacks), float(round_))
        assert state.bytes <= bound
        cpu_out += sum(a.cpu_ns for a in state.take_due(float(round_)).attributions)
    assert state.stats.evicted > 0
    cpu_out += sum(a.cpu_ns for a in state.take_due(1e9, force=True).attributions)
    assert cpu_out == cpu_in


def test_the_shared_names_stay_small_whatever_the_spans_are_called() -> None:
    """Operation names are shared through a table of the state's own: long ones (SQL text,
    URLs with ids) are not put in it, and it holds a bounded number, so what it keeps
    after the spans are gone is a few MiB at most."""
    from processors.correlate.state import MAX_NAME_CHARS, MAX_NAMES

    st = CorrelatorState(grace=0.0, late_window=0.0)
    spans = [Span(_tid(i), _sid(i), b"", f"SELECT {i} " + "x" * 10_000, 0, "svc", 1, 2)
             for i in range(1, 501)]
    st.add_spans(spans, now=0.0)
    st.take_due(now=1.0, force=True)
    assert st.bytes == 0 and not st.spans and not st.emitted
    assert not st._names  # long names are each span's own, gone with it
    st.add_spans([Span(_tid(i), _sid(i), b"", f"GET /items/{i}", 0, "svc", 1, 2)
                  for i in range(1_000, 1_000 + MAX_NAMES + 10)], now=2.0)
    assert len(st._names) <= MAX_NAMES
    assert all(len(n) <= MAX_NAME_CHARS for n in st._names)
    st.add_spans([Span(_tid(i), _sid(i), b"", "".join(["GET ", "/health"]), 0, "svc", 1, 2)
                  for i in (90_001, 90_002)], now=3.0)
    a, b = (st.spans[(_tid(i), _sid(i))].info.name for i in (90_001, 90_002))
    assert a == b == "GET /health" and a is b  # two strings decoded, one held

"""Placement by stack (processors/correlate/frames.py): samples whose instant leaves several
spans open (async children on one thread, unlabelled samples without threads) placed in the
span whose operation's learnt frames their stack matches; the exact methods untouched."""

from __future__ import annotations

from collections import defaultdict

from pipeline.records import AttributionBatch, ProfileBatch, Sample, Span, Stack
from processors.correlate.frames import MAX_STACKS, TOP_FRAMES, Frames
from processors.correlate.state import CorrelatorState

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
LOOP = ["asyncio.tasks.Task.__step", "asyncio.events.Handle._run", "main"]
# leaf first: a task's stack shows its own frames under the event loop's
STACKS = {1: Stack(1, ["psycopg.execute", "orders.find", *LOOP], ["a.py"] * 5, [1] * 5),
          2: Stack(2, ["redis.read", "cache.get_many", *LOOP], ["a.py"] * 5, [1] * 5),
          3: Stack(3, ["json.dumps", "cart.view", *LOOP], ["a.py"] * 5, [1] * 5),
          4: Stack(4, ["selectors.select", *LOOP], ["a.py"] * 4, [1] * 4)}
STACKS_W: dict[int, Stack] = {}  # one per sample, its frames its operation's
ROOT, DB, CACHE = b"\x01" * 8, b"\x02" * 8, b"\x03" * 8


def trace(i: int) -> bytes:
    return i.to_bytes(16, "big")


def request(i: int, overlap: bool) -> list[Span]:
    """GET /cart 0-100 ms with a db and a cache child: one after the other (20-40, 50-70)
    or at once, tasks taking turns on one thread (20-70 both)."""
    base = i * 200
    db, cache = (20, 70), (20, 70) if overlap else (50, 70)
    db = (20, 70) if overlap else (20, 40)
    return [Span(trace(i), sid, parent, name, 1, "svc", T0 + (base + a) * MS,
                 T0 + (base + b) * MS, attributes={"thread.id": "1"})
            for sid, parent, name, (a, b) in ((ROOT, b"", "GET /cart", (0, 100)),
                                              (DB, ROOT, "SELECT", db),
                                              (CACHE, ROOT, "cache.get", cache))]


def sample(i: int, at_ms: int, stack: int, label: bool = True, measure: str = "cpu"
           ) -> Sample:
    return Sample(trace(i) if label else b"", ROOT if label else b"", "svc",
                  T0 + (i * 200 + at_ms) * MS, stack, measure, 10 * MS, 1, measure,  # type: ignore[arg-type]
                  "nanoseconds", 1 if label else 0, "", "", 0, "", True)


def sync_requests(n: int) -> tuple[list[Span], list[Sample]]:
    """Requests whose children run one after the other: their samples are placed exactly,
    and teach what each operation runs."""
    spans, samples = [], []
    for i in range(n):
        spans += request(i, overlap=False)
        samples += [sample(i, 5, 3), sample(i, 25, 1), sample(i, 35, 1), sample(i, 55, 2),
                    sample(i, 65, 2), sample(i, 85, 3)]
    return spans, samples


def run(spans: list[Span], samples: list[Sample]) -> AttributionBatch:
    st = CorrelatorState(grace=1.0)
    st.add_spans(spans, 0.0)
    st.add_samples(ProfileBatch(samples, STACKS), 0.5)
    return st.take_due(1000.0, force=True)


def totals(out: AttributionBatch, field: str = "cpu_ns", traces: set[bytes] | None = None
           ) -> dict[tuple[bytes, str], int]:
    got: dict[tuple[bytes, str], int] = defaultdict(int)
    for r in out.attributions:
        if getattr(r, field) and (traces is None or r.trace_id in traces):
            got[(r.span_id, r.method)] += getattr(r, field)
    return dict(got)


class TestAsyncChildren:
    def test_overlapping_children_told_apart_by_their_frames(self) -> None:
        """Two children open at once on one thread: each sample goes to the child whose
        operation's frames (learnt from requests where they ran one after the other) its
        stack shows, as link+share; the root keeps its inclusive CPU under link."""
        spans, samples = sync_requests(20)
        spans += request(99, overlap=True)
        samples += [sample(99, 25, 1), sample(99, 30, 2), sample(99, 45, 1)]
        out = run(spans, samples)
        assert totals(out, traces={trace(99)}) == {(DB, "link+share"): 20 * MS,
                                                   (CACHE, "link+share"): 10 * MS}
        incl = totals(out, "inclusive_cpu_ns", {trace(99)})
        assert incl[(ROOT, "link")] == 30 * MS

    def test_a_stack_that_does_not_tell_stays_on_the_parent(self) -> None:
        """Runtime frames only (the event loop's own): no operation is likelier, so the
        sample stays on the deepest unambiguous span, under link, as without stacks."""
        spans, samples = sync_requests(20)
        spans += request(99, overlap=True)
        out = run(spans, samples + [sample(99, 25, 4)])
        assert totals(out, traces={trace(99)}) == {(ROOT, "link"): 10 * MS}

    def test_exact_placements_unchanged_by_ambiguous_samples(self) -> None:
        """What link and link+time place is the same with or without ambiguous samples to
        place by stack (learning only reads the exact ones)."""
        spans, samples = sync_requests(20)
        spans += request(99, overlap=True)
        base = totals(run(spans, samples))
        both = totals(run(spans, samples + [sample(99, t, 1 + t % 2) for t in range(21, 70, 3)]))
        assert {k: v for k, v in both.items() if k[1] in ("link", "link+time")} == base

    def test_cpu_conserved_and_lock_alloc_placed_alike(self) -> None:
        """Every sample's CPU reported once; lock and alloc samples go where CPU would,
        never into CPU."""
        spans, samples = sync_requests(20)
        spans += request(99, overlap=True)
        extra = [sample(99, 25, 1), sample(99, 30, 2, measure="lock"),
                 sample(99, 35, 1, measure="alloc"), sample(99, 40, 4)]
        out = run(spans, samples + extra)
        assert sum(r.cpu_ns for r in out.attributions) == 10 * MS * (len(samples) + 2)
        got = {(r.span_id, r.method): (r.lock_ns, r.alloc_bytes) for r in out.attributions
               if r.trace_id == trace(99) and (r.lock_ns or r.alloc_bytes)}
        assert got == {(CACHE, "link+share"): (10 * MS, 0), (DB, "link+share"): (0, 10 * MS)}


class TestWindow:
    def test_unlabelled_samples_learn_without_labels(self) -> None:
        """No labels, no threads, two requests at once, of varying endpoints: an
        endpoint's frames are on the stacks whenever one of its spans is open, other
        frames only by chance, so the window learns them from its own samples and gives
        each sample to the span it ran in, not half to each. (Two operations always open
        together could not be told apart so.)"""
        ops = {"GET /cart": 3, "GET /orders": 1, "GET /user": 2}
        pairs = [("GET /cart", "GET /orders"), ("GET /cart", "GET /user"),
                 ("GET /orders", "GET /user")]
        spans, samples, truth = [], [], {}
        for i in range(60):
            start = T0 + i * 100 * MS
            for j, name in enumerate(pairs[i % 3]):
                tid = trace(2 * i + j)
                spans.append(Span(tid, ROOT, b"", name, 1, "svc", start, start + 50 * MS))
                for t in (5 + j, 25 + j):
                    stack = len(truth) + 10
                    truth[stack] = tid
                    STACKS_W[stack] = Stack(stack, STACKS[ops[name]].functions, [], [])
                    samples.append(Sample(b"", b"", "svc", start + t * MS, stack, "cpu",
                                          10 * MS, 1, "cpu", "nanoseconds", timed=True))
        st = CorrelatorState(grace=1.0)
        st.add_spans(spans, 0.0)
        st.add_samples(ProfileBatch(samples, STACKS_W), 0.5)
        out = st.take_due(1000.0, force=True)
        right = sum(v for r in out.attributions for sid, v in r.stack_cpu_ns.items()
                    if truth[sid] == r.trace_id)
        assert right >= 0.9 * sum(s.value for s in samples)
        assert {r.method for r in out.attributions} == {"window"}


class TestBounds:
    def test_stacks_operations_and_frames_are_bounded(self) -> None:
        """Stacks kept by id up to MAX_STACKS (the oldest dropped), each operation's frames
        pruned to the most frequent; the estimate follows and clear() empties it."""
        f = Frames()
        for i in range(MAX_STACKS + 10):
            f.keep(i, [f"leaf{i}", "main"])
        assert len(f.stacks) == MAX_STACKS and 0 not in f.stacks
        f.ambiguous("svc")
        for i in range(MAX_STACKS - 500, MAX_STACKS + 10):
            f.learn("svc", {"op": 1.0}, i)
        assert max(len(q.f) for q in f.ops.values()) <= 2 * TOP_FRAMES
        assert f.ops[("svc", "op")].f["main"] > 0  # the frame on every stack stays
        assert f.bytes > 0
        f.clear()
        assert f.bytes == 0 and not f.stacks and not f.ops

    def test_memory_pressure_drops_what_was_learnt_first(self) -> None:
        """Over max_bytes, the learnt frames go before any entry is reported early."""
        spans, samples = sync_requests(20)
        st = CorrelatorState(grace=1.0)
        st.add_spans(spans, 0.0)
        st.add_samples(ProfileBatch(samples, STACKS), 0.5)
        assert st.frames.stacks
        st.shrink_to(10**9, st.bytes - 1, 0.6)
        assert not st.frames.stacks and st.stats.evicted == 0

"""The Kafka tier's per-message attribution: a pure function of the message."""

from __future__ import annotations

import os

from pipeline.records import ProfileBatch, Sample, Span, SpanBatch, Stack
from processors.correlate.messages import attribute_message, random_source, source_id

T, S1, S2 = b"\x01" * 16, b"\x02" * 8, b"\x03" * 8


def _samples() -> ProfileBatch:
    mk = lambda tid, sid, v, st=1, m="cpu": Sample(tid, sid, "svc", 120_000_000_000, st, m,  # noqa: E731
                                                   v, 1, "cpu", "nanoseconds")
    return ProfileBatch(
        [mk(T, S1, 5), mk(T, S1, 7, 2), mk(b"", S2, 11), mk(b"", b"", 13),
         mk(T, S1, 100, m="wall"), mk(T, S1, 999, m="other")],
        {1: Stack(1, ["leaf", "root"], ["f", "f"], [1, 2]), 2: Stack(2, ["other"], ["f"], [1])})


class TestAttributeMessage:
    def test_same_message_same_rows(self) -> None:
        """Redelivering a message yields identical rows (the basis of deduplication)."""
        src = source_id("otlp_profiles/3/42")
        assert attribute_message(_samples(), src) == attribute_message(_samples(), src)
        assert source_id("otlp_profiles/3/42") != source_id("otlp_profiles/3/43")

    def test_sums_per_span_leaf_and_unlinked(self) -> None:
        """CPU per span and per leaf function; span-only samples keep trace b""; unlinked CPU
        goes to unattributed; wall is separate; other measures are not attributed."""
        out = attribute_message(_samples(), 9)
        rows = {(a.trace_id, a.span_id): a for a in out.attributions}
        assert rows[(T, S1)].cpu_ns == 12 and rows[(T, S1)].wall_ns == 100
        assert rows[(T, S1)].self_cpu_ns == {"leaf": 5, "other": 7}
        assert rows[(b"", S2)].cpu_ns == 11 and not rows[(b"", S2)].span_known
        assert [(u.cpu_ns, u.source) for u in out.unattributed] == [(13, 9)]
        assert all(a.source == 9 for a in out.attributions)

    def test_span_messages_yield_no_rows(self) -> None:
        """A span without CPU has no attribution row: its name and duration are read from
        otel_traces."""
        span = Span(T, S1, b"", "GET /", 2, "svc", 10, 60)
        assert attribute_message(SpanBatch([span]), 5).attributions == []

    def test_rows_of_samples_name_spans_the_worker_has_seen(self) -> None:
        """With the spans of earlier messages remembered, sample rows carry their span's
        operation and time (not span-only ones: their key must not depend on the worker),
        so their CPU reaches the per-operation aggregates; unknown spans stay unknown; the
        memory is bounded."""
        from processors.correlate.messages import SpanLookup, span_lookup_add

        seen: SpanLookup = {}
        span_lookup_add(seen, SpanBatch([Span(T, S1, b"", "GET /", 2, "svc", 10, 60),
                                         Span(T, S2, S1, "db", 3, "svc", 20, 30)]), bound=10)
        rows = {a.span_id: a for a in attribute_message(_samples(), 9, seen).attributions}
        assert (rows[S1].name, rows[S1].start_ns, rows[S1].span_known, rows[S1].cpu_ns) == \
            ("GET /", 10, True, 12)
        # a span-only row keeps its key, whatever the worker knows (same rows on any worker)
        assert (rows[S2].trace_id, rows[S2].name, rows[S2].span_known) == (b"", "", False)
        assert attribute_message(_samples(), 9, {}).attributions[0].span_known is False
        span_lookup_add(seen, SpanBatch([Span(T, bytes([i]) * 8, b"", "x", 1, "svc", 0, 1)
                                         for i in range(20, 40)]), bound=10)
        assert len(seen) == 10 and S1 not in seen


def test_a_forked_child_draws_other_row_ids() -> None:
    """Row ids of in-memory state must never repeat: a child process must not replay its
    parent's sequence (the same id twice would let ReplacingMergeTree collapse two rows)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, b" ".join(str(random_source()).encode() for _ in range(4)))
        os._exit(0)
    os.waitpid(pid, 0)
    child = {int(x) for x in os.read(r, 1000).split()}
    os.close(r)
    os.close(w)
    assert len(child) == 4 and child.isdisjoint(random_source() for _ in range(4))

"""Crash recovery's reconciliation: the delta rows, as a pure function of what is read.

``expected`` replays a trace's spans and samples (or a service's, for unlabelled samples)
through a fresh ``CorrelatorState``; ``deltas`` keeps only the difference to what is
stored, the rows recovery writes:

    delta = expected - stored   (per span, method and field; never negative)

so running it twice adds nothing the second time. The live correlator may have placed a
sample differently (a child span that came after grace, another clock skew estimate); then
one span is short where another is over, and adding the shortfall would count the sample
twice. Hence a cap per trace: the CPU (wall, samples, lock, bytes) added to a trace never
exceeds its expected total less its stored total. Unlabelled samples are capped per service in the
same way (``per_trace=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.records import Attribution, ProfileBatch, Sample, Span, Stack
from processors.correlate.accumulators import EXACT_METHODS, THREAD, WINDOW
from processors.correlate.messages import random_source
from processors.correlate.state import CorrelatorState

UNATTRIBUTED = "unattributed"  # a service's minute, as a key of ``deltas``: (b"", minute)
APPROX_METHODS = (THREAD, WINDOW, UNATTRIBUTED)

Key3 = tuple[bytes, bytes, str]  # trace, span, method
FIELDS = ("cpu_ns", "wall_ns", "sample_count", "inclusive_cpu_ns", "lock_ns", "alloc_bytes")
KNOWN = len(FIELDS)  # the index of span_known in a Stored row


@dataclass
class Stored:
    """What ``span_attribution`` (exact methods), ``span_functions`` and ``span_stacks``
    hold for some traces: totals per key; span-only rows under their span's trace."""

    rows: dict[Key3, list[int]] = field(default_factory=dict)  # FIELDS..., span_known
    # self CPU, wall, lock and allocated bytes
    functions: dict[tuple[Key3, str], tuple[int, int, int, int]] = field(default_factory=dict)
    stacks: dict[tuple[Key3, int], tuple[int, int]] = field(default_factory=dict)


def expected(spans: list[Span], samples: list[Sample], stacks: dict[int, Stack]
             ) -> list[Attribution]:
    """The rows a correlator that had held all of this input would have reported;
    unattributed CPU as rows of method ``UNATTRIBUTED`` keyed (b"", minute)."""
    state = CorrelatorState(grace=0.0, orphan_timeout=0.0, late_window=0.0,
                            max_entries=1 << 62, max_bytes=1 << 62)
    state.add_spans(spans, 0.0)
    state.add_samples(ProfileBatch(samples, stacks), 0.0)
    due = state.take_due(0.0, force=True)
    return due.attributions + [
        Attribution(b"", u.minute_ns.to_bytes(8, "big"), UNATTRIBUTED, u.service, "", b"", 0,
                    0, False, u.cpu_ns, u.wall_ns, u.sample_count, {}, {})
        for u in due.unattributed]


def _grant(wanted: dict[Any, int], cap: int) -> dict[Any, int]:
    """Positive wants, granted in key order while ``cap`` lasts."""
    out = {}
    for k in sorted(wanted):
        v = min(wanted[k], cap)
        if v > 0:
            out[k] = v
            cap -= v
    return out


def _merge(mine: dict[Any, int], theirs: dict[Any, int]) -> None:
    for k, v in theirs.items():
        mine[k] = mine.get(k, 0) + v


def deltas(rows: list[Attribution], stored: Stored,
           methods: tuple[str, ...] = EXACT_METHODS, per_trace: bool = True
           ) -> list[Attribution]:
    """Rows of ``methods`` that bring the stored totals up to ``rows`` (see the module
    docstring: never negative, and per trace, or in all when not ``per_trace``, at most the
    expected less the stored total)."""
    exp: dict[Key3, Attribution] = {}
    for a in rows:
        if a.method not in methods:
            continue
        k = (a.trace_id, a.span_id, a.method)
        e = exp.get(k)
        if e is None:
            exp[k] = Attribution(a.trace_id, a.span_id, a.method, a.service, a.name,
                                 a.parent_span_id, a.start_ns, a.duration_ns, a.span_known,
                                 a.cpu_ns, a.wall_ns, a.sample_count, dict(a.self_cpu_ns),
                                 dict(a.self_wall_ns), 0, a.inclusive_cpu_ns,
                                 dict(a.stack_cpu_ns), dict(a.stack_wall_ns),
                                 lock_ns=a.lock_ns, alloc_bytes=a.alloc_bytes,
                                 self_lock_ns=dict(a.self_lock_ns),
                                 self_alloc_bytes=dict(a.self_alloc_bytes))
            continue
        for f in FIELDS:
            setattr(e, f, getattr(e, f) + getattr(a, f))
        e.span_known = e.span_known or a.span_known
        _merge(e.self_cpu_ns, a.self_cpu_ns)
        _merge(e.self_wall_ns, a.self_wall_ns)
        _merge(e.stack_cpu_ns, a.stack_cpu_ns)
        _merge(e.stack_wall_ns, a.stack_wall_ns)
        _merge(e.self_lock_ns, a.self_lock_ns)
        _merge(e.self_alloc_bytes, a.self_alloc_bytes)
    by_trace: dict[bytes, list[Key3]] = {}
    for k in exp:
        by_trace.setdefault(k[0] if per_trace else b"", []).append(k)
    have_of: dict[bytes, list[int]] = {}
    for k, v in stored.rows.items():
        tot = have_of.setdefault(k[0] if per_trace else b"", [0] * KNOWN)
        for i in range(KNOWN):
            tot[i] += v[i]
    zero = [0] * (KNOWN + 1)
    nofn = (0, 0, 0, 0)
    out: list[Attribution] = []
    for tid in sorted(by_trace):
        keys = sorted(by_trace[tid])
        stored_total = have_of.get(tid, [0] * KNOWN)
        room = [max(0, sum(getattr(exp[k], f) for k in keys) - stored_total[i])
                for i, f in enumerate(FIELDS)]
        for k in keys:
            e, s = exp[k], stored.rows.get(k, zero)
            got = []
            for i, f in enumerate(FIELDS):
                d = min(max(0, getattr(e, f) - s[i]), room[i])
                room[i] -= d
                got.append(d)
            fn_cpu = _grant({n: v - stored.functions.get((k, n), nofn)[0]
                             for n, v in e.self_cpu_ns.items()}, got[0])
            fn_wall = _grant({n: v - stored.functions.get((k, n), nofn)[1]
                              for n, v in e.self_wall_ns.items()}, got[1])
            fn_lock = _grant({n: v - stored.functions.get((k, n), nofn)[2]
                              for n, v in e.self_lock_ns.items()}, got[4])
            fn_alloc = _grant({n: v - stored.functions.get((k, n), nofn)[3]
                               for n, v in e.self_alloc_bytes.items()}, got[5])
            st_cpu = _grant({n: v - stored.stacks.get((k, n), (0, 0))[0]
                             for n, v in e.stack_cpu_ns.items()}, got[0])
            st_wall = _grant({n: v - stored.stacks.get((k, n), (0, 0))[1]
                              for n, v in e.stack_wall_ns.items()}, got[1])
            # a span always has a row saying it is known (name, duration), even without CPU
            needs_known = e.span_known and not s[KNOWN]
            if not (any(got) or fn_cpu or fn_wall or fn_lock or fn_alloc or st_cpu or st_wall
                    or needs_known):
                continue
            out.append(Attribution(e.trace_id, e.span_id, e.method, e.service, e.name,
                                   e.parent_span_id, e.start_ns, e.duration_ns, e.span_known,
                                   got[0], got[1], got[2], fn_cpu, fn_wall, random_source(),
                                   got[3], st_cpu, st_wall, lock_ns=got[4],
                                   alloc_bytes=got[5], self_lock_ns=fn_lock,
                                   self_alloc_bytes=fn_alloc))
    return out

"""Crash recovery of the correlator: reconcile what it held in memory with the stored rows.

The exporters store a batch before the correlator sees it (``pipeline.component.Fanout``),
so an acknowledged batch is always in ``otel_traces`` / ``profile_samples``; what a SIGKILL
loses is only the correlator's progress: spans and samples held for their windows, and
reports not yet sent. The connector keeps a checkpoint (``correlator_checkpoint``): the
arrival of the oldest input it still held unreported (``held_since``). On start, every
trace with a raw row stored since then (less ``margin``) may have lost attribution; for
each, its spans and samples are read back (all of them, whatever their ingest time), run
through a fresh ``CorrelatorState`` to get the rows the correlator would have written, and
only the difference to what ``span_attribution`` already holds is written:

    delta = expected - stored   (per span, method and field; never negative)

so running it twice adds nothing the second time. The live correlator may have placed a
sample differently (a child span that came after grace, another clock skew estimate); then
one span is short where another is over, and adding the shortfall would count the sample
twice. Hence a cap per trace: the CPU (wall, samples) added to a trace never exceeds its
expected total less its stored total.

Unlabelled samples (no span id) are placed by process, thread and time among every span
of their service (``thread`` / ``window``) or counted in ``unattributed_cpu``; they are
reconciled per service (``recover_unlabelled``): the whole minutes around the unlabelled
samples stored since the checkpoint, every span of the service open in them and every
unlabelled sample in them are replayed, and the difference is written for those spans'
approximate rows and the service's minutes, capped per service as above (expected total
less stored total). A span that reaches beyond those minutes has stored CPU from samples
outside them, which only lowers that cap: such an edge may stay short, never counted
twice. A service with more than ``MAX_SERVICE_SPANS`` spans or ``MAX_SERVICE_SAMPLES``
unlabelled samples in the window is skipped and counted in the log line, as are samples
labelled with a span id alone whose span was never stored. A stored sample says whether
it carried its own instant (``timed``, from migration 9 on), so the replay places it as
the live correlator did.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Sample,
    Span,
    Stack,
    Unattributed,
)
from pipeline.registry import Store
from processors.correlate.state import (
    EXACT_METHODS,
    MINUTE_NS,
    THREAD,
    WINDOW,
    CorrelatorState,
    random_source,
)

# Raw rows stored at most this long before the correlator received them: the exporter's
# insert (batched for its flush_interval, then the insert itself), ClickHouse's now() in
# whole seconds, and a server clock a little off ours. 2 x the correlator's flush_interval
# is added for the flush that follows placing a timed sample (state.oldest_held).
MARGIN_S = 10.0
MAX_TRACES = 100_000  # beyond: the newest traces are recovered, the count of others logged
CHUNK_TRACES = 500  # traces read, replayed and reconciled at a time
SEND_ROWS = 2_000  # rows per batch sent on (as the connector's outbox)
MAX_SERVICE_SPANS = 500_000  # spans of one service replayed for its unlabelled samples
MAX_SERVICE_SAMPLES = 2_000_000  # unlabelled samples of one service replayed
UNATTRIBUTED = "unattributed"  # a service's minute, as a key of ``deltas``: (b"", minute)
APPROX_METHODS = (THREAD, WINDOW, UNATTRIBUTED)

Key3 = tuple[bytes, bytes, str]  # trace, span, method
FIELDS = ("cpu_ns", "wall_ns", "sample_count", "inclusive_cpu_ns")


@dataclass
class Stored:
    """What ``span_attribution`` (exact methods), ``span_functions`` and ``span_stacks``
    hold for some traces: totals per key; span-only rows under their span's trace."""

    rows: dict[Key3, list[int]] = field(default_factory=dict)  # FIELDS..., span_known
    functions: dict[tuple[Key3, str], tuple[int, int]] = field(default_factory=dict)
    stacks: dict[tuple[Key3, int], tuple[int, int]] = field(default_factory=dict)


@dataclass
class Result:
    traces: int = 0
    rows: int = 0
    cpu_ns: int = 0
    skipped_traces: int = 0  # beyond MAX_TRACES
    services: int = 0  # whose unlabelled samples were reconciled
    skipped_services: int = 0  # beyond MAX_SERVICE_SPANS / MAX_SERVICE_SAMPLES


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
                                 dict(a.stack_cpu_ns), dict(a.stack_wall_ns))
            continue
        for f in FIELDS:
            setattr(e, f, getattr(e, f) + getattr(a, f))
        e.span_known = e.span_known or a.span_known
        _merge(e.self_cpu_ns, a.self_cpu_ns)
        _merge(e.self_wall_ns, a.self_wall_ns)
        _merge(e.stack_cpu_ns, a.stack_cpu_ns)
        _merge(e.stack_wall_ns, a.stack_wall_ns)
    by_trace: dict[bytes, list[Key3]] = {}
    for k in exp:
        by_trace.setdefault(k[0] if per_trace else b"", []).append(k)
    have_of: dict[bytes, list[int]] = {}
    for k, v in stored.rows.items():
        tot = have_of.setdefault(k[0] if per_trace else b"", [0, 0, 0, 0])
        for i in range(4):
            tot[i] += v[i]
    zero = [0, 0, 0, 0, 0]
    out: list[Attribution] = []
    for tid in sorted(by_trace):
        keys = sorted(by_trace[tid])
        stored_total = have_of.get(tid, [0, 0, 0, 0])
        room = [max(0, sum(getattr(exp[k], f) for k in keys) - stored_total[i])
                for i, f in enumerate(FIELDS)]
        for k in keys:
            e, s = exp[k], stored.rows.get(k, zero)
            got = []
            for i, f in enumerate(FIELDS):
                d = min(max(0, getattr(e, f) - s[i]), room[i])
                room[i] -= d
                got.append(d)
            fn_cpu = _grant({n: v - stored.functions.get((k, n), (0, 0))[0]
                             for n, v in e.self_cpu_ns.items()}, got[0])
            fn_wall = _grant({n: v - stored.functions.get((k, n), (0, 0))[1]
                              for n, v in e.self_wall_ns.items()}, got[1])
            st_cpu = _grant({n: v - stored.stacks.get((k, n), (0, 0))[0]
                             for n, v in e.stack_cpu_ns.items()}, got[0])
            st_wall = _grant({n: v - stored.stacks.get((k, n), (0, 0))[1]
                              for n, v in e.stack_wall_ns.items()}, got[1])
            # a span always has a row saying it is known (name, duration), even without CPU
            needs_known = e.span_known and not s[4]
            if not (any(got) or fn_cpu or fn_wall or st_cpu or st_wall or needs_known):
                continue
            out.append(Attribution(e.trace_id, e.span_id, e.method, e.service, e.name,
                                   e.parent_span_id, e.start_ns, e.duration_ns, e.span_known,
                                   got[0], got[1], got[2], fn_cpu, fn_wall, random_source(),
                                   got[3], st_cpu, st_wall))
    return out


async def read_checkpoint(store: Store, component: str) -> float | None:
    """``held_since`` of this correlator's newest checkpoint (unix seconds), if any."""
    _, rows = await store.query(
        f"SELECT toUnixTimestamp(argMax(held_since, updated)) FROM "
        f"{store.database}.correlator_checkpoint WHERE component = {{c:String}} "
        f"GROUP BY component", {"c": component})
    return float(rows[0][0]) if rows else None


async def write_checkpoint(store: Store, component: str, held_since: float) -> None:
    now = time.time()
    await store.insert("correlator_checkpoint",
                       [[component, datetime.fromtimestamp(held_since, tz=UTC),
                         datetime.fromtimestamp(now, tz=UTC), datetime.fromtimestamp(now, tz=UTC)]],
                       ["component", "held_since", "alive_at", "updated"])


async def _rows(store: Store, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    return (await store.query(sql.format(db=store.database), params))[1]


async def affected(store: Store, since: float) -> tuple[list[str], int]:
    """Trace ids (hex) with a raw row stored since ``since``, newest first, at most
    ``MAX_TRACES``; how many more there were."""
    w = {"w": int(since)}
    got = await _rows(store, """
SELECT t, max(at) AS last FROM (
    SELECT TraceId AS t, max(ingested_at) AS at FROM {db}.otel_traces
    WHERE ingested_at >= toDateTime({{w:UInt32}}) GROUP BY t
    UNION ALL
    SELECT trace_id AS t, max(ingested_at) AS at FROM {db}.profile_samples
    WHERE ingested_at >= toDateTime({{w:UInt32}}) AND trace_id != '' AND span_id != ''
    GROUP BY t
    UNION ALL
    SELECT trace_id AS t, max(time) AS at FROM {db}.span_index
    WHERE span_id GLOBAL IN (SELECT span_id FROM {db}.profile_samples
                             WHERE ingested_at >= toDateTime({{w:UInt32}})
                               AND trace_id = '' AND span_id != '')
    GROUP BY t
) WHERE t != '' GROUP BY t ORDER BY last DESC, t""", **w)
    traces = [str(r[0]) for r in got]
    return traces[:MAX_TRACES], max(0, len(traces) - MAX_TRACES)


async def load(store: Store, traces: list[str]
               ) -> tuple[list[Span], list[Sample], dict[int, Stack], Stored]:
    """Every span and labelled sample of these traces, and what is stored for them."""
    spans = [Span(bytes.fromhex(t), bytes.fromhex(s), bytes.fromhex(p), name, 0, svc,
                  int(start), int(start) + int(dur),
                  resource_attributes={k: v for k, v in (("process.pid", pid),
                                                         ("host.name", host)) if v},
                  attributes={"thread.id": tid} if tid else {})
             for t, s, p, name, svc, start, dur, pid, host, tid in await _rows(store, """
SELECT TraceId, SpanId, ParentSpanId, SpanName, ServiceName, toUnixTimestamp64Nano(Timestamp),
       Duration, ResourceAttributes['process.pid'], ResourceAttributes['host.name'],
       SpanAttributes['thread.id']
FROM {db}.otel_traces WHERE TraceId IN {{t:Array(String)}}""", t=traces)]
    trace_of = {s.span_id.hex(): s.trace_id for s in spans}
    ids = sorted(trace_of)
    where = ("(trace_id IN {{t:Array(String)}} OR (trace_id = '' AND span_id IN "
             "{{s:Array(String)}})) AND span_id != ''")
    samples = []
    for (t, s, svc, tns, stack, measure, value, count, stype, unit, thread, tname, sname,
         pid, host, timed) in await _rows(store, f"""
SELECT trace_id, span_id, service, toUnixTimestamp64Nano(time), stack_id, measure, value,
       count, sample_type, unit, thread_id, thread_name, span_name, pid, host, timed
FROM {{db}}.profile_samples WHERE {where} AND measure IN ('cpu', 'wall')""", t=traces, s=ids):
        tid, sid = bytes.fromhex(t), bytes.fromhex(s)
        samples.append(Sample(tid, sid, svc, int(tns), int(stack), measure, int(value),
                              int(count), stype, unit, int(thread), tname, sname, int(pid),
                              host, bool(timed)))
    stacks = await _stacks(store, samples)
    stored = Stored()
    await _stored(store, stored, where + " AND method IN ('link', 'link+time')", trace_of,
                  {"t": traces, "s": ids})
    return spans, samples, stacks, stored


async def _stacks(store: Store, samples: list[Sample]) -> dict[int, Stack]:
    """The leaf function of each stack of ``samples`` (all a replay needs of them)."""
    stacks: dict[int, Stack] = {}
    wanted = sorted({x.stack_id for x in samples})
    for i in range(0, len(wanted), 10_000):
        for sid_, leaf in await _rows(store, """
SELECT stack_id, any(leaf) FROM {db}.profile_stacks
WHERE stack_id IN {{ids:Array(UInt64)}} GROUP BY stack_id""", ids=wanted[i:i + 10_000]):
            stacks[int(sid_)] = Stack(int(sid_), [leaf] if leaf else [], [], [])
    return stacks


async def _stored(store: Store, stored: Stored, where: str, trace_of: dict[str, bytes],
                  params: dict[str, Any]) -> None:
    """Add to ``stored`` the attribution, function and stack totals of the rows that
    ``where`` selects (span-only rows under their span's trace, from ``trace_of``)."""

    def key(t: str, s: str, m: str) -> Key3:
        return (bytes.fromhex(t) or trace_of.get(s, b""), bytes.fromhex(s), m)

    for t, s, m, *v in await _rows(store, f"""
SELECT trace_id, span_id, method, sum(cpu_ns), sum(wall_ns), sum(sample_count),
       sum(inclusive_cpu_ns), max(span_known)
FROM {{db}}.span_attribution FINAL WHERE {where}
GROUP BY trace_id, span_id, method""", **params):
        have = stored.rows.setdefault(key(t, s, m), [0, 0, 0, 0, 0])
        for i in range(4):
            have[i] += int(v[i])
        have[4] = max(have[4], int(v[4]))
    for t, s, m, fn, c, w in await _rows(store, f"""
SELECT trace_id, span_id, method, function, sum(self_cpu_ns), sum(self_wall_ns)
FROM {{db}}.span_functions FINAL WHERE {where}
GROUP BY trace_id, span_id, method, function""", **params):
        k = (key(t, s, m), str(fn))
        c0, w0 = stored.functions.get(k, (0, 0))
        stored.functions[k] = (c0 + int(c), w0 + int(w))
    for t, s, m, st, c, w in await _rows(store, f"""
SELECT trace_id, span_id, method, stack_id, sum(cpu_ns), sum(wall_ns)
FROM {{db}}.span_stacks FINAL WHERE {where}
GROUP BY trace_id, span_id, method, stack_id""", **params):
        sk = (key(t, s, m), int(st))
        c0, w0 = stored.stacks.get(sk, (0, 0))
        stored.stacks[sk] = (c0 + int(c), w0 + int(w))


async def unlabelled_services(store: Store, since: float) -> list[tuple[str, int, int]]:
    """Services with unlabelled samples stored since ``since``, with the whole minutes
    around those samples' times: (service, first minute, end), nanoseconds."""
    got = await _rows(store, """
SELECT service, toUnixTimestamp64Nano(min(time)), toUnixTimestamp64Nano(max(time))
FROM {db}.profile_samples WHERE ingested_at >= toDateTime({{w:UInt32}})
  AND span_id = '' AND measure IN ('cpu', 'wall') GROUP BY service ORDER BY service""",
                      w=int(since))
    return [(str(svc), int(lo) - int(lo) % MINUTE_NS, int(hi) - int(hi) % MINUTE_NS + MINUTE_NS)
            for svc, lo, hi in got]


async def load_unlabelled(store: Store, service: str, lo: int, hi: int
                          ) -> tuple[list[Span], list[Sample], dict[int, Stack], Stored] | None:
    """The spans of ``service`` open in [lo, hi), its unlabelled samples taken then, and
    what is stored for them (approximate methods, unattributed minutes); None beyond the
    limits."""
    p = {"svc": service, "lo": lo, "hi": hi}
    spans = [Span(bytes.fromhex(t), bytes.fromhex(s), bytes.fromhex(par), name, 0, service,
                  int(start), int(start) + int(dur),
                  resource_attributes={k: v for k, v in (("process.pid", pid),
                                                         ("host.name", host)) if v},
                  attributes={"thread.id": tid} if tid else {})
             for t, s, par, name, start, dur, pid, host, tid in await _rows(store, """
SELECT TraceId, SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp), Duration,
       ResourceAttributes['process.pid'], ResourceAttributes['host.name'],
       SpanAttributes['thread.id']
FROM {db}.otel_traces WHERE ServiceName = {{svc:String}}
  AND Timestamp < fromUnixTimestamp64Nano({{hi:Int64}})
  AND toUnixTimestamp64Nano(Timestamp) + Duration > {{lo:Int64}}
LIMIT 1 BY TraceId, SpanId LIMIT {{n:UInt64}}""", n=MAX_SERVICE_SPANS + 1, **p)]
    if len(spans) > MAX_SERVICE_SPANS:
        return None
    samples = [Sample(b"", b"", service, int(tns), int(stack), measure, int(value), int(count),
                      stype, unit, int(thread), tname, sname, int(pid), host, bool(timed))
               for tns, stack, measure, value, count, stype, unit, thread, tname, sname, pid,
               host, timed in await _rows(store, """
SELECT toUnixTimestamp64Nano(time), stack_id, measure, value, count, sample_type, unit,
       thread_id, thread_name, span_name, pid, host, timed
FROM {db}.profile_samples WHERE service = {{svc:String}} AND span_id = ''
  AND measure IN ('cpu', 'wall') AND time >= fromUnixTimestamp64Nano({{lo:Int64}})
  AND time < fromUnixTimestamp64Nano({{hi:Int64}})
LIMIT {{n:UInt64}}""", n=MAX_SERVICE_SAMPLES + 1, **p)]
    if len(samples) > MAX_SERVICE_SAMPLES:
        return None
    stacks = await _stacks(store, samples)
    stored = Stored()
    keys = sorted({(s.trace_id.hex(), s.span_id.hex()) for s in spans})
    for i in range(0, len(keys), 10_000):
        chunk = {"t": [k[0] for k in keys[i:i + 10_000]], "s": [k[1] for k in keys[i:i + 10_000]]}
        where = ("(trace_id, span_id) IN arrayZip({{t:Array(String)}}, {{s:Array(String)}}) "
                 "AND method IN ('thread', 'window')")
        await _stored(store, stored, where, {}, chunk)
    for minute, cpu, wall, count in await _rows(store, """
SELECT toUnixTimestamp(minute), sum(cpu_ns), sum(wall_ns), sum(sample_count)
FROM {db}.unattributed_cpu FINAL WHERE service = {{svc:String}}
  AND minute >= toDateTime({{lo_s:UInt32}}) AND minute < toDateTime({{hi_s:UInt32}})
GROUP BY minute""", svc=service, lo_s=lo // 10**9, hi_s=hi // 10**9):
        key = (b"", (int(minute) * 10**9).to_bytes(8, "big"), UNATTRIBUTED)
        stored.rows[key] = [int(cpu), int(wall), int(count), 0, 0]
    return spans, samples, stacks, stored


async def recover_unlabelled(store: Store, since: float,
                             send: Callable[[AttributionBatch], Awaitable[None]],
                             res: Result) -> None:
    """Reconcile the unlabelled samples stored since ``since``, service by service."""
    for service, lo, hi in await unlabelled_services(store, since):
        got = await load_unlabelled(store, service, lo, hi)
        if got is None:
            res.skipped_services += 1
            continue
        spans, samples, stacks, stored = got
        rows = deltas(expected(spans, samples, stacks), stored, APPROX_METHODS,
                      per_trace=False)
        spans_rows = [r for r in rows if r.method != UNATTRIBUTED]
        minutes = [Unattributed(service, int.from_bytes(r.span_id, "big"), r.cpu_ns, r.wall_ns,
                                r.sample_count, random_source())
                   for r in rows if r.method == UNATTRIBUTED]
        for j in range(0, max(len(spans_rows), 1), SEND_ROWS):
            batch = AttributionBatch(spans_rows[j:j + SEND_ROWS], minutes if j == 0 else [])
            if len(batch):
                await send(batch)
        res.services += 1
        res.rows += len(rows)
        res.cpu_ns += sum(r.cpu_ns for r in rows)


async def recover(store: Store, since: float,
                  send: Callable[[AttributionBatch], Awaitable[None]]) -> Result:
    """Reconcile every trace with a raw row stored since ``since`` (unix seconds), then
    the unlabelled samples stored since then; each batch of delta rows is durable when
    ``send`` returns."""
    res = Result()
    traces, res.skipped_traces = await affected(store, since)
    for i in range(0, len(traces), CHUNK_TRACES):
        chunk = sorted(traces[i:i + CHUNK_TRACES])
        spans, samples, stacks, stored = await load(store, chunk)
        rows = deltas(expected(spans, samples, stacks), stored)
        for j in range(0, len(rows), SEND_ROWS):
            await send(AttributionBatch(rows[j:j + SEND_ROWS]))
        res.traces += len(chunk)
        res.rows += len(rows)
        res.cpu_ns += sum(r.cpu_ns for r in rows)
    await recover_unlabelled(store, since, send, res)
    return res

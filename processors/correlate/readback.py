"""Crash recovery's reading: the raw rows to replay, and what is stored for them.

Raw rows are read back whatever their ingest time: every span and labelled sample of the
traces touched since the checkpoint (``affected``, ``load``), or every span of a service
open in the minutes around its unlabelled samples, with those samples
(``unlabelled_services``, ``load_unlabelled``); with them, what ``span_attribution``,
``span_functions``, ``span_stacks`` and ``unattributed_cpu`` already hold (``Stored``).
Span-only rows (a sample labelled with a span id alone) are read under their span's trace.
A stored sample says whether it carried its own instant (``timed``, from migration 9 on),
so the replay places it as the live correlator did. Beyond ``MAX_TRACES`` the newest
traces are read; a service beyond ``MAX_SERVICE_SPANS`` or ``MAX_SERVICE_SAMPLES`` is not
read at all (``load_unlabelled`` returns None).

Everything is read per tenant (issue #17): the traces touched are (tenant, trace) pairs,
the services with unlabelled samples (tenant, service), and every query of one of them
filters every table by that tenant, so that a sample is only ever replayed with spans of
its own tenant, and compared with its own tenant's stored rows, even where two tenants
use the same trace and span ids.
"""

from __future__ import annotations

from typing import Any

from pipeline.records import Sample, Span, Stack
from pipeline.registry import Store
from processors.correlate.accumulators import MINUTE_NS
from processors.correlate.reconcile import KNOWN, UNATTRIBUTED, Key3, Stored

# the measures the correlator attributes (pipeline.records.ATTRIBUTED), as SQL
MEASURES = "('cpu', 'wall', 'lock', 'alloc')"

MAX_TRACES = 100_000  # beyond: the newest traces are recovered, the count of others logged
MAX_SERVICE_SPANS = 500_000  # spans of one service replayed for its unlabelled samples
MAX_SERVICE_SAMPLES = 2_000_000  # unlabelled samples of one service replayed


async def _rows(store: Store, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    return (await store.query(sql.format(db=store.database), params))[1]


async def affected(store: Store, since: float) -> tuple[list[tuple[str, str]], int]:
    """(tenant, trace id in hex) of the traces with a raw row stored since ``since``,
    newest first, at most ``MAX_TRACES``; how many more there were."""
    w = {"w": int(since)}
    got = await _rows(store, """
SELECT tenant, t, max(at) AS last FROM (
    SELECT tenant, TraceId AS t, max(ingested_at) AS at FROM {db}.otel_traces
    WHERE ingested_at >= toDateTime({{w:UInt32}}) GROUP BY tenant, t
    UNION ALL
    SELECT tenant, trace_id AS t, max(ingested_at) AS at FROM {db}.profile_samples
    WHERE ingested_at >= toDateTime({{w:UInt32}}) AND trace_id != '' AND span_id != ''
    GROUP BY tenant, t
    UNION ALL
    SELECT tenant, trace_id AS t, max(time) AS at FROM {db}.span_index
    WHERE (tenant, span_id) GLOBAL IN (SELECT tenant, span_id FROM {db}.profile_samples
                                       WHERE ingested_at >= toDateTime({{w:UInt32}})
                                         AND trace_id = '' AND span_id != '')
    GROUP BY tenant, t
) WHERE t != '' GROUP BY tenant, t ORDER BY last DESC, tenant, t""", **w)
    traces = [(str(r[0]), str(r[1])) for r in got]
    return traces[:MAX_TRACES], max(0, len(traces) - MAX_TRACES)


async def load(store: Store, tenant: str, traces: list[str], with_stored: bool = True
               ) -> tuple[list[Span], list[Sample], dict[int, Stack], Stored]:
    """Every span and labelled sample of these traces of ``tenant``, and what is stored
    for them (left empty with ``with_stored=False``: a backfill replaces it unread)."""
    spans = [Span(bytes.fromhex(t), bytes.fromhex(s), bytes.fromhex(p), name, 0, svc,
                  int(start), int(start) + int(dur),
                  resource_attributes={k: v for k, v in (("process.pid", pid),
                                                         ("host.name", host)) if v},
                  attributes={"thread.id": tid} if tid else {})
             for t, s, p, name, svc, start, dur, pid, host, tid in await _rows(store, """
SELECT TraceId, SpanId, ParentSpanId, SpanName, ServiceName, toUnixTimestamp64Nano(Timestamp),
       Duration, ResourceAttributes['process.pid'], ResourceAttributes['host.name'],
       SpanAttributes['thread.id']
FROM {db}.otel_traces WHERE tenant = {{tenant:String}} AND TraceId IN {{t:Array(String)}}""",
                                  tenant=tenant, t=traces)]
    trace_of = {s.span_id.hex(): s.trace_id for s in spans}
    ids = sorted(trace_of)
    where = ("tenant = {{tenant:String}} AND (trace_id IN {{t:Array(String)}} OR "
             "(trace_id = '' AND span_id IN {{s:Array(String)}})) AND span_id != ''")
    samples = []
    for (t, s, svc, tns, stack, measure, value, count, stype, unit, thread, tname, sname,
         pid, host, timed) in await _rows(store, f"""
SELECT trace_id, span_id, service, toUnixTimestamp64Nano(time), stack_id, measure, value,
       count, sample_type, unit, thread_id, thread_name, span_name, pid, host, timed
FROM {{db}}.profile_samples WHERE {where} AND measure IN {MEASURES}""",
                       tenant=tenant, t=traces, s=ids):
        tid, sid = bytes.fromhex(t), bytes.fromhex(s)
        samples.append(Sample(tid, sid, svc, int(tns), int(stack), measure, int(value),
                              int(count), stype, unit, int(thread), tname, sname, int(pid),
                              host, bool(timed)))
    stacks = await stacks_of(store, tenant, samples)
    stored = Stored()
    if not with_stored:
        return spans, samples, stacks, stored
    await _stored(store, stored,
                  where + " AND method IN ('link', 'link+time', 'link+share')", trace_of,
                  {"tenant": tenant, "t": traces, "s": ids})
    return spans, samples, stacks, stored


async def stacks_of(store: Store, tenant: str, samples: list[Sample]) -> dict[int, Stack]:
    """The leaf function of each stack of ``samples`` (all a replay needs of them), from
    ``tenant``'s stacks."""
    stacks: dict[int, Stack] = {}
    wanted = sorted({x.stack_id for x in samples})
    for i in range(0, len(wanted), 10_000):
        for sid_, leaf in await _rows(store, """
SELECT stack_id, any(leaf) FROM {db}.profile_stacks
WHERE tenant = {{tenant:String}} AND stack_id IN {{ids:Array(UInt64)}} GROUP BY stack_id""",
                                      tenant=tenant, ids=wanted[i:i + 10_000]):
            stacks[int(sid_)] = Stack(int(sid_), [leaf] if leaf else [], [], [])
    return stacks


async def _stored(store: Store, stored: Stored, where: str, trace_of: dict[str, bytes],
                  params: dict[str, Any]) -> None:
    """Add to ``stored`` the attribution, function and stack totals of the rows that
    ``where`` selects (span-only rows under their span's trace, from ``trace_of``);
    ``where`` filters by tenant (its parameter in ``params``)."""
    if not where.startswith("tenant = {{tenant:String}} AND ") or "tenant" not in params:
        raise ValueError("readback._stored: where must filter by tenant first")

    def key(t: str, s: str, m: str) -> Key3:
        return (bytes.fromhex(t) or trace_of.get(s, b""), bytes.fromhex(s), m)

    for t, s, m, *v in await _rows(store, f"""
SELECT trace_id, span_id, method, sum(cpu_ns), sum(wall_ns), sum(sample_count),
       sum(inclusive_cpu_ns), sum(lock_ns), sum(alloc_bytes), max(span_known)
FROM {{db}}.span_attribution FINAL WHERE {where}
GROUP BY trace_id, span_id, method""", **params):
        have = stored.rows.setdefault(key(t, s, m), [0] * (KNOWN + 1))
        for i in range(KNOWN):
            have[i] += int(v[i])
        have[KNOWN] = max(have[KNOWN], int(v[KNOWN]))
    for t, s, m, fn, *v in await _rows(store, f"""
SELECT trace_id, span_id, method, function, sum(self_cpu_ns), sum(self_wall_ns),
       sum(self_lock_ns), sum(self_alloc_bytes)
FROM {{db}}.span_functions FINAL WHERE {where}
GROUP BY trace_id, span_id, method, function""", **params):
        k = (key(t, s, m), str(fn))
        c0, w0, l0, a0 = stored.functions.get(k, (0, 0, 0, 0))
        stored.functions[k] = (c0 + int(v[0]), w0 + int(v[1]), l0 + int(v[2]), a0 + int(v[3]))
    for t, s, m, st, c, w in await _rows(store, f"""
SELECT trace_id, span_id, method, stack_id, sum(cpu_ns), sum(wall_ns)
FROM {{db}}.span_stacks FINAL WHERE {where}
GROUP BY trace_id, span_id, method, stack_id""", **params):
        sk = (key(t, s, m), int(st))
        c0, w0 = stored.stacks.get(sk, (0, 0))
        stored.stacks[sk] = (c0 + int(c), w0 + int(w))


async def unlabelled_services(store: Store, since: float
                              ) -> list[tuple[str, str, int, int]]:
    """Services with unlabelled samples stored since ``since``, with the whole minutes
    around those samples' times: (tenant, service, first minute, end), nanoseconds."""
    got = await _rows(store, """
SELECT tenant, service, toUnixTimestamp64Nano(min(time)), toUnixTimestamp64Nano(max(time))
FROM {db}.profile_samples WHERE ingested_at >= toDateTime({{w:UInt32}})
  AND span_id = '' AND measure IN ('cpu', 'wall', 'lock', 'alloc') GROUP BY tenant, service
ORDER BY tenant, service""", w=int(since))
    return [(str(tenant), str(svc), int(lo) - int(lo) % MINUTE_NS,
             int(hi) - int(hi) % MINUTE_NS + MINUTE_NS) for tenant, svc, lo, hi in got]


async def load_unlabelled(store: Store, tenant: str, service: str, lo: int, hi: int,
                          with_stored: bool = True
                          ) -> tuple[list[Span], list[Sample], dict[int, Stack], Stored] | None:
    """The spans of ``tenant``'s ``service`` open in [lo, hi), its unlabelled samples taken
    then, and what is stored for them (approximate methods, unattributed minutes; left
    empty with ``with_stored=False``); None beyond the limits."""
    p = {"tenant": tenant, "svc": service, "lo": lo, "hi": hi}
    spans = [Span(bytes.fromhex(t), bytes.fromhex(s), bytes.fromhex(par), name, 0, service,
                  int(start), int(start) + int(dur),
                  resource_attributes={k: v for k, v in (("process.pid", pid),
                                                         ("host.name", host)) if v},
                  attributes={"thread.id": tid} if tid else {})
             for t, s, par, name, start, dur, pid, host, tid in await _rows(store, """
SELECT TraceId, SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp), Duration,
       ResourceAttributes['process.pid'], ResourceAttributes['host.name'],
       SpanAttributes['thread.id']
FROM {db}.otel_traces WHERE tenant = {{tenant:String}} AND ServiceName = {{svc:String}}
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
FROM {db}.profile_samples WHERE tenant = {{tenant:String}} AND service = {{svc:String}}
  AND span_id = ''
  AND measure IN ('cpu', 'wall', 'lock', 'alloc') AND time >= fromUnixTimestamp64Nano({{lo:Int64}})
  AND time < fromUnixTimestamp64Nano({{hi:Int64}})
LIMIT {{n:UInt64}}""", n=MAX_SERVICE_SAMPLES + 1, **p)]
    if len(samples) > MAX_SERVICE_SAMPLES:
        return None
    stacks = await stacks_of(store, tenant, samples)
    stored = Stored()
    if not with_stored:
        return spans, samples, stacks, stored
    keys = sorted({(s.trace_id.hex(), s.span_id.hex()) for s in spans})
    for i in range(0, len(keys), 10_000):
        chunk = {"tenant": tenant, "t": [k[0] for k in keys[i:i + 10_000]],
                 "s": [k[1] for k in keys[i:i + 10_000]]}
        where = ("tenant = {{tenant:String}} AND (trace_id, span_id) IN "
                 "arrayZip({{t:Array(String)}}, {{s:Array(String)}}) "
                 "AND method IN ('thread', 'window')")
        await _stored(store, stored, where, {}, chunk)
    for minute, cpu, wall, count in await _rows(store, """
SELECT toUnixTimestamp(minute), sum(cpu_ns), sum(wall_ns), sum(sample_count)
FROM {db}.unattributed_cpu FINAL WHERE tenant = {{tenant:String}} AND service = {{svc:String}}
  AND minute >= toDateTime({{lo_s:UInt32}}) AND minute < toDateTime({{hi_s:UInt32}})
GROUP BY minute""", tenant=tenant, svc=service, lo_s=lo // 10**9, hi_s=hi // 10**9):
        key = (b"", (int(minute) * 10**9).to_bytes(8, "big"), UNATTRIBUTED)
        stored.rows[key] = [int(cpu), int(wall), int(count)] + [0] * (KNOWN + 1 - 3)
    return spans, samples, stacks, stored

"""The web UI's questions (pipeline/admin/ui/, issue #18), as SQL over spanprof's tables.

The same conventions as ``queries`` (whose helpers these build on): every function takes
``tenant`` and filters every table it reads by it, a bound parameter; parameters are
checked by the HTTP layer before a query runs.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.admin.queries import (
    APPROXIMATE,
    METHOD_SETS,
    TENANT,
    Queryable,
    _add_top_functions,
    _dicts,
    _spans_sql,
    methods_of,
)

SEARCH_ORDERS = {"duration": "d", "cpu": "incl", "self_cpu": "cpu", "off_cpu": "off"}
MAX_NS = 2**63 - 1


def _calls_sql(database: str, service: str | None, operation: str | None,
               rng: tuple[int, int], params: dict[str, Any]) -> str:
    """One row per call (span) of ``op_calls`` in a range: its operation, duration and CPU
    under the exact methods (what the materialized views keep there); one tenant's."""
    params.update({"lo": rng[0], "hi": rng[1]})
    where = [TENANT, "minute >= toDateTime({lo:UInt32})", "minute < toDateTime({hi:UInt32})"]
    if service:
        where.append("service = {service:String}")
        params["service"] = service
    if operation:
        where.append("operation = {operation:String}")
        params["operation"] = operation
    return (f"SELECT service, operation, trace_id, span_id, min(minute) AS m, "
            f"max(duration_ns) AS d, sum(cpu_ns) AS cpu, sum(inclusive_cpu_ns) AS incl "
            f"FROM {database}.op_calls WHERE {' AND '.join(where)} "
            "GROUP BY service, operation, trace_id, span_id")


async def operations(db: Queryable, database: str, rng: tuple[int, int], limit: int = 1000,
                     *, tenant: str) -> dict[str, Any]:
    """``tenant``'s services and operations with calls in a range (op_minute), most called
    first within each service: the choices of the UI's search form."""
    _, rows = await db.query(
        f"SELECT service, operation, uniqExactMerge(calls) AS n, sum(cpu_ns) AS cpu "
        f"FROM {database}.op_minute WHERE {TENANT} AND minute >= toDateTime({{lo:UInt32}}) "
        "AND minute < toDateTime({hi:UInt32}) AND method IN {methods:Array(String)} "
        "GROUP BY service, operation ORDER BY service, n DESC, operation LIMIT {limit:UInt32}",
        {"tenant": tenant, "lo": rng[0], "hi": rng[1], "limit": limit,
         "methods": list(METHOD_SETS["exact"])})
    services: dict[str, list[dict[str, Any]]] = {}
    for svc, op, n, cpu in rows:
        services.setdefault(svc, []).append({"name": op, "calls": int(n), "cpu_ns": int(cpu)})
    return {"from": rng[0], "to": rng[1],
            "services": [{"name": s, "operations": ops} for s, ops in services.items()]}


async def search_calls(db: Queryable, database: str, rng: tuple[int, int], *,
                       service: str | None = None, operation: str | None = None,
                       min_duration_ns: int = 0, max_duration_ns: int = MAX_NS,
                       min_cpu_ns: int = 0, order: str = "duration", limit: int = 50,
                       tenant: str) -> dict[str, Any]:
    """Trace search: ``tenant``'s calls (spans) of a service / operation in a range, within
    a duration window and over a CPU floor (inclusive CPU, exact methods: what ``op_calls``
    keeps, read by its key), sorted by ``order`` (``SEARCH_ORDERS``), largest first. Each
    row has its span's start, sample count, the methods behind its figures and the
    approximate methods' figures, as a trace's spans do."""
    params: dict[str, Any] = {"tenant": tenant, "dmin": min_duration_ns,
                              "dmax": max_duration_ns, "cmin": min_cpu_ns, "limit": limit}
    calls = _calls_sql(database, service, operation, rng, params)
    filt = "d >= {dmin:UInt64} AND d <= {dmax:UInt64} AND incl >= {cmin:UInt64}"
    _, rows = await db.query(
        f"SELECT service, operation, trace_id, span_id, toUInt32(m), d, cpu, incl, "
        f"toUInt64(greatest(0, toInt64(d) - toInt64(incl))) AS off FROM ({calls}) "
        f"WHERE {filt} ORDER BY {SEARCH_ORDERS[order]} DESC, trace_id, span_id "
        "LIMIT {limit:UInt32}", params)
    (total,), = (await db.query(f"SELECT count() FROM ({calls}) WHERE {filt}", params))[1]
    out = [{"trace_id": t, "span_id": s, "service": svc, "name": op,
            "start_time_unix_nano": int(m) * 1_000_000_000, "duration_ns": int(d),
            "cpu_ns": int(c), "inclusive_cpu_ns": int(i), "off_cpu_ns": int(o)}
           for svc, op, t, s, m, d, c, i, o in rows]
    await _add_span_facts(db, database, out, tenant)
    return {"from": rng[0], "to": rng[1], "order": order, "matched": int(total),
            "calls": out}


async def _add_span_facts(db: Queryable, database: str, spans: list[dict[str, Any]],
                          tenant: str) -> None:
    """Each span's start (otel_traces), sample count and methods (exact rows), and the
    approximate methods' figures under ``approximate``, for a page of spans."""
    for s in spans:
        s.update(sample_count=0, method="")
    if not spans:
        return
    by_key = {(s["trace_id"], s["span_id"]): s for s in spans}
    p = {"tenant": tenant, "tids": sorted({k[0] for k in by_key}),
         "sids": sorted({k[1] for k in by_key})}
    _, rows = await db.query(
        f"SELECT TraceId, SpanId, toUnixTimestamp64Nano(min(Timestamp)), any(ParentSpanId) "
        f"FROM {database}.otel_traces WHERE {TENANT} AND TraceId IN {{tids:Array(String)}} "
        "AND SpanId IN {sids:Array(String)} GROUP BY TraceId, SpanId", p)
    for t, sid, start, parent in rows:
        if (t, sid) in by_key:
            by_key[t, sid].update(start_time_unix_nano=int(start), parent_span_id=parent)
    _, rows = await db.query(
        f"SELECT trace_id, span_id, method, sum(cpu_ns), sum(inclusive_cpu_ns), "
        f"sum(sample_count) FROM {database}.span_attribution_totals WHERE {TENANT} AND "
        "trace_id IN {tids:Array(String)} AND span_id IN {sids:Array(String)} "
        "GROUP BY trace_id, span_id, method ORDER BY trace_id, span_id, method", p)
    for t, sid, m, cpu, incl, n in rows:
        if (t, sid) not in by_key:
            continue
        s = by_key[t, sid]
        if m in METHOD_SETS["exact"]:
            s["sample_count"] += int(n)
            s["method"] = ",".join(filter(None, (s["method"], m)))
        else:
            s.setdefault("approximate", {})[m] = {
                "cpu_ns": int(cpu), "inclusive_cpu_ns": int(incl), "sample_count": int(n)}


async def duration_histogram(db: Queryable, database: str, service: str,
                             operation: str | None, rng: tuple[int, int], buckets: int = 40,
                             *, tenant: str) -> dict[str, Any]:
    """How the durations of a service's (or one operation's) calls spread over a range:
    ``buckets`` log-spaced buckets from the shortest call to the longest, each with its
    calls and the share of their time spent on CPU (inclusive, exact methods), and the
    50th, 90th and 99th percentiles: where the slow 1% starts. ``tenant``'s calls."""
    params: dict[str, Any] = {"tenant": tenant}
    calls = _calls_sql(database, service, operation, rng, params)
    (n, lo, hi, qs), = (await db.query(
        f"SELECT count(), min(d), max(d), quantilesExact(0.5, 0.9, 0.99)(d) FROM ({calls})",
        params))[1]
    out: dict[str, Any] = {"service": service, "operation": operation, "from": rng[0],
                           "to": rng[1], "calls": int(n), "buckets": []}
    if not n:
        out.update(p50_ns=None, p90_ns=None, p99_ns=None)
        return out
    out.update(p50_ns=int(qs[0]), p90_ns=int(qs[1]), p99_ns=int(qs[2]))
    llo, lhi = math.log(max(1, int(lo))), math.log(int(hi) + 1)
    step = (lhi - llo) / buckets
    _, rows = await db.query(
        f"SELECT least({{nb:UInt32}} - 1, toUInt32(floor((log(greatest(d, 1)) - {{llo:Float64}})"
        f" / {{step:Float64}}))) AS b, count(), sum(d), sum(incl) FROM ({calls}) "
        "GROUP BY b ORDER BY b", {**params, "nb": buckets, "llo": llo, "step": step})
    got = {int(b): (int(c), int(d), int(i)) for b, c, d, i in rows}
    for b in range(buckets):
        c, d, i = got.get(b, (0, 0, 0))
        out["buckets"].append({
            "from_ns": int(math.exp(llo + b * step)), "to_ns": int(math.exp(llo + (b + 1) * step)),
            "count": c, "cpu_share": min(1.0, i / d) if d else 0.0})
    out["buckets"][0]["from_ns"] = int(lo)  # the edges are the calls' own at both ends
    out["buckets"][-1]["to_ns"] = int(hi)
    return out


async def function_spans(db: Queryable, database: str, function: str, rng: tuple[int, int],
                         *, service: str | None = None, operation: str | None = None,
                         order: str = "cpu", limit: int = 20, method: str = "exact",
                         tenant: str) -> dict[str, Any]:
    """The reverse question: which of ``tenant``'s spans, and which traces, burnt most of
    ``function`` (self CPU, or wall time with ``order="wall"``) in a range (span_functions:
    every span's functions, read by function and minute). Samples labelled with a span id
    alone (``trace_id = ''``) are given their trace through span_index."""
    params: dict[str, Any] = {"tenant": tenant, "function": function, "lo": rng[0],
                              "hi": rng[1], "methods": list(methods_of(method)),
                              "limit": limit}
    where = [TENANT, "function = {function:String}", "minute >= toDateTime({lo:UInt32})",
             "minute < toDateTime({hi:UInt32})", "method IN {methods:Array(String)}"]
    if service:
        where.append("service = {service:String}")
        params["service"] = service
    if operation:
        where.append("operation = {operation:String}")
        params["operation"] = operation
    w = " AND ".join(where)
    rows_sql = f"""SELECT if(f.trace_id = '', ix.trace_id, f.trace_id) AS tid, f.span_id AS sid,
       any(f.svc) AS service, any(f.op) AS operation, sum(f.c) AS fcpu, sum(f.w) AS fwall
FROM (SELECT trace_id, span_id, any(service) AS svc, any(operation) AS op,
             sum(self_cpu_ns) AS c, sum(self_wall_ns) AS w
      FROM {database}.span_functions FINAL WHERE {w} GROUP BY trace_id, span_id) AS f
LEFT JOIN (SELECT span_id, any(trace_id) AS trace_id FROM {database}.span_index
           WHERE {TENANT} AND span_id IN (SELECT span_id FROM {database}.span_functions
                                          WHERE {w} AND trace_id = '')
           GROUP BY span_id) AS ix ON f.span_id = ix.span_id
GROUP BY tid, sid
SETTINGS join_use_nulls = 0"""
    col = "fwall" if order == "wall" else "fcpu"
    _, rows = await db.query(
        f"SELECT tid, sid, service, operation, fcpu, fwall FROM ({rows_sql}) "
        f"WHERE {col} > 0 ORDER BY {col} DESC, tid, sid LIMIT {{limit:UInt32}}", params)
    spans = [{"trace_id": t, "span_id": s, "service": svc, "name": op,
              "function_cpu_ns": int(c), "function_wall_ns": int(wl)}
             for t, s, svc, op, c, wl in rows]
    _, trows = await db.query(
        f"SELECT tid, sum(fcpu) AS c, sum(fwall) AS wl, count() AS n, any(service), "
        f"any(operation) FROM ({rows_sql}) WHERE {col} > 0 GROUP BY tid "
        f"ORDER BY {'wl' if order == 'wall' else 'c'} DESC, tid LIMIT {{limit:UInt32}}",
        params)
    (cpu, wall, n_spans, n_traces), = (await db.query(
        f"SELECT sum(fcpu), sum(fwall), countIf({col} > 0), uniqExactIf(tid, {col} > 0) "
        f"FROM ({rows_sql})", params))[1]
    figures = {(s["trace_id"], s["span_id"]): s for s in spans}
    if spans:
        cols, frows = await db.query(_spans_sql(
            database, "t.trace_id IN {tids:Array(String)} AND t.span_id IN {sids:Array(String)}"
            " AND t.method IN {methods:Array(String)}"),
            {"tenant": tenant, "methods": params["methods"],
             "tids": sorted({k[0] for k in figures}), "sids": sorted({k[1] for k in figures})})
        for a in _dicts(cols, frows):
            s = figures.get((a["trace_id"], a["span_id"]))
            if s is not None:
                s.update({k: a[k] for k in ("start_time_unix_nano", "duration_ns", "cpu_ns",
                                            "inclusive_cpu_ns", "off_cpu_ns", "sample_count",
                                            "method")})
    return {"function": function, "from": rng[0], "to": rng[1], "order": order,
            "cpu_ns": int(cpu or 0), "wall_ns": int(wall or 0), "span_count": int(n_spans),
            "trace_count": int(n_traces), "spans": spans,
            "traces": [{"trace_id": t, "function_cpu_ns": int(c), "function_wall_ns": int(wl),
                        "spans": int(k), "service": svc, "name": op}
                       for t, c, wl, k, svc, op in trows]}


async def span(db: Queryable, database: str, trace_id: str, span_id: str,
               method: str = "exact", *, tenant: str) -> dict[str, Any] | None:
    """One span of ``tenant``'s trace as ``trace`` gives it (figures over the chosen
    methods, the approximate ones apart, top functions), read by its ids alone: the span
    view of a trace of thousands of spans needs one. None if neither its span record nor
    any CPU for it was stored."""
    methods = methods_of(method)
    p = {"tid": trace_id, "sid": span_id, "tenant": tenant}
    # its span record and every method's rows, in one query (two scalar subqueries, each
    # an array: empty when nothing was stored): one round trip to the engine less, and
    # on a page load the queries of the page's answers wait for each other.
    # span_attribution_totals' rows of this span, read from span_attribution by its ids:
    # the view would resolve the trace of every row stored without one (trace_id ''),
    # where this needs this span's alone (20 ms against 7 on 10 000 spans); the chosen
    # methods make the figures, the approximate others go apart
    (found, rows), = (await db.query(
        f"SELECT (SELECT groupArray(tuple(SpanId, ParentSpanId, ServiceName, SpanName, "
        f"toUnixTimestamp64Nano(Timestamp), Duration)) FROM (SELECT * FROM "
        f"{database}.otel_traces WHERE {TENANT} AND TraceId = {{tid:String}} AND "
        "SpanId = {sid:String} LIMIT 1)), "
        f"(SELECT groupArray(tuple(*)) FROM (SELECT method, max(service), max(name), "
        f"max(parent_span_id), toUnixTimestamp64Nano(max(start_time)), max(duration_ns), "
        f"sum(cpu_ns), sum(greatest(inclusive_cpu_ns, cpu_ns)), sum(wall_ns), "
        f"sum(sample_count), max(span_known), sum(lock_ns), sum(alloc_bytes) "
        f"FROM {database}.span_attribution FINAL "
        f"WHERE {TENANT} AND span_id = {{sid:String}} AND (trace_id = {{tid:String}} OR "
        f"trace_id = '' AND {{tid:String}} = (SELECT any(trace_id) FROM "
        f"{database}.span_index WHERE {TENANT} AND span_id = {{sid:String}})) "
        "GROUP BY method ORDER BY method))", p))[1]
    rows = sorted(rows, key=lambda r: str(r[0]))
    out: dict[str, Any] | None = None
    for sid, parent, service, name, start, duration in found:
        out = {"span_id": sid, "parent_span_id": parent, "service": service, "name": name,
               "start_time_unix_nano": int(start), "duration_ns": int(duration),
               "trace_id": trace_id, "cpu_ns": 0, "inclusive_cpu_ns": 0, "wall_ns": 0,
               "sample_count": 0, "off_cpu_ns": int(duration), "span_known": True,
               "method": "", "lock_ns": 0, "alloc_bytes": 0}
    chosen = [r for r in rows if r[0] in methods]
    if chosen:
        cpu, incl, wall, n, lock, alloc = (sum(int(r[k]) for r in chosen)
                                           for k in (6, 7, 8, 9, 11, 12))
        if out is None:  # CPU for a span whose span record never arrived: as _spans_sql
            top = [max(r[k] for r in chosen) for k in range(11)]
            out = {"trace_id": trace_id, "span_id": span_id, "service": top[1],
                   "name": top[2], "parent_span_id": top[3],
                   "start_time_unix_nano": int(top[4]), "duration_ns": int(top[5]),
                   "span_known": bool(top[10])}
        out.update(cpu_ns=cpu, inclusive_cpu_ns=incl, wall_ns=wall, sample_count=n,
                   lock_ns=lock, alloc_bytes=alloc,
                   method=",".join(sorted(r[0] for r in chosen)),
                   off_cpu_ns=max(0, out["duration_ns"] - incl))
    if out is None:
        return None
    for m, *_, cpu, incl, _, n, _, _, _ in rows:
        if m in APPROXIMATE and m not in methods:
            out.setdefault("approximate", {})[m] = {
                "cpu_ns": cpu, "inclusive_cpu_ns": incl, "sample_count": n}
    await _add_top_functions(db, database, [out], methods, tenant)
    return out

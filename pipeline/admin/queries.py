"""The questions the API answers about spans, as SQL over spanprof's tables: the spans
with the most CPU (or time, lock wait, bytes: ``top_spans``) and one trace's spans
(``trace``), each with its top functions; and what every query module builds on
(``Queryable``, the tenant filter, the methods a figure sums). Functions and stacks are
asked in ``function_queries``, the web UI's questions in ``ui_queries`` and
``flame_queries``.

Kept apart from the HTTP layer so that the CLI, the API and tests share one definition of
"a span's attribution" (the ``span_attribution_totals`` view: the sum of its delta rows).

Every question is one tenant's (issue #17): each function takes ``tenant`` and every table
or view it reads, subqueries and joins included, is filtered by ``tenant =
{tenant:String}``, a bound parameter (tenant is first in every table's key, so this is also
what narrows the read). A tenant with no rows, or a name no tenant has, gets nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

TOP_FUNCTIONS = 5


class Queryable(Protocol):
    async def query(self, sql: str, parameters: dict[str, Any] | None = None
                    ) -> tuple[list[str], list[tuple[Any, ...]]]: ...


# which rows add up to a span's figures: the exact methods by default; ``link+share``,
# ``thread`` and ``window`` rows are approximate and never summed with them unless asked
METHOD_SETS = {"exact": ("link", "link+time"),
               "all": ("link", "link+time", "link+share", "thread", "window")}
APPROXIMATE = ("link+share", "thread", "window")
# top_spans' orders: the column each sorts by
TOP_ORDERS = {"cpu": "cpu_ns", "inclusive": "inclusive_cpu_ns", "duration": "duration_ns",
              "off_cpu": "off_cpu_ns", "lock": "lock_ns", "alloc": "alloc_bytes"}


def _spans_sql(database: str, where: str, tail: str = "") -> str:
    """Per span, the sum of its rows over the chosen methods (aggregates get their own
    names inside, so that ClickHouse never reads an alias as the column it shadows)."""
    return f"""SELECT trace_id, span_id, service_ AS service, name_ AS name,
       parent_ AS parent_span_id, toUnixTimestamp64Nano(start_) AS start_time_unix_nano,
       duration_ AS duration_ns, cpu_ AS cpu_ns, incl_ AS inclusive_cpu_ns,
       toUInt64(greatest(0, toInt64(duration_) - toInt64(incl_))) AS off_cpu_ns,
       wall_ AS wall_ns, samples_ AS sample_count, known_ AS span_known, methods_ AS method,
       lock_ AS lock_ns, alloc_ AS alloc_bytes
FROM ({_ATTRIBUTED.format(database=database, where=where)})
{tail}"""


# the filter on every table read: the query's tenant, a bound parameter
TENANT = "tenant = {tenant:String}"

# a span's rows over some methods, summed (a span has rows only where CPU or wall time
# was joined to it; its name and duration are also in otel_traces); one tenant's
_ATTRIBUTED = """SELECT t.trace_id AS trace_id, t.span_id AS span_id, max(t.service) AS service_,
             max(t.name) AS name_, max(t.parent_span_id) AS parent_,
             max(t.start_time) AS start_, max(t.duration_ns) AS duration_,
             sum(t.cpu_ns) AS cpu_, sum(t.inclusive_cpu_ns) AS incl_, sum(t.wall_ns) AS wall_,
             sum(t.sample_count) AS samples_, max(t.span_known) AS known_,
             sum(t.lock_ns) AS lock_, sum(t.alloc_bytes) AS alloc_,
             arrayStringConcat(arraySort(groupUniqArray(t.method)), ',') AS methods_
      FROM {database}.span_attribution_totals AS t
      WHERE t.tenant = {{tenant:String}} AND ({where})
      GROUP BY t.trace_id, t.span_id"""

# the spans of otel_traces, one row each (a span delivered twice is stored twice until
# merged); one tenant's
_STORED = """SELECT TraceId AS trace_id, SpanId AS span_id, any(ServiceName) AS service_,
             any(SpanName) AS name_, any(ParentSpanId) AS parent_, min(Timestamp) AS start_,
             max(Duration) AS duration_, 1 AS found_
      FROM {database}.otel_traces
      WHERE tenant = {{tenant:String}} AND ({where})
      GROUP BY TraceId, SpanId"""

_TOP_COLUMNS = """trace_id, span_id, service, name, parent_span_id,
       toUnixTimestamp64Nano(start_) AS start_time_unix_nano, duration_ns, cpu_ns,
       inclusive_cpu_ns, toUInt64(greatest(0, toInt64(duration_ns) - toInt64(inclusive_cpu_ns)))
       AS off_cpu_ns, wall_ns, sample_count, span_known, method, lock_ns, alloc_bytes"""


def _top_sql(database: str, where: str, service_where: str, tail: str) -> str:
    """Every span, stored (otel_traces) or attributed (CPU that came for a span never
    stored): its figures summed over the chosen methods, zero where it has no rows (the
    longest and the most waiting spans are mostly those without CPU); name and duration
    from otel_traces first (the rows of CPU that reached its span before the span did
    carry none)."""
    return f"""SELECT {_TOP_COLUMNS} FROM (
  SELECT if(o.found_ = 1, o.trace_id, a.trace_id) AS trace_id,
         if(o.found_ = 1, o.span_id, a.span_id) AS span_id,
         if(o.found_ = 1, o.service_, a.service_) AS service,
         if(o.found_ = 1, o.name_, a.name_) AS name,
         if(o.found_ = 1, o.parent_, a.parent_) AS parent_span_id,
         if(o.found_ = 1, o.start_, a.start_) AS start_,
         if(o.found_ = 1, o.duration_, a.duration_) AS duration_ns,
         a.cpu_ AS cpu_ns, a.incl_ AS inclusive_cpu_ns, a.wall_ AS wall_ns,
         a.samples_ AS sample_count, greatest(a.known_, o.found_) AS span_known,
         a.methods_ AS method, a.lock_ AS lock_ns, a.alloc_ AS alloc_bytes
  FROM ({_STORED.format(database=database, where="1")}) AS o
  FULL OUTER JOIN ({_ATTRIBUTED.format(database=database, where=where)}) AS a
    ON a.trace_id = o.trace_id AND a.span_id = o.span_id
  SETTINGS join_use_nulls = 0)
WHERE span_known = 1 {service_where}
{tail}"""


def methods_of(spec: str) -> tuple[str, ...]:
    """``exact`` (link, link+time), ``all``, or a comma-separated list of methods."""
    if spec in METHOD_SETS:
        return METHOD_SETS[spec]
    out = tuple(m for m in spec.split(",") if m)
    bad = [m for m in out if m not in METHOD_SETS["all"]]
    if bad or not out:
        raise ValueError(f"method: expected exact, all or some of "
                         f"{', '.join(METHOD_SETS['all'])}; got {spec!r}")
    return out


def _dicts(cols: list[str], rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d = dict(zip(cols, r, strict=True))
        if "span_known" in d:
            d["span_known"] = bool(d["span_known"])
        out.append(d)
    return out


async def top_spans(db: Queryable, database: str, order: str = "cpu", limit: int = 20,
                    service: str | None = None, method: str = "exact", *, tenant: str
                    ) -> list[dict[str, Any]]:
    """``tenant``'s spans with the most CPU (or inclusive CPU, duration, off-CPU time, lock
    wait, bytes allocated)."""
    order_col = TOP_ORDERS[order]
    methods = methods_of(method)
    where = "t.method IN {methods:Array(String)}"
    params: dict[str, Any] = {"methods": list(methods), "limit": limit, "tenant": tenant}
    tail = (f"ORDER BY {order_col} DESC, trace_id, span_id "
            "LIMIT {limit:UInt32}")
    if service:
        params["service"] = service
    sql = _top_sql(database, where, "AND service = {service:String}" if service else "",
                   tail)
    cols, rows = await db.query(sql, params)
    spans = _dicts(cols, rows)
    await _add_top_functions(db, database, spans, methods, tenant)
    return spans


async def trace(db: Queryable, database: str, trace_id: str, method: str = "exact", *,
                tenant: str) -> dict[str, Any]:
    """Every span of one trace of ``tenant`` (from ``otel_traces``) with its attribution, if
    any; the approximate methods' figures, when there are some, under ``approximate``."""
    methods = methods_of(method)
    cols, rows = await db.query(
        f"SELECT SpanId AS span_id, ParentSpanId AS parent_span_id, ServiceName AS service, "
        f"SpanName AS name, toUnixTimestamp64Nano(Timestamp) AS start_time_unix_nano, "
        f"Duration AS duration_ns FROM {database}.otel_traces "
        f"WHERE {TENANT} AND TraceId = {{tid:String}} ORDER BY Timestamp, SpanId",
        {"tid": trace_id, "tenant": tenant})
    spans: dict[str, dict[str, Any]] = {}
    for d in _dicts(cols, rows):
        spans.setdefault(d["span_id"], {
            **d, "trace_id": trace_id, "cpu_ns": 0, "inclusive_cpu_ns": 0, "wall_ns": 0,
            "sample_count": 0, "off_cpu_ns": d["duration_ns"], "span_known": True,
            "method": "", "lock_ns": 0, "alloc_bytes": 0})
    cols, rows = await db.query(_spans_sql(
        database, "t.trace_id = {tid:String} AND t.method IN {methods:Array(String)}"),
        {"tid": trace_id, "methods": list(methods), "tenant": tenant})
    for a in _dicts(cols, rows):
        s = spans.get(a["span_id"])
        if s is None:  # CPU for a span whose span record never arrived
            spans[a["span_id"]] = a
            continue
        for k in ("cpu_ns", "inclusive_cpu_ns", "wall_ns", "sample_count", "method", "lock_ns",
                  "alloc_bytes"):
            s[k] = a[k]
        s["off_cpu_ns"] = max(0, s["duration_ns"] - s["inclusive_cpu_ns"])
    approx = [m for m in APPROXIMATE if m not in methods]
    if approx:
        _, rows = await db.query(
            f"SELECT span_id, method, sum(cpu_ns), sum(inclusive_cpu_ns), sum(sample_count) "
            f"FROM {database}.span_attribution_totals WHERE {TENANT} AND "
            "trace_id = {tid:String} AND method IN {methods:Array(String)} "
            "GROUP BY span_id, method ORDER BY span_id, method",
            {"tid": trace_id, "methods": approx, "tenant": tenant})
        for sid, m, cpu, incl, n in rows:
            if sid in spans:
                spans[sid].setdefault("approximate", {})[m] = {
                    "cpu_ns": cpu, "inclusive_cpu_ns": incl, "sample_count": n}
    out = list(spans.values())
    await _add_top_functions(db, database, out, methods, tenant)
    # a trace's CPU: self CPU adds up across spans without counting anything twice
    total_cpu = sum(s["cpu_ns"] for s in out)
    return {"trace_id": trace_id, "span_count": len(out), "cpu_ns": total_cpu, "spans": out}


async def _add_top_functions(db: Queryable, database: str, spans: list[dict[str, Any]],
                             methods: tuple[str, ...], tenant: str) -> None:
    for s in spans:
        s["top_functions"] = []
    if not spans:
        return
    by_key = {(s["trace_id"], s["span_id"]): s for s in spans}
    cols, rows = await db.query(
        f"SELECT trace_id, span_id, function, sum(self_cpu_ns) AS self_ns, "
        f"sum(self_wall_ns) AS self_wall_ns, sum(self_lock_ns) AS self_lock_ns, "
        f"sum(self_alloc_bytes) AS self_alloc_bytes FROM {database}.span_functions FINAL "
        f"WHERE {TENANT} AND (trace_id IN {{tids:Array(String)}} OR trace_id = '') "
        "AND span_id IN {sids:Array(String)} "
        "AND method IN {methods:Array(String)} "
        "GROUP BY trace_id, span_id, function ORDER BY self_ns DESC, function",
        {"tids": sorted({k[0] for k in by_key}), "sids": sorted({k[1] for k in by_key}),
         "methods": list(methods), "tenant": tenant})
    sums: dict[tuple[str, str], dict[str, list[int]]] = {}
    by_span = {k[1]: k for k in by_key}
    for tid, sid, fn, *values in rows:
        if not tid and sid in by_span:  # a span-only sample: its span is known by now
            tid = by_span[sid][0]
        if (tid, sid) in by_key:
            acc = sums.setdefault((tid, sid), {}).setdefault(fn, [0, 0, 0, 0])
            for i, v in enumerate(values):
                acc[i] += v
    for key, fns in sums.items():
        s = by_key[key]
        # self CPU; where there is some: wall, lock wait, bytes (value under "self_ns" or
        # "bytes")
        for i, name, unit in ((0, "top_functions", "self_ns"),
                              (1, "top_wall_functions", "self_ns"),
                              (2, "top_lock_functions", "self_ns"),
                              (3, "top_alloc_functions", "bytes")):
            top = [{"name": f, unit: v[i]} for f, v in
                   sorted(fns.items(), key=lambda x: (-x[1][i], x[0])) if v[i] > 0][:TOP_FUNCTIONS]
            if top or i == 0:
                s[name] = top

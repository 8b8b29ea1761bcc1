"""The questions the API answers, as SQL over spanprof's tables.

Kept apart from the HTTP layer so that the CLI, the API and tests share one definition of
"a span's attribution" (the ``span_attribution_totals`` view: the sum of its delta rows).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

HEX32 = re.compile(r"^[0-9a-f]{32}$")
TOP_FUNCTIONS = 5


class Queryable(Protocol):
    async def query(self, sql: str, parameters: dict[str, Any] | None = None
                    ) -> tuple[list[str], list[tuple[Any, ...]]]: ...


SPAN_FIELDS = ("trace_id, span_id, service, name, parent_span_id, "
               "toUnixTimestamp64Nano(start_time) AS start_time_unix_nano, duration_ns, cpu_ns, "
               "off_cpu_ns, wall_ns, sample_count, span_known, method")


def _dicts(cols: list[str], rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d = dict(zip(cols, r, strict=True))
        if "span_known" in d:
            d["span_known"] = bool(d["span_known"])
        out.append(d)
    return out


async def top_spans(db: Queryable, database: str, order: str = "cpu", limit: int = 20,
                    service: str | None = None, method: str = "link") -> list[dict[str, Any]]:
    order_col = {"cpu": "cpu_ns", "duration": "duration_ns", "off_cpu": "off_cpu_ns"}[order]
    where = ["method = {method:String}", "span_known = 1"]
    params: dict[str, Any] = {"method": method, "limit": limit}
    if service:
        where.append("service = {service:String}")
        params["service"] = service
    cols, rows = await db.query(
        f"SELECT {SPAN_FIELDS} FROM {database}.span_attribution_totals "
        f"WHERE {' AND '.join(where)} ORDER BY {order_col} DESC, trace_id, span_id "
        "LIMIT {limit:UInt32}", params)
    spans = _dicts(cols, rows)
    await _add_top_functions(db, database, spans, method)
    return spans


async def trace(db: Queryable, database: str, trace_id: str, method: str = "link"
                ) -> dict[str, Any]:
    """Every span of one trace (from ``otel_traces``) with its attribution, if any."""
    cols, rows = await db.query(
        f"SELECT SpanId AS span_id, ParentSpanId AS parent_span_id, ServiceName AS service, "
        f"SpanName AS name, toUnixTimestamp64Nano(Timestamp) AS start_time_unix_nano, "
        f"Duration AS duration_ns FROM {database}.otel_traces "
        "WHERE TraceId = {tid:String} ORDER BY Timestamp, SpanId", {"tid": trace_id})
    spans: dict[str, dict[str, Any]] = {}
    for d in _dicts(cols, rows):
        spans.setdefault(d["span_id"], {
            **d, "trace_id": trace_id, "cpu_ns": 0, "wall_ns": 0, "sample_count": 0,
            "off_cpu_ns": d["duration_ns"], "span_known": True, "method": method})
    cols, rows = await db.query(
        f"SELECT {SPAN_FIELDS} FROM {database}.span_attribution_totals "
        "WHERE trace_id = {tid:String} AND method = {method:String}",
        {"tid": trace_id, "method": method})
    for a in _dicts(cols, rows):
        s = spans.get(a["span_id"])
        if s is None:  # CPU for a span whose span record never arrived
            spans[a["span_id"]] = a
            continue
        for k in ("cpu_ns", "wall_ns", "sample_count"):
            s[k] = a[k]
        s["off_cpu_ns"] = max(0, s["duration_ns"] - s["cpu_ns"])
    out = list(spans.values())
    await _add_top_functions(db, database, out, method)
    total_cpu = sum(s["cpu_ns"] for s in out)
    return {"trace_id": trace_id, "span_count": len(out), "cpu_ns": total_cpu, "spans": out}


async def _add_top_functions(db: Queryable, database: str, spans: list[dict[str, Any]],
                             method: str) -> None:
    for s in spans:
        s["top_functions"] = []
    if not spans:
        return
    by_key = {(s["trace_id"], s["span_id"]): s for s in spans}
    cols, rows = await db.query(
        f"SELECT trace_id, span_id, function, sum(self_cpu_ns) AS self_ns, "
        f"sum(self_wall_ns) AS self_wall_ns FROM {database}.span_functions FINAL "
        "WHERE (trace_id IN {tids:Array(String)} OR trace_id = '') "
        "AND span_id IN {sids:Array(String)} "
        "AND method = {method:String} "
        "GROUP BY trace_id, span_id, function ORDER BY self_ns DESC, function",
        {"tids": sorted({k[0] for k in by_key}), "sids": sorted({k[1] for k in by_key}),
         "method": method})
    sums: dict[tuple[str, str], dict[str, list[int]]] = {}
    by_span = {k[1]: k for k in by_key}
    for tid, sid, fn, self_ns, self_wall in rows:
        if not tid and sid in by_span:  # a span-only sample: its span is known by now
            tid = by_span[sid][0]
        if (tid, sid) in by_key:
            acc = sums.setdefault((tid, sid), {}).setdefault(fn, [0, 0])
            acc[0] += self_ns
            acc[1] += self_wall
    per_span = {k: [(f, c, w) for f, (c, w) in v.items()] for k, v in sums.items()}
    for key, fns in per_span.items():
        s = by_key[key]
        s["top_functions"] = [{"name": f, "self_ns": c} for f, c, _ in
                              sorted(fns, key=lambda x: (-x[1], x[0])) if c > 0][:TOP_FUNCTIONS]
        wall = [{"name": f, "self_ns": w} for f, _, w in
                sorted(fns, key=lambda x: (-x[2], x[0])) if w > 0][:TOP_FUNCTIONS]
        if wall:
            s["top_wall_functions"] = wall

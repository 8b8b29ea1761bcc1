"""The questions about functions and their stacks, as SQL over the aggregates ClickHouse
maintains (``fn_minute``, ``op_minute``, ``op_stacks_minute``) and the per-span stacks
(``span_stacks``): a service's or an operation's hot functions (``functions``), which got
more expensive between two ranges (``diff``), and the stacks of a span's or an
operation's flame graph (``span_stacks``, ``operation_stacks``).

The same conventions as ``queries``: every function takes ``tenant`` and filters every
table it reads by it, a bound parameter.
"""

from __future__ import annotations

from typing import Any

from pipeline.admin.queries import TENANT, Queryable, methods_of


def _op_where(tenant: str, service: str, operation: str | None, rng: tuple[int, int],
              methods: tuple[str, ...], params: dict[str, Any]) -> str:
    params.update({"tenant": tenant, "service": service, "lo": rng[0], "hi": rng[1],
                   "methods": list(methods)})
    where = [TENANT, "service = {service:String}", "minute >= toDateTime({lo:UInt32})",
             "minute < toDateTime({hi:UInt32})", "method IN {methods:Array(String)}"]
    if operation:
        where.append("operation = {operation:String}")
        params["operation"] = operation
    return " AND ".join(where)


async def functions(db: Queryable, database: str, service: str, operation: str | None,
                    rng: tuple[int, int], limit: int = 20, method: str = "exact", *,
                    tenant: str) -> dict[str, Any]:
    """Functions by self CPU in a service (or one operation) of ``tenant`` over a range
    (fn_minute), with the operation totals (op_minute) they are a share of."""
    methods = methods_of(method)
    params: dict[str, Any] = {"limit": limit}
    where = _op_where(tenant, service, operation, rng, methods, params)
    _, rows = await db.query(
        f"SELECT function, sum(self_cpu_ns) AS cpu, sum(self_wall_ns) AS wall "
        f"FROM {database}.fn_minute WHERE {where} GROUP BY function "
        "ORDER BY cpu DESC, function LIMIT {limit:UInt32}", params)
    _, tot = await db.query(
        f"SELECT sum(cpu_ns), uniqExactMerge(calls) FROM {database}.op_minute "
        f"WHERE {where}", params)
    total, calls = (int(tot[0][0] or 0), int(tot[0][1] or 0)) if tot else (0, 0)
    return {"service": service, "operation": operation, "from": rng[0], "to": rng[1],
            "cpu_ns": total, "calls": calls,
            "functions": [{"name": f, "self_cpu_ns": int(c), "self_wall_ns": int(w),
                           "share": c / total if total else 0.0,
                           "per_call_ns": c / calls if calls else None}
                          for f, c, w in rows]}


async def diff(db: Queryable, database: str, service: str, operation: str | None,
               before: tuple[int, int], after: tuple[int, int], limit: int = 20,
               method: str = "exact", *, tenant: str) -> dict[str, Any]:
    """Which functions of ``tenant`` got more expensive: self CPU per call of the
    operation(s) in each range (per second of range when a range has no calls), sorted by
    the increase."""
    sides = []
    for rng in (before, after):
        got = await functions(db, database, service, operation, rng, limit=10_000,
                              method=method, tenant=tenant)
        per = got["calls"] or max(1, rng[1] - rng[0])
        sides.append(({f["name"]: f["self_cpu_ns"] / per for f in got["functions"]}, got))
    (b, bgot), (a, agot) = sides
    unit = "per_call" if bgot["calls"] and agot["calls"] else "per_second"
    out = []
    for name in b.keys() | a.keys():
        x, y = b.get(name, 0.0), a.get(name, 0.0)
        out.append({"name": name, "before_ns": x, "after_ns": y, "delta_ns": y - x,
                    "ratio": (y / x) if x else None})
    out.sort(key=lambda d: (-d["delta_ns"], d["name"]))
    return {"service": service, "operation": operation, "unit": unit,
            "before": {"from": before[0], "to": before[1], "calls": bgot["calls"],
                       "cpu_ns": bgot["cpu_ns"]},
            "after": {"from": after[0], "to": after[1], "calls": agot["calls"],
                      "cpu_ns": agot["cpu_ns"]},
            "functions": out[:limit]}


async def _frames(db: Queryable, database: str, by_stack: dict[int, int], tenant: str
                  ) -> list[dict[str, Any]]:
    """The stacks' frames, root first, from ``tenant``'s own stacks (profile_stacks is per
    tenant: the same id in another tenant is another stack)."""
    if not by_stack:
        return []
    _, rows = await db.query(
        f"SELECT stack_id, any(functions) FROM {database}.profile_stacks "
        f"WHERE {TENANT} AND stack_id IN {{ids:Array(UInt64)}} GROUP BY stack_id",
        {"ids": sorted(by_stack), "tenant": tenant})
    names = {int(sid): list(fns) for sid, fns in rows}
    return [{"frames": list(reversed(names.get(sid, ["[unknown stack]"]))), "cpu_ns": v}
            for sid, v in sorted(by_stack.items()) if v > 0]


async def subtree(db: Queryable, database: str, trace_id: str, span_id: str, *,
                  tenant: str) -> set[str]:
    """The span's id and its descendants' in its own service (``tenant``'s trace)."""
    _, rows = await db.query(
        f"SELECT SpanId, ParentSpanId, ServiceName FROM {database}.otel_traces "
        f"WHERE {TENANT} AND TraceId = {{tid:String}}", {"tid": trace_id, "tenant": tenant})
    children: dict[str, list[str]] = {}
    service = {s: svc for s, _, svc in rows}
    for s_, p_, _ in rows:
        children.setdefault(p_, []).append(s_)
    wanted, todo = {span_id}, [span_id]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in wanted and service.get(c) == service.get(span_id):
                wanted.add(c)
                todo.append(c)
    return wanted


async def span_stacks(db: Queryable, database: str, trace_id: str, span_id: str,
                      method: str = "exact", *, tenant: str) -> dict[str, Any]:
    """A span's stacks, root frame first, with its descendants in the same service (the
    span's inclusive flame graph); ``tenant``'s span."""
    methods = methods_of(method)
    wanted = await subtree(db, database, trace_id, span_id, tenant=tenant)
    _, rows = await db.query(
        f"SELECT stack_id, sum(cpu_ns) FROM {database}.span_stacks FINAL "
        f"WHERE {TENANT} AND trace_id IN ({{tid:String}}, '') "
        "AND span_id IN {sids:Array(String)} "
        "AND method IN {methods:Array(String)} GROUP BY stack_id",
        {"tid": trace_id, "sids": sorted(wanted), "methods": list(methods), "tenant": tenant})
    stacks = await _frames(db, database, {int(s): int(v) for s, v in rows}, tenant)
    return {"trace_id": trace_id, "span_id": span_id, "spans": len(wanted),
            "cpu_ns": sum(s["cpu_ns"] for s in stacks), "stacks": stacks}


async def operation_stacks(db: Queryable, database: str, service: str, operation: str | None,
                           rng: tuple[int, int], method: str = "exact", *, tenant: str
                           ) -> dict[str, Any]:
    """Stacks of a service (or one operation) of ``tenant`` over a range, root frame
    first."""
    params: dict[str, Any] = {}
    where = _op_where(tenant, service, operation, rng, methods_of(method), params)
    _, rows = await db.query(
        f"SELECT stack_id, sum(cpu_ns) FROM {database}.op_stacks_minute WHERE {where} "
        "GROUP BY stack_id", params)
    stacks = await _frames(db, database, {int(s): int(v) for s, v in rows}, tenant)
    return {"service": service, "operation": operation, "from": rng[0], "to": rng[1],
            "cpu_ns": sum(s["cpu_ns"] for s in stacks), "stacks": stacks}

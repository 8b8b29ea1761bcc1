"""The web UI's flame graphs (issue #18): a span's (with or without its children, CPU or
wall) and an operation's over a range, with another range to compare (a differential
graph), as SQL over spanprof's tables. The same conventions as ``queries``: every
function takes ``tenant`` and filters every table it reads by it."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.admin.function_queries import _op_where, subtree
from pipeline.admin.queries import TENANT, Queryable, methods_of

MAX_FLAME_NODES = 100_000
# each prefix of the frames ``f`` (root first) as a 64-bit hash: see _flame_sql
PATH_HASHES = ("arrayCumSum(arrayMap((x, i) -> cityHash64(x) * bitOr(cityHash64(i), 1), f, "
               "arrayEnumerate(f)))")


def _flame_sql(database: str, stacks: str, totals: str = "") -> str:
    """The flame graph's nodes, from ``stacks`` (a query of ``stack_id, v``, the value
    drawn, one tenant's; stacks with no value are not drawn):
    each path from the root is a node (a hash of its frames, its parent's hash, its frame
    and depth) with the value of every stack through it, merged in ClickHouse so that
    only the nodes drawn cross to Python. The ``{max_nodes}`` largest are kept (by value,
    then depth: a node's ancestors are never smaller, so the kept nodes form a tree).

    Where the time goes (10 000 stacks of 8-24 frames, 96 000 paths, on the embedded
    engine): reading the stacks' frames, then the paths' ``GROUP BY``. The frames are
    those of the stacks drawn only (``IN``), joined ``ANY``: one row per stack, any of
    the copies of a stack not yet merged (a stack's id is its frames' hash: they are the
    same), where grouping ``profile_stacks`` by id to drop them cost 30 ms of 80. A
    path's hash (``PATH_HASHES``) is a prefix sum, the frame at depth ``i`` hashed and
    multiplied by an odd constant of ``i``, mod 2^64: vectorised, where chaining each
    prefix's hash with its parent's (``arrayFold``) ran a lambda per frame (10 ms more)
    and hashing each prefix whole was quadratic in the depth. Paths collide with the
    odds of random 64-bit values, as with a chained hash; the tests count them.

    ``totals`` (aggregates over ``s``, e.g. ``sum(v)``) adds a column ``totals``: their
    tuple, the same on every row (a scalar subquery, run once): the figures of the whole
    graph in the same query, one round trip to the engine less (a small query took 10-15
    ms in a page load under load, where the queries of the page's answers wait for each
    other)."""
    tot = f", (SELECT tuple({totals}) FROM s) AS totals" if totals else ""
    return f"""WITH s AS ({stacks})
SELECT h, any(up) AS parent, any(name) AS frame, any(depth) AS level, sum(v) AS value{tot}
FROM (SELECT s.v AS v, if(empty(n.f), ['[unknown stack]'], n.f) AS f,
             {PATH_HASHES} AS hs
      FROM s ANY LEFT JOIN (SELECT stack_id, reverse(functions) AS f
                            FROM {database}.profile_stacks
                            WHERE {TENANT} AND stack_id IN (SELECT stack_id FROM s)) AS n
        ON s.stack_id = n.stack_id
      WHERE s.v > 0)
ARRAY JOIN hs AS h, arrayEnumerate(f) AS depth, f AS name,
           arrayPushFront(arrayPopBack(hs), toUInt64(0)) AS up
GROUP BY h"""


async def _flame(db: Queryable, database: str, stacks: str, params: dict[str, Any],
                 max_nodes: int, base: str | None = None, base_params: dict[str, Any] | None
                 = None) -> dict[str, Any]:
    """Total, stack count, CPU and wall (``stacks`` also has ``c`` and ``w``) and the
    largest nodes of ``stacks``; with ``base`` (another ``stack_id, v`` query), its total
    and each kept node's value there (``base_values``: hash -> value)."""
    totals = "sum(v), countIf(v > 0), sum(c), sum(w)"
    _, rows = await db.query(
        f"SELECT h, parent, frame, value, count() OVER () AS nodes, totals "
        f"FROM ({_flame_sql(database, stacks, totals)}) "
        "ORDER BY value DESC, level, h LIMIT {max_nodes:UInt32} SETTINGS join_use_nulls = 0",
        {**params, "max_nodes": max_nodes})
    if rows:
        total, n, cpu, wall = rows[0][5]
    else:  # nothing drawn: the figures alone (a wall profile's, under measure=cpu)
        (total, n, cpu, wall), = (await db.query(f"SELECT {totals} FROM ({stacks})",
                                                 params))[1]
    out: dict[str, Any] = {
        "total": int(total or 0), "stack_count": int(n), "cpu_ns": int(cpu or 0),
        "wall_ns": int(wall or 0),
        "nodes": [r[:4] for r in rows],  # hash, parent's, frame, value (ints from the driver)
        "nodes_left_out": int(rows[0][4]) - len(rows) if rows else 0}
    if base is not None:
        bp = {**(base_params or {}), "hs": [r[0] for r in out["nodes"]]}
        btotals = "sum(v), countIf(v > 0)"
        _, brows = await db.query(
            f"SELECT h, value, totals FROM ({_flame_sql(database, base, btotals)}) "
            "WHERE h IN {hs:Array(UInt64)} SETTINGS join_use_nulls = 0", bp)
        if brows:
            btotal, bn = brows[0][2]
        else:
            (btotal, bn), = (await db.query(f"SELECT {btotals} FROM ({base})", bp))[1]
        out.update(base_total=int(btotal or 0), base_stack_count=int(bn),
                   base_values={int(h): int(v) for h, v, _ in brows})
    return out


async def span_flame(db: Queryable, database: str, trace_id: str, span_id: str, *,
                     children: bool = True, measure: str = "cpu", method: str = "exact",
                     max_nodes: int = 10_000, tenant: str) -> dict[str, Any]:
    """A span's flame graph (``_flame``) of CPU or wall time: the span alone, or with its
    descendants in the same service (``children``, as ``span_stacks``); with the span's
    CPU and wall totals (whichever is drawn)."""
    methods = methods_of(method)
    wanted = await subtree(db, database, trace_id, span_id, tenant=tenant) if children \
        else {span_id}
    params = {"tid": trace_id, "sids": sorted(wanted), "methods": list(methods),
              "tenant": tenant}
    where = (f"{TENANT} AND trace_id IN ({{tid:String}}, '') AND span_id IN "
             "{sids:Array(String)} AND method IN {methods:Array(String)}")
    col = "wall_ns" if measure == "wall" else "cpu_ns"
    stacks = (f"SELECT stack_id, sum({col}) AS v, sum(cpu_ns) AS c, sum(wall_ns) AS w "
              f"FROM {database}.span_stacks FINAL WHERE {where} GROUP BY stack_id")
    got = await _flame(db, database, stacks, params, max_nodes)
    return {"trace_id": trace_id, "span_id": span_id, "children": children,
            "spans": len(wanted), "measure": measure, **got}


async def operation_flame(db: Queryable, database: str, service: str, operation: str | None,
                          rng: tuple[int, int], *, base: tuple[int, int] | None = None,
                          method: str = "exact", max_nodes: int = 10_000, tenant: str
                          ) -> dict[str, Any]:
    """A service's (or one operation's) CPU flame graph over a range (op_stacks_minute);
    with ``base``, the same paths' values over that range too, and each range's calls."""
    methods = methods_of(method)
    params: dict[str, Any] = {}
    where = _op_where(tenant, service, operation, rng, methods, params)
    stacks = (f"SELECT stack_id, sum(cpu_ns) AS v, v AS c, sum(wall_ns) AS w "
              f"FROM {database}.op_stacks_minute WHERE {where} GROUP BY stack_id")
    out: dict[str, Any] = {"service": service, "operation": operation, "from": rng[0],
                           "to": rng[1], "measure": "cpu"}
    if base is None:
        return {**out, **await _flame(db, database, stacks, params, max_nodes)}
    bparams: dict[str, Any] = {}
    bwhere = _op_where(tenant, service, operation, base, methods, bparams)
    bstacks = (f"SELECT stack_id, sum(cpu_ns) AS v FROM {database}.op_stacks_minute "
               f"WHERE {bwhere} GROUP BY stack_id HAVING v > 0")
    got, calls, base_calls = await asyncio.gather(
        _flame(db, database, stacks, params, max_nodes, bstacks, bparams),
        operation_calls(db, database, service, operation, rng, method=method, tenant=tenant),
        operation_calls(db, database, service, operation, base, method=method,
                        tenant=tenant))
    return {**out, **got, "base_range": list(base), "calls": calls, "base_calls": base_calls}


async def operation_calls(db: Queryable, database: str, service: str, operation: str | None,
                          rng: tuple[int, int], method: str = "exact", *, tenant: str) -> int:
    """How many calls of a service (or one operation) of ``tenant`` a range holds
    (op_minute): what a differential flame graph compares per call."""
    params: dict[str, Any] = {}
    where = _op_where(tenant, service, operation, rng, methods_of(method), params)
    _, rows = await db.query(
        f"SELECT uniqExactMerge(calls) FROM {database}.op_minute WHERE {where}", params)
    return int(rows[0][0] or 0) if rows else 0

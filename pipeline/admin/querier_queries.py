"""The questions of Pyroscope's query API (admin/querier.py) as SQL over spanprof's raw
samples (``profile_samples``, stacks from ``profile_stacks``), and the flame graph in
Pyroscope's flamebearer layout.

The same conventions as ``queries``: every function takes ``tenant`` and filters every
table it reads by it, a bound parameter; labels and profile types come from
``querier_selector``; time ranges are milliseconds, checked by the caller. Every answer is
bounded: its rows are limited in SQL and ``TooMany`` (``resource_exhausted``) says which
request field to narrow when a limit is reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.admin.querier_selector import LABELS, PUBLIC, Matcher, ProfileType, type_of, where
from pipeline.admin.queries import TENANT, Queryable

MAX_VALUES = 10_000  # label values, label sets (Series), profile types
MAX_SERIES = 1_000  # SelectSeries' series without a limit
MAX_POINTS = 2_000_000  # SelectSeries' series x steps
MAX_TRACE_SPANS = 200_000  # spans read to find the descendants of a span selector


class TooMany(Exception):
    """An answer over a bound: ``resource_exhausted``, naming the field to narrow."""


def _rows(database: str, rng: tuple[int, int], params: dict[str, Any], tenant: str) -> str:
    params.update(tenant=tenant, lo=rng[0], hi=rng[1])
    return (f"FROM {database}.profile_samples WHERE {TENANT} "
            "AND time >= fromUnixTimestamp64Milli({lo:Int64}) "
            "AND time < fromUnixTimestamp64Milli({hi:Int64})")


async def profile_types(db: Queryable, database: str, rng: tuple[int, int], *, tenant: str
                        ) -> list[ProfileType]:
    """The profile types ``tenant`` has samples of in the range, by id."""
    params: dict[str, Any] = {}
    _, rows = await db.query(
        f"SELECT DISTINCT measure, sample_type, unit {_rows(database, rng, params, tenant)} "
        f"LIMIT {MAX_VALUES}", params)
    found = {t.id: t for m, st, u in rows if (t := type_of(m, st, u)) is not None}
    return [found[k] for k in sorted(found)]


async def label_names(db: Queryable, database: str, selector_sql: str,
                      params: dict[str, Any], rng: tuple[int, int], *, tenant: str
                      ) -> list[str]:
    """The labels with a value in some matching sample (the private ones when any)."""
    checks = ", ".join(f"max({LABELS[n]} != '')" for n in PUBLIC)
    _, rows = await db.query(
        f"SELECT count(), {checks} {_rows(database, rng, params, tenant)} "
        f"AND ({selector_sql})", params)
    n, *has = rows[0]
    if not n:
        return []
    return sorted(["__name__", "__profile_type__",
                   *(name for name, h in zip(PUBLIC, has, strict=True) if h)])


async def label_values(db: Queryable, database: str, name: str, selector_sql: str,
                       params: dict[str, Any], rng: tuple[int, int], *, tenant: str
                       ) -> list[str]:
    _, rows = await db.query(
        f"SELECT DISTINCT {LABELS[name]} AS v {_rows(database, rng, params, tenant)} "
        f"AND ({selector_sql}) AND v != '' ORDER BY v LIMIT {MAX_VALUES + 1}", params)
    if len(rows) > MAX_VALUES:
        raise TooMany(f"name: {name} has more than {MAX_VALUES} values in the range: narrow "
                      "the matchers or the range")
    return [r[0] for r in rows]


async def series(db: Queryable, database: str, names: list[str], selector_sql: str,
                 params: dict[str, Any], rng: tuple[int, int], *, tenant: str
                 ) -> list[list[tuple[str, str]]]:
    """The distinct label sets (of ``names``) of the matching samples."""
    cols = ", ".join(f"{LABELS[n]} AS l{i}" for i, n in enumerate(names))
    order = ", ".join(f"l{i}" for i in range(len(names)))
    _, rows = await db.query(
        f"SELECT DISTINCT {cols} {_rows(database, rng, params, tenant)} AND ({selector_sql}) "
        f"ORDER BY {order} LIMIT {MAX_VALUES + 1}", params)
    if len(rows) > MAX_VALUES:
        raise TooMany(f"matchers: more than {MAX_VALUES} series in the range: narrow the "
                      "matchers, the label names or the range")
    return [[(n, v) for n, v in zip(names, r, strict=True) if v] for r in rows]


def sample_filter(ptype: ProfileType, matchers: list[Matcher], params: dict[str, Any],
                  trace_ids: list[str] | None = None, span_ids: list[str] | None = None
                  ) -> str:
    """The samples of a profile type that a selector (and trace and span ids) picks."""
    out = [ptype.where(params), f"({where(matchers, params, 'm')})"]
    if trace_ids:
        params["tids"] = trace_ids
        out.append("trace_id IN {tids:Array(String)}")
    if span_ids:
        params["sids"] = span_ids
        out.append("span_id IN {sids:Array(String)}")
    return " AND ".join(out)


async def with_descendants(db: Queryable, database: str, span_ids: list[str], *,
                           tenant: str) -> list[str]:
    """The spans named and their descendants in the same service: what a span-profiling
    SDK labels with its local root span's id, and what an OTLP profiler links to the
    children themselves."""
    _, rows = await db.query(
        f"SELECT span_id, any(trace_id) FROM {database}.span_index WHERE {TENANT} "
        "AND span_id IN {sids:Array(String)} GROUP BY span_id",
        {"tenant": tenant, "sids": span_ids})
    traces = sorted({t for _, t in rows if t})
    if not traces:
        return span_ids
    _, spans = await db.query(
        f"SELECT SpanId, ParentSpanId, ServiceName FROM {database}.otel_traces "
        "WHERE tenant = {tenant:String} AND TraceId IN {tids:Array(String)} "
        f"LIMIT {MAX_TRACE_SPANS + 1}", {"tenant": tenant, "tids": traces})
    if len(spans) > MAX_TRACE_SPANS:
        raise TooMany(f"span_selector: the traces of these spans hold more than "
                      f"{MAX_TRACE_SPANS} spans")
    service = {s: svc for s, _, svc in spans}
    children: dict[str, list[str]] = {}
    for s, p, _ in spans:
        children.setdefault(p, []).append(s)
    wanted, todo = set(span_ids), list(span_ids)
    while todo:
        parent = todo.pop()
        for c in children.get(parent, []):
            if c not in wanted and service.get(c) == service.get(parent):
                wanted.add(c)
                todo.append(c)
    return sorted(wanted)


# the merged paths of the samples' stacks, as in flame_queries._flame_sql, with each path's
# self value (the stacks that end there): a path is a node, its hash chaining its parent's
# with its frame; the {max_nodes} largest are kept (by value, then depth: ancestors are
# never smaller, so the kept nodes form a tree)
_FLAME = """WITH s AS ({stacks}),
n AS (SELECT stack_id, reverse(any(functions)) AS f FROM {database}.profile_stacks
      WHERE tenant = {{tenant:String}} AND stack_id IN (SELECT stack_id FROM s)
      GROUP BY stack_id)
SELECT h, any(up) AS parent, any(name) AS frame, any(depth) AS level, sum(v) AS value,
       sumIf(v, depth = length(f)) AS self
FROM (SELECT s.v AS v, if(empty(n.f), ['[unknown stack]'], n.f) AS f,
             arrayPopFront(arrayFold((acc, x) -> arrayPushBack(acc, cityHash64(acc[-1], x)),
                                     f, [toUInt64(0)])) AS hs
      FROM s LEFT JOIN n ON s.stack_id = n.stack_id WHERE s.v > 0)
ARRAY JOIN hs AS h, arrayEnumerate(f) AS depth, f AS name,
           arrayPushFront(arrayPopBack(hs), toUInt64(0)) AS up
GROUP BY h
ORDER BY value DESC, level, h LIMIT {{max_nodes:UInt32}}
SETTINGS join_use_nulls = 0"""


async def flame(db: Queryable, database: str, sample_sql: str, params: dict[str, Any],
                rng: tuple[int, int], max_nodes: int, *, tenant: str) -> dict[str, Any]:
    """The merged flame graph of the samples ``sample_sql`` picks, in flamebearer form."""
    stacks = (f"SELECT stack_id, sum(value) AS v {_rows(database, rng, params, tenant)} "
              f"AND {sample_sql} GROUP BY stack_id")
    (total,), = (await db.query(f"SELECT sum(v) FROM ({stacks})", params))[1]
    _, rows = await db.query(_FLAME.format(stacks=stacks, database=database),
                             {**params, "max_nodes": max_nodes})
    return flamebearer([(int(h), int(up), str(f), int(v), int(sv))
                        for h, up, f, _, v, sv in rows], int(total or 0))


@dataclass
class _Node:
    name: str
    total: int
    self: int
    children: list[_Node] = field(default_factory=list)


def flamebearer(nodes: list[tuple[int, int, str, int, int]], total: int) -> dict[str, Any]:
    """Pyroscope's FlameGraph from merged paths ``(hash, parent hash, frame, value, self)``
    (parent 0: a root frame): ``names`` (``total`` first), one ``level`` per depth of
    ``[x offset from the previous node's end, total, self, name index]`` per node, left
    to right, a node's children after its self width and sorted by name; what was left
    out below a node (beyond ``max_nodes``) is its child ``other``, as in Pyroscope."""
    root = _Node("total", total, 0)
    by_hash = {0: root}
    for h, _, name, value, self_ in nodes:
        by_hash[h] = _Node(name, value, self_)
    for h, up, _, _, _ in nodes:
        parent = by_hash.get(up)
        if parent is not None:  # always: the kept nodes form a tree
            parent.children.append(by_hash[h])
    names: list[str] = []
    index: dict[str, int] = {}
    levels: list[list[int]] = []
    ends: list[int] = []  # per level, where its last node ends
    max_self = 0
    todo = [(root, 0, 0)]  # (node, depth, x): breadth first, left to right
    while todo:
        nxt = []
        for node, depth, x in todo:
            kept = sum(c.total for c in node.children) + node.self
            node.children.sort(key=lambda c: c.name)
            if node.total > kept:
                node.children.append(_Node("other", node.total - kept, node.total - kept))
            if depth == len(levels):
                levels.append([])
                ends.append(0)
            i = index.setdefault(node.name, len(names))
            if i == len(names):
                names.append(node.name)
            levels[depth] += [x - ends[depth], node.total, node.self, i]
            ends[depth] = x + node.total
            max_self = max(max_self, node.self)
            cx = x + node.self
            for c in node.children:
                nxt.append((c, depth + 1, cx))
                cx += c.total
        todo = nxt
    return {"names": names, "levels": levels, "total": total, "max_self": max_self}


async def select_series(db: Queryable, database: str, sample_sql: str,
                        params: dict[str, Any], rng: tuple[int, int], step_ms: int,
                        group_by: list[str], limit: int, *, tenant: str
                        ) -> list[tuple[list[tuple[str, str]], list[tuple[int, int]]]]:
    """The samples' value summed per step (points at ``lo + k * step``, only where there
    are samples), one series per value of ``group_by``'s labels, by labels; with
    ``limit``, the ``limit`` series with the largest total."""
    base = f"{_rows(database, rng, params, tenant)} AND {sample_sql}"
    cols = [f"{LABELS[g]} AS g{i}" for i, g in enumerate(group_by)]
    keys = [f"g{i}" for i in range(len(group_by))]
    steps = -(-(rng[1] - rng[0]) // step_ms)
    chosen: list[tuple[str, ...]] = [()]
    hashes: list[int] = []
    keyed = f"cityHash64({', '.join(keys)}) AS hk"
    if group_by:
        n = limit if limit else MAX_SERIES + 1
        _, rows = await db.query(
            f"SELECT {', '.join(cols)}, {keyed}, sum(value) AS v {base} "
            f"GROUP BY {', '.join(keys)} ORDER BY v DESC, {', '.join(keys)} "
            "LIMIT {n:UInt32}", {**params, "n": n})
        if not limit and len(rows) > MAX_SERIES:
            raise TooMany(f"group_by: more than {MAX_SERIES} series: set limit, or narrow "
                          "the selector")
        chosen = sorted(tuple(r[:-2]) for r in rows)
        hashes = sorted({int(r[-2]) for r in rows})
    if len(chosen) * steps > MAX_POINTS:
        raise TooMany(f"step: {len(chosen)} series of {steps} steps is over {MAX_POINTS} "
                      "points: widen the step or set a lower limit")
    if not chosen:
        return []
    point = "intDiv(toUnixTimestamp64Milli(time) - {lo:Int64}, {step:Int64}) AS k"
    p = {**params, "step": step_ms}
    if group_by:
        # the chosen series only, by the hash of their labels (a collision's other series
        # is dropped below)
        _, rows = await db.query(
            f"SELECT {', '.join(cols)}, {keyed}, {point}, sum(value) {base} "
            f"AND hk IN {{hs:Array(UInt64)}} GROUP BY {', '.join(keys)}, hk, k "
            f"ORDER BY {', '.join(keys)}, k", {**p, "hs": hashes})
        rows = [(*r[:len(keys)], r[-2], r[-1]) for r in rows]
    else:
        _, rows = await db.query(f"SELECT {point}, sum(value) {base} GROUP BY k ORDER BY k", p)
    points: dict[tuple[str, ...], list[tuple[int, int]]] = {c: [] for c in chosen}
    for r in rows:
        key, k, v = tuple(r[:-2]), int(r[-2]), int(r[-1])
        if key in points:  # a hash collision's other series is not asked for
            points[key].append((rng[0] + k * step_ms, v))
    return [([(g, v) for g, v in zip(group_by, c, strict=True) if v], points[c])
            for c in chosen if points[c]]


"""``why``: what sets an operation's slowest calls apart from its typical ones (issue #21).

The operation's calls over a range are split into the *tail* (the slowest ``slowest``
fraction, or those slower than a duration) and the *typical* rest. For each group, per
call: duration, CPU (the span's own, under the chosen methods), CPU with its children of
the same service, wall time, and off-CPU (duration less CPU with children); then per
function, self CPU (and wall time, where a wall-clock profile exists) per call in each
group, ranked by how much of the tail's extra duration the difference explains; lock
wait (contention profiles) and bytes allocated per call, in all and by function, where
such profiles reached the spans; and the span attributes whose values set the tail apart
(``why_attributes``).

Answered from aggregates, not from rows call by call, so that an hour of a busy operation
answers quickly:

* ``op_calls`` (one row per call: its duration, its exact CPU) gives the calls, the tail's
  threshold and the spread of durations and CPU per call in each group;
* migration 13's ``op_tail_spans``, ``op_tail_functions`` and ``op_tail_stacks`` hold the
  CPU, functions and stacks by *duration bucket* (eight per doubling of the duration): the
  buckets above the threshold's are the tail's, those below the typical calls'. The
  threshold's own bucket holds both: its tail calls (the *boundary*, at most
  ``MAX_BOUNDARY``, by id from op_calls) are read from the base tables by their ids and
  moved from the bucket's sums to the tail's, so the tail is exactly the calls asked for
  (beyond ``MAX_BOUNDARY`` the whole bucket is the tail, and the answer says so);
* attributes are compared on the calls of the minutes holding most tail calls (at most
  ``ATTRIBUTE_MINUTES``, ``MAX_ATTRIBUTE_SPANS`` spans): tail calls against the typical
  calls of the same moments.

Every figure says how many calls it stands on; an interval is ``1.96`` standard errors of
a mean over the group's calls, and a figure on fewer than ``FEW_CALLS`` calls, or whose
interval is wider than itself, is marked ``few`` (too few to trust). The spreads of CPU
with children and of off-CPU are of the exact methods' figures (``op_calls``). Each query is
one tenant's, every table filtered by ``tenant = {tenant:String}`` (see queries.py).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from pipeline.admin.queries import TENANT, Queryable, methods_of
from pipeline.admin.why_attributes import (
    ATTRIBUTE_MINUTES,
    BUCKETS_PER_DOUBLING,
    FEW_CALLS,
    attributes,
    bucket_sql,
)

MAX_STACKS = 10_000  # stacks of a differential flame graph (the largest)
Z = 1.96  # 95%
NEGLIGIBLE = 0.001  # a function's difference below this share of a tail call's duration


def bucket_of(duration_ns: int) -> int:
    """``bucket_sql`` in Python (for tests and tools; queries use the SQL's)."""
    return 0 if duration_ns <= 0 else int(BUCKETS_PER_DOUBLING * math.log2(duration_ns))


def bucket_floor_ns(bucket: int) -> int:
    """The shortest duration of a bucket."""
    return 0 if bucket <= 0 else math.ceil(2 ** (bucket / BUCKETS_PER_DOUBLING))


# which calls are the tail: the buckets above the threshold's, and the tail calls of the
# threshold's bucket itself (ids: ``boundary``), read from op_calls' rows (``calls_sql``)
TAIL = ("(b > {b:Int32} OR (trace_id, span_id) IN "
        "arrayZip({pt:Array(String)}, {ps:Array(String)}))")
# an aggregate's row: 1 tail bucket, 0 typical bucket, 2 the threshold's bucket (typical
# but for the boundary calls, read from the base tables: BOUNDARY_CALLS)
SIDE = "multiIf(bucket > {b:Int32}, 1, bucket = {b:Int32}, 2, 0)"
IN_BOUNDARY = ("trace_id IN {pt:Array(String)} AND (trace_id, span_id) IN "
               "arrayZip({pt:Array(String)}, {ps:Array(String)})")
BOUNDARY_CALLS = 3
MAX_BOUNDARY = 20_000  # tail calls of the threshold's bucket read by id, beyond: all of it


def _split(by_side: dict[int, float]) -> tuple[float, float]:
    """(tail, typical) from an aggregate's sides and the boundary calls' own rows."""
    g = by_side.get
    mine = g(BOUNDARY_CALLS, 0)
    return g(1, 0) + mine, g(0, 0) + max(0, g(2, 0) - mine)


def _pairs(rows: list[tuple[Any, ...]]) -> dict[str, list[str]]:
    got = sorted((str(r[0]), str(r[1])) for r in rows)
    return {"pt": [t for t, _ in got], "ps": [s for _, s in got]}


def _where(cols: str = "") -> str:
    return (f"{TENANT} AND service = {{service:String}} AND operation = {{operation:String}} "
            "AND minute >= toDateTime({lo:UInt32}) AND minute < toDateTime({hi:UInt32})"
            + cols)


def _figure(total: float, calls: int, var: float | None, unit: str = "ns"
            ) -> dict[str, Any]:
    """Mean per call of ``total`` over ``calls``, with the interval a per-call variance
    ``var`` gives, and how many calls it stands on (``unit``: ns, or bytes)."""
    mean = total / calls if calls else 0.0
    half = Z * math.sqrt(max(0.0, var) / calls) if var is not None and calls > 1 else None
    few = calls < FEW_CALLS or half is None or (half > abs(mean) and mean != 0)
    return {f"per_call_{unit}": mean, f"ci_{unit}": half, "calls": calls, "few": few}


def _var(total: float, squares: float, n: int) -> float | None:
    """Sample variance of ``n`` values (absent ones zero) from their sum and sum of
    squares."""
    return (squares - total * total / n) / (n - 1) if n > 1 else None


async def why(db: Queryable, database: str, service: str, operation: str,
              rng: tuple[int, int], *, slowest: float | None = None,
              slower_than_ns: int | None = None, method: str = "exact", limit: int = 20,
              stacks: bool = False, tenant: str) -> dict[str, Any]:
    """The tail of ``service``/``operation`` over ``rng`` against its typical calls.
    ``slowest``: a fraction of the calls (0 < x <= 0.5); else ``slower_than_ns``.
    ``stacks``: with CPU per call of each stack in each group (a differential flame
    graph's data)."""
    if (slowest is None) == (slower_than_ns is None):
        raise ValueError("slowest: give either slowest or slower_than")
    methods = methods_of(method)
    p: dict[str, Any] = {"tenant": tenant, "service": service, "operation": operation,
                         "lo": rng[0], "hi": rng[1], "methods": list(methods)}
    calls_sql = (f"SELECT trace_id, span_id, any(minute) AS m, max(duration_ns) AS d, "
                 f"sum(cpu_ns) AS cpu, sum(inclusive_cpu_ns) AS incl, {bucket_sql('d')} AS b, "
                 "sum(wall_ns) AS wall, sum(lock_ns) AS lck, sum(alloc_bytes) AS alc "
                 f"FROM {database}.op_calls WHERE {_where()} GROUP BY trace_id, span_id")
    out: dict[str, Any] = {"service": service, "operation": operation, "from": rng[0],
                           "to": rng[1], "method": method, "notes": []}
    cap = MAX_BOUNDARY + 1
    # one pass over the calls: each group's sums, and the tail's fastest calls (at most
    # ``cap``: those of the threshold's bucket are the boundary)
    stats = ("count(), sum(d), varSamp(d), sum(cpu), varSamp(cpu), sum(incl), varSamp(incl), "
             "varSamp(toInt64(d) - toInt64(incl)), sum(wall), varSamp(wall), sum(lck), "
             "varSamp(lck), sum(alc), varSamp(alc), "
             # the minutes with the most calls (the tail's: where attributes are read)
             f"topK({ATTRIBUTE_MINUTES})(toUnixTimestamp(m))")
    keys = ("calls", "duration", "var_duration", "exact_cpu", "var_cpu", "exact_incl",
            "var_incl", "var_off", "exact_wall", "var_wall", "exact_lock", "var_lock",
            "exact_alloc", "var_alloc", "minutes")
    if slowest is not None:
        out["rule"] = f"slowest {slowest * 100:.4g}%"
        # the k slowest calls (k of n: the fraction asked, rounded up, at least one)
        ranked = (f"SELECT trace_id, span_id, m, d, cpu, incl, b, wall, lck, alc, "
                  "row_number() OVER (ORDER BY d DESC, trace_id, span_id) <= "
                  "least(count() OVER (), greatest(1, toUInt64(ceil(count() OVER () * "
                  f"{{frac:Float64}})))) AS tail FROM ({calls_sql})")
        rule: dict[str, Any] = {"frac": slowest}
        threshold = None  # the k-th slowest call's bucket
    else:
        out["rule"] = f"slower than {(slower_than_ns or 0) / 1e6:.6g} ms"
        ranked = f"SELECT *, d > {{thr:UInt64}} AS tail FROM ({calls_sql})"
        rule = {"thr": slower_than_ns}
        (threshold, ), = (await db.query(f"SELECT {bucket_sql('{thr:UInt64}')}",
                                         {"thr": slower_than_ns}))[1]
        threshold = int(threshold)
    groups: dict[bool, dict[str, Any]] = {}
    fastest: list[tuple[Any, ...]] = []
    for is_tail, *v, low in (await db.query(
            f"SELECT tail, {stats}, groupArraySortedIf({{cap:UInt64}})((d, b, trace_id, "
            f"span_id), tail) FROM ({ranked}) GROUP BY tail", {**p, **rule, "cap": cap}))[1]:
        groups[bool(is_tail)] = dict(zip(keys, v, strict=True))
        fastest = fastest or list(low)
    threshold_ns = slower_than_ns
    if slowest is not None and fastest:
        threshold_ns, threshold = int(fastest[0][0]), int(fastest[0][1])
    if threshold is not None and True in groups:
        boundary = [(t, sp) for _, b, t, sp in fastest if int(b) == threshold]
        p.update(b=threshold, pt=[], ps=[])
        if len(boundary) > MAX_BOUNDARY:  # the whole bucket, rather than a long list of ids
            out["notes"].append(f"the tail is cut at a duration bucket's bound: more than "
                                f"{MAX_BOUNDARY} of its calls share the threshold's bucket")
            threshold_ns = bucket_floor_ns(threshold)
            p["b"] = threshold - 1
            groups = {}
            for is_tail, *v in (await db.query(
                    f"SELECT {TAIL} AS tail, {stats} FROM ({calls_sql}) GROUP BY tail",
                    p))[1]:
                groups[bool(is_tail)] = dict(zip(keys, v, strict=True))
        else:
            p.update(_pairs(boundary))
    out["calls"] = sum(int(g["calls"]) for g in groups.values())
    out["bucket"] = threshold
    out["threshold_ns"] = threshold_ns if threshold is not None else None  # the tail's least
    if True not in groups or False not in groups:
        out.update(verdict="nothing to compare", tail=None, typical=None, functions=[],
                   wall_functions=[], lock_functions=[], alloc_functions=[],
                   attributes=[])
        out["notes"].append("no calls in the range" if not out["calls"] else
                            "every call is in the tail" if True in groups else
                            "no call is slower than that")
        return out
    tail, typ = groups[True], groups[False]
    names = ("cpu", "incl", "wall", "samples", "lock", "alloc")
    sums = ("sum(cpu_ns), sum(inclusive_cpu_ns), sum(wall_ns), sum(sample_count), "
            "sum(lock_ns), sum(alloc_bytes)")
    # the groups' sums, the functions, the attributes and the stacks: at once
    # (the store runs a few reads in parallel: ``ClickHouseExporter.READERS``)
    spans_q = db.query(
        f"SELECT {SIDE} AS side, {sums} FROM {database}.op_tail_spans "
        f"WHERE {_where(' AND method IN {methods:Array(String)}')} GROUP BY side "
        f"UNION ALL SELECT {BOUNDARY_CALLS}, {sums} FROM {database}.span_attribution FINAL "
        f"WHERE {TENANT} AND {IN_BOUNDARY} AND method IN {{methods:Array(String)}} "
        "AND span_known = 1", p)
    got, fns, out["attributes"], stack_rows = await asyncio.gather(
        spans_q, _functions(db, database, p),
        attributes(db, database, sorted(map(int, tail["minutes"])), p, limit),
        _stacks(db, database, p, int(tail["calls"]), int(typ["calls"])) if stacks
        else _none())
    got_spans = {int(side): dict(zip(names, map(int, v), strict=True))
                 for side, *v in got[1]}
    for name in names:
        t, s_ = _split({k: v.get(name, 0) for k, v in got_spans.items()})
        tail[name], typ[name] = t, s_

    def group(g: dict[str, Any]) -> dict[str, Any]:
        def spread(name: str) -> float | None:
            # op_calls' spread, where its sum is the figure's: rows written before
            # migration 15 (or other methods' figures) have none there
            if int(g[f"exact_{name}"]) != int(g.get(name, 0)):
                return None
            return float(g[f"var_{name}"]) if g.get(name, 0) else 0.0

        n = int(g["calls"])
        incl = g.get("incl", 0)
        return {"calls": n, "samples": g.get("samples", 0),
                "duration": _figure(int(g["duration"]), n, g["var_duration"]),
                "cpu": _figure(g.get("cpu", 0), n, g["var_cpu"]),
                "inclusive_cpu": _figure(incl, n, g["var_incl"]),
                "off_cpu": _figure(max(0, int(g["duration"]) - incl), n, g["var_off"]),
                "wall": _figure(g.get("wall", 0), n, spread("wall")),
                "lock": _figure(g.get("lock", 0), n, spread("lock")),
                "alloc": _figure(g.get("alloc", 0), n, spread("alloc"), "bytes")}

    out["tail"], out["typical"] = group(tail), group(typ)
    share = out["tail"]["calls"] / out["calls"]
    out["tail_share"] = share
    extra = out["tail"]["duration"]["per_call_ns"] - out["typical"]["duration"]["per_call_ns"]
    burn = out["tail"]["inclusive_cpu"]["per_call_ns"] - \
        out["typical"]["inclusive_cpu"]["per_call_ns"]
    out["extra_ns"], out["extra_cpu_ns"], out["extra_off_cpu_ns"] = extra, burn, extra - burn
    has_cpu = any(t[0] or s[0] for t, s in fns.values())
    out["verdict"] = ("not slower" if extra <= 0 else "unknown" if not has_cpu else
                      "burning" if burn >= extra / 2 else "waiting")
    if out["verdict"] == "unknown":
        out["notes"].append("no CPU profile covers these calls: burning and waiting cannot "
                            "be told apart")
    out["functions"] = _ranked(fns, tail, typ, extra, limit, CPU)
    out["wall_functions"] = _ranked(fns, tail, typ, extra, limit, WALL)
    # lock wait: the functions waiting (their share of the extra duration, as time);
    # bytes allocated per call: no share of a duration
    out["lock_functions"] = _ranked(fns, tail, typ, extra, limit, LOCK)
    out["alloc_functions"] = _ranked(fns, tail, typ, extra, limit, ALLOC)
    out["extra_lock_ns"] = out["tail"]["lock"]["per_call_ns"] - \
        out["typical"]["lock"]["per_call_ns"]
    if out["verdict"] == "waiting" and not out["wall_functions"] \
            and not out["lock_functions"]:
        out["notes"].append(
            "the tail is waiting (off-CPU), and no wall-clock or lock profile covers these "
            "spans: a CPU profile cannot say on what" + (
                "" if method == "all" else " (samples placed by thread or time, such as "
                "unlabelled lock events, count with --method all)"))
    if stacks:
        out["stacks"] = stack_rows
    return out


async def _none() -> None:
    return None


# per function: (tail, typical), each [cpu, wall, cpu squares, wall squares, rows, lock,
# bytes, lock squares, bytes squares]; a measure: (its value's index, its square's, unit)
Fns = dict[str, tuple[list[float], list[float]]]
CPU, WALL, LOCK, ALLOC = (0, 2, "ns"), (1, 3, "ns"), (5, 7, "ns"), (6, 8, "bytes")


async def _functions(db: Queryable, database: str, p: dict[str, Any]) -> Fns:
    sides: dict[str, dict[int, list[float]]] = {}
    for side, fn, *v in (await db.query(
            f"SELECT {SIDE} AS side, function, sum(self_cpu_ns), sum(self_wall_ns), "
            "sum(self_cpu_sq), sum(self_wall_sq), sum(rows), sum(self_lock_ns), "
            "sum(self_alloc_bytes), sum(self_lock_sq), sum(self_alloc_sq) "
            f"FROM {database}.op_tail_functions "
            f"WHERE {_where(' AND method IN {methods:Array(String)}')} "
            f"GROUP BY side, function UNION ALL SELECT {BOUNDARY_CALLS}, function, "
            "sum(self_cpu_ns), sum(self_wall_ns), sum(toFloat64(self_cpu_ns) * self_cpu_ns), "
            "sum(toFloat64(self_wall_ns) * self_wall_ns), count(), sum(self_lock_ns), "
            "sum(self_alloc_bytes), sum(toFloat64(self_lock_ns) * self_lock_ns), "
            "sum(toFloat64(self_alloc_bytes) * self_alloc_bytes) "
            f"FROM {database}.span_functions FINAL WHERE {TENANT} AND {IN_BOUNDARY} "
            "AND method IN {methods:Array(String)} AND span_known = 1 GROUP BY function",
            p))[1]:
        sides.setdefault(str(fn) or "[unknown stack]", {})[int(side)] = [float(x) for x in v]
    fns: Fns = {}
    for fn, by in sides.items():
        pair = [_split({k: v[i] for k, v in by.items()}) for i in range(9)]
        fns[fn] = ([t for t, _ in pair], [s for _, s in pair])
    return fns


def _ranked(fns: Fns, tail: dict[str, Any], typ: dict[str, Any], extra: float, limit: int,
            measure: tuple[int, int, str]) -> list[dict[str, Any]]:
    """Functions by their difference per call of ``measure`` (CPU, WALL, LOCK, ALLOC), the
    largest first, each with the share of the tail's extra duration it explains (time
    measures); those whose time difference is a negligible share of a tail call's
    duration (bytes: of the larger group's bytes per call) left out. Empty where no
    function has any of it."""
    i, sq, unit = measure
    nt, ns = int(tail["calls"]), int(typ["calls"])
    tail_ns = int(tail["duration"]) / max(nt, 1)
    rows = []
    for fn, (t, s) in fns.items():
        if not t[i] and not s[i]:
            continue
        a = {**_figure(t[i], nt, _var(t[i], t[sq], nt), unit), "calls_with": int(t[4])}
        b = {**_figure(s[i], ns, _var(s[i], s[sq], ns), unit), "calls_with": int(s[4])}
        delta = a[f"per_call_{unit}"] - b[f"per_call_{unit}"]
        scale = tail_ns if unit == "ns" else max(a[f"per_call_{unit}"], b[f"per_call_{unit}"])
        if abs(delta) < NEGLIGIBLE * scale:
            continue  # the same in both groups: not part of the answer
        ha, hb = a[f"ci_{unit}"], b[f"ci_{unit}"]
        ci = math.hypot(ha, hb) if ha is not None and hb is not None else None
        rows.append({"name": fn, "tail": a, "typical": b, f"delta_{unit}": delta,
                     f"ci_{unit}": ci,
                     "explains": delta / extra if extra > 0 and unit == "ns" else None,
                     "few": a["few"] or (ci is not None and ci > abs(delta))})
    rows.sort(key=lambda r: (-r[f"delta_{unit}"], r["name"]))
    return rows[:limit]


async def _stacks(db: Queryable, database: str, p: dict[str, Any], nt: int, ns: int
                  ) -> list[dict[str, Any]]:
    """CPU per call of each stack (frames root first) in the tail and in the typical
    group; the ``MAX_STACKS`` largest."""
    by: dict[int, dict[int, float]] = {}
    agg = (await db.query(
        f"SELECT {SIDE} AS side, stack_id, sum(cpu_ns) FROM {database}.op_tail_stacks "
        f"WHERE {_where(' AND method IN {methods:Array(String)}')} "
        "GROUP BY side, stack_id", p))[1]
    mine = (await db.query(
        f"SELECT {BOUNDARY_CALLS}, stack_id, sum(cpu_ns) FROM {database}.span_stacks FINAL "
        f"WHERE {TENANT} AND {IN_BOUNDARY} AND method IN {{methods:Array(String)}} "
        "AND span_known = 1 GROUP BY stack_id", p))[1] if p["pt"] else []
    for side, sid, cpu in [*agg, *mine]:
        by.setdefault(int(sid), {})[int(side)] = float(cpu)
    per = {}
    for sid, sides in by.items():
        t, s_ = _split(sides)
        per[sid] = [t / nt, s_ / max(ns, 1)]
    keep = sorted(per, key=lambda sid: (-max(per[sid]), sid))[:MAX_STACKS]
    _, rows = await db.query(
        f"SELECT stack_id, any(functions) FROM {database}.profile_stacks WHERE {TENANT} "
        "AND stack_id IN {ids:Array(UInt64)} GROUP BY stack_id", {**p, "ids": sorted(keep)})
    names = {int(sid): list(fns) for sid, fns in rows}
    return [{"frames": list(reversed(names.get(sid, ["[unknown stack]"]))),
             "tail_ns": per[sid][0], "typical_ns": per[sid][1]} for sid in sorted(keep)]

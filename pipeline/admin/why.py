"""``why``: what sets an operation's slowest calls apart from its typical ones (issue #21).

The operation's calls over a range (``op_calls``: one row per span, with its duration) are
split into the *tail* (the slowest ``slowest`` fraction, or those slower than a duration)
and the *typical* rest. For each group, per call: duration, CPU (the span's own, under the
chosen methods), CPU with its children of the same service, and off-CPU (duration less
that); then per function, self CPU (and wall time where a wall-clock profile exists) per
call in each group, ranked by how much of the tail's extra duration the difference
explains; and the span attributes whose values set the tail apart.

Where the figures come from, so that an hour of an operation answers quickly:

* the typical group's totals are the operation's totals (``op_minute``, ``fn_minute``:
  aggregates kept by materialized views) less the tail's;
* the tail is read call by call (``span_attribution_totals``, ``span_stacks``,
  ``otel_traces``, by their primary keys), at most ``MAX_TAIL`` calls, the slowest;
* spreads (the intervals) and attribute values of the typical group come from a fixed
  sample of ``TYPICAL_SAMPLE`` of its calls (chosen by a hash of the ids: the same data
  gives the same answer).

Every figure says how many calls it stands on; an interval is ``1.96`` standard errors of
a mean over calls, and a figure on fewer than ``FEW_CALLS`` calls, or whose interval is
wider than itself, is marked ``few`` (too few to trust). Each query is one tenant's, every
table filtered by ``tenant = {tenant:String}`` (see queries.py).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from pipeline.admin.queries import TENANT, Queryable, methods_of

MAX_TAIL = 20_000  # tail calls read one by one: the slowest, beyond it
TYPICAL_SAMPLE = 2_000  # typical calls read one by one, for spreads and attributes
FEW_CALLS = 5  # below: a figure is marked too few to trust
MAX_STACKS = 10_000  # stacks of a differential flame graph (the largest)
MAX_ATTRIBUTES = 200  # attribute keys compared (the most frequent)
MAX_VALUE = 200  # characters of an attribute value kept
MAX_DISTINCT_SHARE = 0.5  # a key with more distinct values than this share of calls is an id
Z = 1.96  # 95%


def _calls_where(params: dict[str, Any]) -> str:
    return (f"{TENANT} AND service = {{service:String}} AND operation = {{operation:String}} "
            "AND minute >= toDateTime({lo:UInt32}) AND minute < toDateTime({hi:UInt32})")


def _pairs(calls: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    got = sorted(calls)
    return {"pt": [t for t, _ in got], "ps": [s for _, s in got]}


class Group:
    """One group's per-call values (every call of the tail; a sample of the typical) and
    its totals (exact, over all its calls)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls  # all the group's calls
        self.read: dict[tuple[str, str], dict[str, int]] = {}  # calls read one by one
        self.totals: Counter[str] = Counter()  # over all calls
        self.functions: dict[str, Counter[str]] = {}  # function -> cpu/wall totals
        self.per_call_fn: dict[str, dict[tuple[str, str], tuple[int, int]]] = {}

    def figure(self, name: str) -> dict[str, Any]:
        values = [c.get(name, 0) for c in self.read.values()]
        return _figure(self.totals[name], self.calls, values)

    def fn_figure(self, fn: str, i: int) -> dict[str, Any]:
        per = self.per_call_fn.get(fn, {})
        values = [per.get(k, (0, 0))[i] for k in self.read]
        total = self.functions.get(fn, Counter())["cpu" if i == 0 else "wall"]
        return _figure(total, self.calls, values)


def _figure(total: int, calls: int, values: list[int]) -> dict[str, Any]:
    """Mean per call of a total over ``calls``, with the interval the per-call ``values``
    read give (their spread), and how many calls it stands on."""
    mean = total / calls if calls else 0.0
    half = None
    if len(values) >= 2 and calls:
        m = sum(values) / len(values)
        var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
        half = Z * math.sqrt(var / calls)  # the spread of the calls read, over them all
    few = calls < FEW_CALLS or half is None or (half > abs(mean) and mean != 0)
    return {"per_call_ns": mean, "ci_ns": half, "calls": calls,
            "calls_read": len(values), "few": few}


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
    calls_sql = (f"SELECT trace_id, span_id, max(duration_ns) AS d FROM {database}.op_calls "
                 f"WHERE {_calls_where(p)} GROUP BY trace_id, span_id")
    (n, sum_d), = (await db.query(f"SELECT count(), sum(d) FROM ({calls_sql})", p))[1]
    n, sum_d = int(n), int(sum_d or 0)
    out: dict[str, Any] = {"service": service, "operation": operation, "from": rng[0],
                           "to": rng[1], "method": method, "calls": n, "notes": []}
    if slowest is not None:
        k = min(n, max(1, math.ceil(n * slowest))) if n else 0
        out["rule"] = f"slowest {slowest * 100:.4g}%"
        tail_rows = (await db.query(
            f"SELECT trace_id, span_id, d FROM ({calls_sql}) "
            "ORDER BY d DESC, trace_id, span_id LIMIT {k:UInt64}",
            {**p, "k": min(k, MAX_TAIL)}))[1]
        k_all = k
    else:
        out["rule"] = f"slower than {(slower_than_ns or 0) / 1e6:.6g} ms"
        (k_all, ), = (await db.query(f"SELECT countIf(d > {{thr:UInt64}}) FROM ({calls_sql})",
                                     {**p, "thr": slower_than_ns}))[1]
        k_all = int(k_all)
        tail_rows = (await db.query(
            f"SELECT trace_id, span_id, d FROM ({calls_sql}) WHERE d > {{thr:UInt64}} "
            "ORDER BY d DESC, trace_id, span_id LIMIT {k:UInt64}",
            {**p, "thr": slower_than_ns, "k": MAX_TAIL}))[1]
    if k_all > MAX_TAIL:
        out["notes"].append(f"the tail has {k_all} calls: its {MAX_TAIL} slowest are "
                            "compared with the typical calls, the others left out")
    tail_ids = {(str(t), str(s)): int(d) for t, s, d in tail_rows}
    out["threshold_ns"] = min(tail_ids.values()) if tail_ids else None
    if not tail_ids or len(tail_ids) == n:
        out.update(verdict="nothing to compare", tail=None, typical=None, functions=[],
                   attributes=[])
        out["notes"].append("no calls in the range" if not n else
                            "every call is in the tail" if tail_ids else
                            "no call is slower than that")
        return out
    sample_rows = (await db.query(
        f"SELECT trace_id, span_id, d FROM ({calls_sql}) "
        "ORDER BY cityHash64(trace_id, span_id), trace_id, span_id LIMIT {k:UInt64}",
        {**p, "k": TYPICAL_SAMPLE + len(tail_ids)}))[1]
    sample_ids = {(str(t), str(s)): int(d) for t, s, d in sample_rows
                  if (str(t), str(s)) not in tail_ids}
    sample_ids = dict(list(sample_ids.items())[:TYPICAL_SAMPLE])
    left_out = k_all - len(tail_ids)  # tail calls beyond MAX_TAIL: in neither group
    tail, typ = Group(len(tail_ids)), Group(n - len(tail_ids) - left_out)
    for g, ids in ((tail, tail_ids), (typ, sample_ids)):
        for key, d in ids.items():
            g.read[key] = {"duration": d}
    tail.totals["duration"] = sum(tail_ids.values())
    typ.totals["duration"] = sum_d - tail.totals["duration"] - \
        (await _left_out_duration(db, calls_sql, p, tail_ids) if left_out else 0)
    if left_out:
        out["notes"].append("the typical group's CPU totals include the tail calls left out")

    await _per_call(db, database, p, tail, typ)
    await _functions(db, database, p, tail, typ)
    _typical_totals(out, tail, typ)
    for g in (tail, typ):
        for c in g.read.values():
            c["off_cpu"] = max(0, c["duration"] - c.get("inclusive_cpu", 0))
        g.totals["off_cpu"] = max(0, g.totals["duration"] - g.totals["inclusive_cpu"])

    def group(g: Group) -> dict[str, Any]:
        return {"calls": g.calls, "samples": g.totals["samples"],
                **{name: g.figure(name) for name in
                   ("duration", "cpu", "inclusive_cpu", "off_cpu", "wall")}}

    out["tail"], out["typical"] = group(tail), group(typ)
    extra = out["tail"]["duration"]["per_call_ns"] - out["typical"]["duration"]["per_call_ns"]
    burn = out["tail"]["inclusive_cpu"]["per_call_ns"] - \
        out["typical"]["inclusive_cpu"]["per_call_ns"]
    out["extra_ns"], out["extra_cpu_ns"], out["extra_off_cpu_ns"] = extra, burn, extra - burn
    out["verdict"] = ("not slower" if extra <= 0 else
                      "burning" if burn >= extra / 2 else "waiting")
    out["functions"] = _ranked(tail, typ, extra, limit, 0)
    has_wall = tail.totals["wall"] > 0 or typ.totals["wall"] > 0
    out["wall_functions"] = _ranked(tail, typ, extra, limit, 1) if has_wall else []
    if out["verdict"] == "waiting" and not has_wall:
        out["notes"].append("the tail is waiting (off-CPU), and no wall-clock profile "
                            "covers these spans: a CPU profile cannot say on what")
    out["attributes"] = await _attributes(db, database, p, tail_ids, sample_ids, limit)
    if stacks:
        out["stacks"] = await _stacks(db, database, p, tail, typ)
    return out


async def _stacks(db: Queryable, database: str, p: dict[str, Any], tail: Group,
                  typ: Group) -> list[dict[str, Any]]:
    """CPU per call of each stack (frames root first) in the tail and in the typical
    group (the operation's, op_stacks_minute, less the tail's); the ``MAX_STACKS`` largest."""
    got: dict[int, list[int]] = {}
    ids = list(tail.read)
    for i in range(0, len(ids), 10_000):
        part = ids[i:i + 10_000]
        _, rows = await db.query(
            f"SELECT stack_id, sum(cpu_ns) FROM {database}.span_stacks FINAL WHERE {TENANT} "
            "AND trace_id IN {t:Array(String)} AND method IN {methods:Array(String)} "
            "AND (trace_id, span_id) IN arrayZip({pt:Array(String)}, {ps:Array(String)}) "
            "GROUP BY stack_id", {**p, "t": sorted({t for t, _ in part}), **_pairs(part)})
        for sid, cpu in rows:
            got.setdefault(int(sid), [0, 0])[0] += int(cpu)
    _, rows = await db.query(
        f"SELECT stack_id, sum(cpu_ns) FROM {database}.op_stacks_minute "
        f"WHERE {_calls_where(p)} AND method IN {{methods:Array(String)}} GROUP BY stack_id", p)
    for sid, cpu in rows:
        got.setdefault(int(sid), [0, 0])[1] += int(cpu)
    per = {sid: (t / tail.calls, max(0, a - t) / max(typ.calls, 1))
           for sid, (t, a) in got.items()}
    keep = sorted(per, key=lambda sid: (-max(per[sid]), sid))[:MAX_STACKS]
    _, rows = await db.query(
        f"SELECT stack_id, any(functions) FROM {database}.profile_stacks WHERE {TENANT} "
        "AND stack_id IN {ids:Array(UInt64)} GROUP BY stack_id", {**p, "ids": sorted(keep)})
    names = {int(sid): list(fns) for sid, fns in rows}
    return [{"frames": list(reversed(names.get(sid, ["[unknown stack]"]))),
             "tail_ns": per[sid][0], "typical_ns": per[sid][1]} for sid in sorted(keep)]


async def _left_out_duration(db: Queryable, calls_sql: str, p: dict[str, Any],
                             tail_ids: dict[tuple[str, str], int]) -> int:
    """Duration of the tail calls beyond ``MAX_TAIL`` (in neither group)."""
    thr = min(tail_ids.values())
    (got, ), = (await db.query(
        f"SELECT sum(d) FROM ({calls_sql}) WHERE d >= {{thr:UInt64}} AND "
        "(trace_id, span_id) NOT IN arrayZip({pt:Array(String)}, {ps:Array(String)})",
        {**p, "thr": thr, **_pairs(tail_ids)}))[1]
    return int(got or 0)


async def _per_call(db: Queryable, database: str, p: dict[str, Any], tail: Group,
                    typ: Group) -> None:
    """Each call read: CPU, inclusive CPU, wall and samples under the methods; the
    operation's totals (op_minute) into ``typ`` for now (``_typical_totals`` takes the
    tail's out)."""
    ids = list(tail.read) + list(typ.read)
    for i in range(0, len(ids), 10_000):
        part = ids[i:i + 10_000]
        _, rows = await db.query(
            f"SELECT trace_id, span_id, sum(cpu_ns), sum(inclusive_cpu_ns), sum(wall_ns), "
            f"sum(sample_count) FROM {database}.span_attribution_totals WHERE {TENANT} "
            "AND trace_id IN {t:Array(String)} AND method IN {methods:Array(String)} "
            "AND (trace_id, span_id) IN arrayZip({pt:Array(String)}, {ps:Array(String)}) "
            "GROUP BY trace_id, span_id",
            {**p, "t": sorted({t for t, _ in part}), **_pairs(part)})
        for t, s, cpu, incl, wall, samples in rows:
            key = (str(t), str(s))
            for g in (tail, typ):
                if key in g.read:
                    g.read[key].update(cpu=int(cpu), inclusive_cpu=int(incl), wall=int(wall),
                                       samples=int(samples))
    for c in tail.read.values():
        for name in ("cpu", "inclusive_cpu", "wall", "samples"):
            tail.totals[name] += c.get(name, 0)
    _, rows = await db.query(
        f"SELECT sum(cpu_ns), sum(inclusive_cpu_ns), sum(wall_ns), sum(sample_count) "
        f"FROM {database}.op_minute WHERE {_calls_where(p)} "
        "AND method IN {methods:Array(String)}", p)
    cpu, incl, wall, samples = (int(x or 0) for x in rows[0])
    typ.totals.update(cpu=cpu, inclusive_cpu=incl, wall=wall, samples=samples)


async def _functions(db: Queryable, database: str, p: dict[str, Any], tail: Group,
                     typ: Group) -> None:
    """Self CPU and wall per function (the stacks' leaves): per call read, and the
    operation's totals (fn_minute) into ``typ`` for now."""
    ids = list(tail.read) + list(typ.read)
    for i in range(0, len(ids), 10_000):
        part = ids[i:i + 10_000]
        _, rows = await db.query(f"""
SELECT x.trace_id, x.span_id, f.leaf, sum(x.cpu), sum(x.wall) FROM (
    SELECT trace_id, span_id, stack_id, sum(cpu_ns) AS cpu, sum(wall_ns) AS wall
    FROM {database}.span_stacks FINAL WHERE {TENANT} AND trace_id IN {{t:Array(String)}}
      AND method IN {{methods:Array(String)}}
      AND (trace_id, span_id) IN arrayZip({{pt:Array(String)}}, {{ps:Array(String)}})
    GROUP BY trace_id, span_id, stack_id) AS x
LEFT JOIN (SELECT stack_id, any(functions[1]) AS leaf FROM {database}.profile_stacks
           WHERE {TENANT} GROUP BY stack_id) AS f ON f.stack_id = x.stack_id
GROUP BY x.trace_id, x.span_id, f.leaf""", {**p, "t": sorted({t for t, _ in part}),
                                            **_pairs(part)})
        for t, s, fn, cpu, wall in rows:
            key, name = (str(t), str(s)), str(fn) or "[unknown stack]"
            for g in (tail, typ):
                if key in g.read:
                    g.per_call_fn.setdefault(name, {})[key] = (int(cpu), int(wall))
    for fn, per in tail.per_call_fn.items():
        c = tail.functions.setdefault(fn, Counter())
        for cpu, wall in per.values():
            c["cpu"] += cpu
            c["wall"] += wall
    _, rows = await db.query(
        f"SELECT function, sum(self_cpu_ns), sum(self_wall_ns) FROM {database}.fn_minute "
        f"WHERE {_calls_where(p)} AND method IN {{methods:Array(String)}} GROUP BY function",
        p)
    for fn, cpu, wall in rows:
        typ.functions[str(fn) or "[unknown stack]"] = Counter(cpu=int(cpu), wall=int(wall))


def _typical_totals(out: dict[str, Any], tail: Group, typ: Group) -> None:
    """The typical group's totals: the operation's less the tail's (never below zero: the
    aggregates are merged in the background, a row may not be counted in them yet)."""
    short = False
    for name in ("cpu", "inclusive_cpu", "wall", "samples"):
        typ.totals[name] -= tail.totals[name]
        short |= typ.totals[name] < 0
        typ.totals[name] = max(0, typ.totals[name])
    for fn, c in tail.functions.items():
        t = typ.functions.setdefault(fn, Counter())
        for k in ("cpu", "wall"):
            t[k] -= c[k]
            short |= t[k] < 0
            t[k] = max(0, t[k])
    if short:
        out["notes"].append("the operation's aggregates hold less than its calls' rows "
                            "(rows written while the question was asked?)")


def _ranked(tail: Group, typ: Group, extra: float, limit: int, i: int
            ) -> list[dict[str, Any]]:
    """Functions by their difference per call (CPU: ``i`` 0, wall: 1), the largest first,
    each with the share of the tail's extra duration it explains."""
    rows = []
    for fn in set(tail.functions) | set(typ.functions):
        a, b = tail.fn_figure(fn, i), typ.fn_figure(fn, i)
        if not a["per_call_ns"] and not b["per_call_ns"]:
            continue
        delta = a["per_call_ns"] - b["per_call_ns"]
        ha, hb = a["ci_ns"], b["ci_ns"]
        ci = math.hypot(ha, hb) if ha is not None and hb is not None else None
        rows.append({"name": fn, "tail": a, "typical": b, "delta_ns": delta, "ci_ns": ci,
                     "explains": delta / extra if extra > 0 else None,
                     "few": a["few"] or (ci is not None and ci > abs(delta))})
    rows.sort(key=lambda r: (-r["delta_ns"], r["name"]))
    return rows[:limit]


async def _attributes(db: Queryable, database: str, p: dict[str, Any],
                      tail_ids: dict[tuple[str, str], int],
                      sample_ids: dict[tuple[str, str], int], limit: int
                      ) -> list[dict[str, Any]]:
    """The span and resource attributes whose values set the tail apart: for a numeric
    key, how far apart the two groups' values lie (``separation``: |2 AUC - 1|, 1 when
    every tail value is above every typical one); for another, the total variation
    distance of the two groups' value shares. Keys holding ids are left out."""
    values: dict[str, tuple[list[str], list[str]]] = {}
    ids = list(tail_ids) + list(sample_ids)
    counts: Counter[str] = Counter()
    for i in range(0, len(ids), 10_000):
        part = ids[i:i + 10_000]
        _, rows = await db.query(
            f"SELECT TraceId, SpanId, any(SpanAttributes), any(ResourceAttributes) "
            f"FROM {database}.otel_traces WHERE {TENANT} AND ServiceName = {{service:String}} "
            "AND SpanName = {operation:String} AND Timestamp >= toDateTime({lo:UInt32}) "
            "AND Timestamp < toDateTime({hi:UInt32}) + 60 "
            "AND (TraceId, SpanId) IN arrayZip({pt:Array(String)}, {ps:Array(String)}) "
            "GROUP BY TraceId, SpanId", {**p, **_pairs(part)})
        for t, s, attrs, res in rows:
            key = (str(t), str(s))
            side = 0 if key in tail_ids else 1
            merged = {**{f"resource.{k}": v for k, v in dict(res).items()}, **dict(attrs)}
            for k, v in merged.items():
                counts[k] += 1
                values.setdefault(k, ([], []))[side].append(str(v)[:MAX_VALUE])
    keep = [k for k, _ in counts.most_common(MAX_ATTRIBUTES)]
    n_t, n_s = len(tail_ids), len(sample_ids)
    out: list[dict[str, Any]] = []
    for k in keep:
        t_vals, s_vals = values[k]
        nums_t, nums_s = _numbers(t_vals), _numbers(s_vals)
        if nums_t is not None and nums_s is not None and nums_t and nums_s:
            sep = abs(2 * _auc(nums_t, nums_s) - 1)
            out.append({"key": k, "kind": "numeric", "separation": sep,
                        "tail": {"mean": sum(nums_t) / len(nums_t), "calls": len(nums_t)},
                        "typical": {"mean": sum(nums_s) / len(nums_s), "calls": len(nums_s)},
                        "few": len(nums_t) < FEW_CALLS})
            continue
        distinct = len(set(t_vals) | set(s_vals))
        if distinct > MAX_DISTINCT_SHARE * (len(t_vals) + len(s_vals)) and distinct > 10:
            continue  # an id: every call its own value
        ct, cs = Counter(t_vals), Counter(s_vals)
        ct["(absent)"] = n_t - len(t_vals)
        cs["(absent)"] = n_s - len(s_vals)
        tv = 0.5 * sum(abs(ct[v] / max(n_t, 1) - cs[v] / max(n_s, 1)) for v in ct | cs)
        top = max(ct | cs, key=lambda v: (ct[v] / max(n_t, 1) - cs[v] / max(n_s, 1), v))
        out.append({"key": k, "kind": "values", "separation": tv, "value": top,
                    "tail": {"share": ct[top] / max(n_t, 1), "calls": n_t},
                    "typical": {"share": cs[top] / max(n_s, 1), "calls": n_s},
                    "few": n_t < FEW_CALLS})
    out.sort(key=lambda a: (-float(a["separation"]), str(a["key"])))
    return out[:limit]


def _numbers(vals: list[str]) -> list[float] | None:
    got = []
    for v in vals:
        try:
            x = float(v)
        except ValueError:
            return None
        if not math.isfinite(x):
            return None
        got.append(x)
    return got


def _auc(a: list[float], b: list[float]) -> float:
    """P(x > y) + P(x = y) / 2 for x from ``a``, y from ``b``."""
    bs = sorted(b)
    total = 0.0
    for x in a:
        lo, hi = bisect.bisect_left(bs, x), bisect.bisect_right(bs, x)
        total += lo + (hi - lo) / 2
    return total / (len(a) * len(bs))

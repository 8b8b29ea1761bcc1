"""``why``'s attributes: the span and resource attributes whose values set an operation's
tail apart from its typical calls (issue #21), compared on the calls of the minutes
holding most tail calls (see ``why``)."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Any

from pipeline.admin.queries import TENANT, Queryable

ATTRIBUTE_MINUTES = 10  # minutes read for attributes: those with the most tail calls
MAX_ATTRIBUTE_SPANS = 20_000  # spans read for attributes
MAX_ATTRIBUTES = 200  # attribute keys compared (the most frequent)
MAX_VALUE = 200  # characters of an attribute value kept
MIN_SEPARATION = 0.05  # attributes that set the groups apart less are not listed
MAX_DISTINCT_SHARE = 0.5  # a key with more distinct values than this share of calls is an id
FEW_CALLS = 5  # below: a figure is marked too few to trust (as why's)


BUCKETS_PER_DOUBLING = 8


def bucket_sql(col: str) -> str:
    """A duration's bucket, as migration 13's views compute it."""
    return f"toUInt16(if({col} = 0, 0, floor({BUCKETS_PER_DOUBLING} * log2({col}))))"


async def attributes(db: Queryable, database: str, minutes: list[int], p: dict[str, Any],
                      limit: int) -> list[dict[str, Any]]:
    """The span and resource attributes whose values set the tail apart, compared on the
    calls of the minutes with the most tail calls: for a numeric key, how far apart the
    two groups' values lie (``separation``: |2 AUC - 1|, 1 when every tail value is above
    every typical one); for another, the total variation distance of the two groups'
    value shares. Keys holding ids (a value per call) are left out."""
    if not minutes:
        return []
    ranges = " OR ".join(f"(Timestamp >= toDateTime({{m{i}:UInt32}}) AND "
                         f"Timestamp < toDateTime({{m{i}:UInt32}}) + 60)"
                         for i in range(len(minutes)))
    _, rows = await db.query(
        f"SELECT {bucket_sql('Duration')} > {{b:Int32}} OR (TraceId, SpanId) IN "
        "arrayZip({pt:Array(String)}, {ps:Array(String)}), SpanAttributes, "
        f"ResourceAttributes FROM {database}.otel_traces WHERE {TENANT} "
        "AND ServiceName = {service:String} AND SpanName = {operation:String} "
        f"AND ({ranges}) LIMIT 1 BY TraceId, SpanId LIMIT {{n:UInt32}}",
        {**p, **{f"m{i}": m for i, m in enumerate(minutes)}, "n": MAX_ATTRIBUTE_SPANS})
    values: dict[str, tuple[list[str], list[str]]] = {}
    counts: Counter[str] = Counter()
    sizes = [0, 0]
    for is_tail, attrs, res in rows:
        side = 0 if is_tail else 1
        sizes[side] += 1
        merged = {**{f"resource.{k}": v for k, v in dict(res).items()}, **dict(attrs)}
        for k, v in merged.items():
            counts[k] += 1
            values.setdefault(k, ([], []))[side].append(str(v)[:MAX_VALUE])
    n_t, n_s = sizes
    if not n_t or not n_s:
        return []
    out: list[dict[str, Any]] = []
    for k, _ in counts.most_common(MAX_ATTRIBUTES):
        t_vals, s_vals = values[k]
        nums_t, nums_s = _numbers(t_vals), _numbers(s_vals)
        if nums_t is not None and nums_s is not None and nums_t and nums_s:
            out.append({"key": k, "kind": "numeric",
                        "separation": abs(2 * _auc(nums_t, nums_s) - 1),
                        "tail": {"mean": sum(nums_t) / len(nums_t), "calls": len(nums_t)},
                        "typical": {"mean": sum(nums_s) / len(nums_s), "calls": len(nums_s)},
                        "few": len(nums_t) < FEW_CALLS})
            continue
        distinct = len(set(t_vals) | set(s_vals))
        if distinct > MAX_DISTINCT_SHARE * (len(t_vals) + len(s_vals)) and distinct > 10:
            continue  # an id: every call its own value
        ct, cs = Counter(t_vals), Counter(s_vals)
        ct["(absent)"], cs["(absent)"] = n_t - len(t_vals), n_s - len(s_vals)
        # in integers, one division: shares added as floats made 0.9999999999999999 of
        # groups wholly apart (every tail call one value no typical call has)
        tv = sum(abs(ct[v] * n_s - cs[v] * n_t) for v in ct | cs) / (2 * n_t * n_s)
        top = max(ct | cs, key=lambda v: (ct[v] / n_t - cs[v] / n_s, v))
        out.append({"key": k, "kind": "values", "separation": tv, "value": top,
                    "tail": {"share": ct[top] / n_t, "calls": n_t},
                    "typical": {"share": cs[top] / n_s, "calls": n_s},
                    "few": n_t < FEW_CALLS})
    out = [a for a in out if a["separation"] >= MIN_SEPARATION]
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

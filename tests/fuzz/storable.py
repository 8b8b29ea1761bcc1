"""Can a decoder's output be stored? One checker, with every range derived from the schema.

Records go through ``rows.py`` (exactly what the exporter inserts), and each column value is
checked against the type the schema's DDL gives that column. Times are held to the
``DateTime`` range on top of their own type: span and sample times are also turned into
``DateTime`` columns (materialized views, the correlator's ``minute`` columns, TTLs), which
the engine would silently wrap, not refuse. Sums a request adds up must fit ``Int64``
(``span_attribution_totals`` takes ``toInt64`` of them).

``test_engine.py`` inserts accepted outputs into the real engine: the checker is not
looser than ClickHouse.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from pipeline.exporters.clickhouse import rows
from pipeline.exporters.clickhouse.migrate import render
from pipeline.exporters.clickhouse.schema import SchemaOptions
from pipeline.records import ProfileBatch, SpanBatch

INT_RANGES = {"UInt8": (0, 2**8 - 1), "UInt32": (0, 2**32 - 1), "UInt64": (0, 2**64 - 1),
              "Int64": (-(2**63), 2**63 - 1)}
DATETIME_NS = (0, (2**32 - 1) * 10**9)  # DateTime: UInt32 seconds, to 2106-02-07
DATETIME64_NS = (-(2**63), 2**63 - 1)  # DateTime64(9): Int64 ns
TIME_COLUMNS = {("otel_traces", "Timestamp"), ("otel_traces", "Events.Timestamp"),
                ("profile_samples", "time")}
ID_HEX_LENGTHS = {("otel_traces", "TraceId"): (32,), ("otel_traces", "SpanId"): (16,),
                  ("otel_traces", "ParentSpanId"): (0, 16),
                  ("otel_traces", "Links.TraceId"): (0, 32),
                  ("otel_traces", "Links.SpanId"): (0, 16),
                  ("profile_samples", "trace_id"): (0, 32),
                  ("profile_samples", "span_id"): (0, 16)}

_COLUMN = re.compile(r"^\s+(?:ADD COLUMN IF NOT EXISTS )?(\w+) ([A-Z]\w*\(?.*)$")


@cache
def column_types() -> dict[str, dict[str, str]]:
    """table -> column -> type, from the DDL the migrations run (Nested as Array(...))."""
    ddl = render(SchemaOptions(ttl_seconds=0))
    out: dict[str, dict[str, str]] = {}
    for table in rows.COLUMNS:
        cols: dict[str, str] = {}
        # NAME__new: a table rebuilt under another key (migration 11), then renamed NAME
        for m in re.finditer(rf"(?:CREATE TABLE IF NOT EXISTS|ALTER TABLE) \w+\.{table}"
                             r"(?:__new)?\s"
                             r"(?:\((.*?)\n\) ENGINE|(.*?);)", ddl, re.S):
            body = m[1] or m[2]
            nested = None
            for line in body.splitlines():
                if n := re.match(r"^\s+(\w+) Nested \($", line):
                    nested = n[1]
                    continue
                if nested and line.strip().startswith(")"):
                    nested = None
                    continue
                c = _COLUMN.match(line)
                if c is None or c[1] in ("INDEX", "ADD"):
                    continue
                typ = _balance(c[2])
                if nested:
                    cols[f"{nested}.{c[1]}"] = f"Array({typ})"
                else:
                    cols[c[1]] = typ
        out[table] = cols
    return out


def _balance(t: str) -> str:
    """The type at the start of ``t``: up to the first space or comma outside brackets."""
    depth = 0
    for i, ch in enumerate(t):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and ch in " ,":
            return t[:i]
    return t


def _check(v: Any, typ: str, where: str, time_col: bool) -> str | None:
    if typ.startswith("LowCardinality("):
        typ = typ[len("LowCardinality("):-1]
    if typ.startswith("Array("):
        if not isinstance(v, list):
            return f"{where}: {v!r} is not a list"
        inner = typ[len("Array("):-1]
        for x in v:
            if p := _check(x, inner, where, time_col):
                return p
        return None
    if typ.startswith("Map("):
        if not isinstance(v, dict):
            return f"{where}: {v!r} is not a dict"
        for k, x in v.items():
            if (p := _check(k, "String", where, False)) or (p := _check(x, "String", where,
                                                                           False)):
                return p
        return None
    if typ == "String":
        if not isinstance(v, str):
            return f"{where}: {v!r} is not a str"
        try:
            v.encode()
        except UnicodeEncodeError:
            return f"{where}: {v!r} is not valid UTF-8"
        return None
    if typ.startswith("DateTime64"):
        lo, hi = DATETIME_NS if time_col else DATETIME64_NS
    elif typ in INT_RANGES:
        lo, hi = INT_RANGES[typ]
    else:
        raise AssertionError(f"storable.py knows no column type {typ} ({where})")
    if type(v) is not int:
        return f"{where}: {v!r} is not an int"
    if not lo <= v <= hi:
        return f"{where}: {v} is outside {typ} [{lo}, {hi}]"
    return None


def problems(tables: dict[str, dict[str, list[object]]]) -> list[str]:
    """Every value of ``rows.py`` output that its column cannot hold."""
    types = column_types()
    out = []
    for table, cols in tables.items():
        for col, values in cols.items():
            typ = types[table].get(col)
            assert typ is not None, f"{table}.{col} is not in the schema"
            time_col = (table, col) in TIME_COLUMNS
            lengths = ID_HEX_LENGTHS.get((table, col))
            for i, v in enumerate(values):
                if p := _check(v, typ, f"{table}.{col}[{i}]", time_col):
                    out.append(p)
                    break
                if lengths and any(len(x) not in lengths for x in
                                   (v if isinstance(v, list) else [v])):  # type: ignore
                    out.append(f"{table}.{col}[{i}]: id {v!r} has the wrong length")
                    break
    return out


def storable(batch: SpanBatch | ProfileBatch) -> list[str]:
    """[] when every record can be stored, else what cannot."""
    if isinstance(batch, SpanBatch):
        found = problems(rows.traces(batch))
        for s in batch.spans:
            if s.end_ns < s.start_ns or not DATETIME_NS[0] <= s.end_ns <= DATETIME_NS[1]:
                found.append(f"span end {s.end_ns} (start {s.start_ns}) out of range")
                break
        return found
    found = problems(rows.profiles(batch))
    missing = {s.stack_id for s in batch.samples} - set(batch.stacks)
    if missing:
        found.append(f"samples reference stacks not in the batch: {sorted(missing)[:3]}")
    total = sum(s.value for s in batch.samples)
    if total > INT_RANGES["Int64"][1]:
        found.append(f"values add up to {total}, over Int64")
    return found

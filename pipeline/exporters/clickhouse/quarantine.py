"""Rows ClickHouse refuses for their values, kept where an operator can read them.

A row is quarantined as JSON text (``quarantine.row``): every value made printable, so that
the quarantine row itself can always be encoded whatever made the original fail (a number
beyond UInt64, a lone surrogate, bytes). ``json.dumps`` escapes non-ASCII, so the text is
ASCII; integers stay exact (JSON has no bound on them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pipeline.exporters.clickhouse.rows import COLUMNS, Columns
from pipeline.records import DEFAULT_TENANT

TABLE = "quarantine"
# time: DEFAULT now64(3)
QUARANTINE_COLUMNS = ["tenant", "component", "table", "reason", "row"]
# what a log line may show of a row (field values can be anything a client sent)
LOG_PREFIX = 80


@dataclass(frozen=True)
class BadRow:
    """One row a block was split down to, and why ClickHouse refused it."""

    table: str
    row: str  # JSON
    reason: str
    tenant: str = DEFAULT_TENANT  # the row's own: an operator reads a tenant's refusals


def printable(value: object) -> object:
    """``value`` as something ``json.dumps`` writes: containers recursively, bytes as hex,
    non-finite floats and anything else as their ``repr``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [printable(v) for v in value]
    return repr(value)


def row_json(table: str, cols: Columns, i: int = 0) -> str:
    """Row ``i`` of a column block as a JSON object, in the table's column order."""
    return json.dumps({c: printable(cols[c][i]) for c in COLUMNS[table] if c in cols},
                      ensure_ascii=True, separators=(",", ":"))


def tenant_of(cols: Columns, i: int = 0) -> str:
    """Row ``i``'s tenant (every table's rows carry one; the default for a block without)."""
    tenants = cols.get("tenant")
    return str(tenants[i]) if tenants else DEFAULT_TENANT


def columns(component: str, bad: list[BadRow]) -> Columns:
    """The quarantine table's insert block for these rows."""
    return {"tenant": [b.tenant for b in bad],
            "component": [component] * len(bad), "table": [b.table for b in bad],
            "reason": [b.reason for b in bad], "row": [b.row for b in bad]}


def row_count(cols: Columns) -> int:
    return len(next(iter(cols.values()), []))


def halves(cols: Columns) -> tuple[Columns, Columns]:
    """A block cut in two at the middle (the same cut every time: the halves' tokens are
    derived from the block's, so a retried split inserts nothing twice)."""
    mid = row_count(cols) // 2
    return ({c: v[:mid] for c, v in cols.items()}, {c: v[mid:] for c, v in cols.items()})

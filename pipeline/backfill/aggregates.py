"""Rebuilding the aggregate tables for one tenant's minutes from the rows they are made of.

op_minute, op_calls, fn_minute, op_stacks_minute and the op_tail_* tables (by call
duration) are filled by materialized views as rows are inserted into span_attribution,
span_functions, span_stacks and otel_traces (migrations 4, 10, 11, 13). A view adds what
is inserted and never sees a DELETE: once a backfill has replaced attribution rows
(``reattribute``: DELETE, then insert), the aggregates hold the old rows and the new.
``rebuild`` makes them again for a tenant and a range of minutes: per aggregate, a
lightweight DELETE of the tenant's minutes, then, for each view feeding it, an INSERT of
that view's SELECT over the base tables as they are now, kept to the same tenant and
minutes. The result is what the views would have made had the current rows been inserted
once.

What is re-run is each view's own SELECT, read from the migrations (``VIEWS``, the newest
definition of each), so a view changed by a later migration is rebuilt as it now
aggregates. Two changes to it:

* span_attribution, span_functions and span_stacks are read FINAL: one row per key (a row
  written twice under the same key, say a Kafka block redelivered cut differently, is one
  row of the table, whatever its view added). otel_traces is not: what its views keep of a
  span (its ids in a set, a max duration, zeros) is the same for a span stored once or
  twice, as the live views kept it, and FINAL would merge on read the largest table.
* the view's rows are filtered by its own ``tenant`` and ``minute`` outside its SELECT (the
  filter is on grouping keys: ClickHouse pushes it down to the read). ``minute`` is each
  view's: ``toStartOfMinute(start_time)`` (the span's start) of span_attribution,
  ``toStartOfMinute(Timestamp)`` of otel_traces, the ``minute`` column of span_functions and
  span_stacks (its span's start minute, ``rows.attributions``). The DELETE filters the same
  column of the aggregate, so a minute is rebuilt whole or left alone, whether the bounds
  are minute-aligned or not.

Killed at any point and run again, it ends as one uninterrupted run does: each run deletes
whatever an earlier one left in the range (nothing, part of a view's rows, all of them)
before inserting. An INSERT must then never be dropped as a repeat of an earlier run's:
the aggregates keep a deduplication window (migration 6), and ClickHouse deduplicates an
INSERT SELECT's blocks by their contents (older servers; 26.x when the SELECT is ordered)
or by its token (26.x, whatever the SELECT). Each run inserts under tokens of its own.
``insert_deduplicate = 0`` would not do: 26.x's ``deduplicate_insert`` overrides it.

Not atomic: between the DELETEs (all made at once, then waited for together: one by one,
each waited for the merges of the parts it rewrites) and the INSERTs a reader sees the
range without its rows. And a row inserted into a base table for these minutes while
they are rebuilt (after the DELETE, before the INSERT has read) reaches the aggregate
twice, through its view and the rebuild: rebuild minutes the live pipeline no longer
writes (a backfill's, past the correlator's grace), or rebuild again.

On a cluster schema (``cluster:``, ``cluster.on_cluster``) it refuses with a ConfigError:
there the aggregates are Distributed tables over per-shard local tables, the DELETE must be
``ON CLUSTER`` on the local tables, and neither that path nor the deduplication of
inserts forwarded to Replicated tables has been run here (no cluster in the tests).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any, NamedTuple

from pipeline.errors import ConfigError
from pipeline.exporters.clickhouse.schema import MIGRATIONS
from pipeline.registry import Store

# each aggregate's columns, in its CREATE TABLE's order (migration 11); every view feeding
# it yields them all, by name: the INSERT names them, as a view's insert matches by name
AGGREGATES = {
    "op_minute": ["tenant", "service", "operation", "method", "minute", "cpu_ns",
                  "inclusive_cpu_ns", "wall_ns", "sample_count", "calls"],
    "op_calls": ["tenant", "service", "operation", "minute", "trace_id", "span_id", "cpu_ns",
                 "inclusive_cpu_ns", "duration_ns",
                 "wall_ns", "lock_ns", "alloc_bytes"],  # migration 15
    "fn_minute": ["tenant", "service", "operation", "minute", "function", "method",
                  "self_cpu_ns", "self_wall_ns"],
    "op_stacks_minute": ["tenant", "service", "operation", "minute", "stack_id", "method",
                         "cpu_ns", "wall_ns"],
    # migration 13: by call duration (spanprof why)
    "op_tail_spans": ["tenant", "service", "operation", "minute", "bucket", "method", "cpu_ns",
                      "inclusive_cpu_ns", "wall_ns", "sample_count",
                      "lock_ns", "alloc_bytes"],  # migration 14
    "op_tail_functions": ["tenant", "service", "operation", "minute", "bucket", "function",
                          "method", "self_cpu_ns", "self_wall_ns", "self_cpu_sq",
                          "self_wall_sq", "rows",
                          # migration 14
                          "self_lock_ns", "self_alloc_bytes", "self_lock_sq", "self_alloc_sq"],
    "op_tail_stacks": ["tenant", "service", "operation", "minute", "bucket", "stack_id",
                       "method", "cpu_ns", "wall_ns"],
}
# base tables read FINAL (see the module's docstring)
REPLACED = ("span_attribution", "span_functions", "span_stacks")
# the tenant and minutes rebuilt: a view's output rows, an aggregate's stored rows
RANGE = ("tenant = {tenant:String} AND minute >= toDateTime({lo:UInt32}) "
         "AND minute < toDateTime({hi:UInt32})")


class View(NamedTuple):
    name: str
    target: str
    select: str  # as the migration wrote it: ``{db}`` for the database


_CREATE_MV = re.compile(r"CREATE MATERIALIZED VIEW IF NOT EXISTS \{db\}\.(\w+)\s+"
                        r"TO \{db\}\.(\w+) AS\s+(SELECT\b.*)", re.S)
_DROP_VIEW = re.compile(r"DROP VIEW IF EXISTS \{db\}\.(\w+)")
_FROM = re.compile(r"\bFROM \{db\}\.(\w+)\b")


def _views() -> tuple[View, ...]:
    """The views into the aggregates as the migrations leave them, in the order they were
    made: a DROP removes a view, a CREATE ... IF NOT EXISTS makes one only where none is.
    A view this module cannot re-run stops its import (a new view reading two tables, or
    none of the base tables, needs a look here first)."""
    views: dict[str, View] = {}
    for migration in MIGRATIONS:
        for s in migration.statements:
            if m := _DROP_VIEW.fullmatch(s.sql):
                views.pop(m[1], None)
            elif (m := _CREATE_MV.fullmatch(s.sql)) and m[2] in AGGREGATES:
                views.setdefault(m[1], View(m[1], m[2], m[3]))
    for v in views.values():
        sources = _FROM.findall(v.select)
        if len(sources) != 1 or sources[0] not in (*REPLACED, "otel_traces"):
            raise ValueError(f"aggregates: view {v.name} reads {sources}: expected one of "
                             f"{', '.join(REPLACED)}, otel_traces")
    return tuple(views.values())


VIEWS = _views()


def plan(database: str, tenant: str, lo_s: int, hi_s: int) -> list[tuple[str, dict[str, Any]]]:
    """The statements of one run, in the order they must run, with their parameters: every
    aggregate's DELETE, then an INSERT per view feeding each (under this run's token).
    ``rebuild`` waits for the DELETEs between the two."""
    run = uuid.uuid4().hex
    p = {"tenant": tenant, "lo": lo_s, "hi": hi_s}
    # not waited for one at a time (lightweight_deletes_sync = 0): each waited about 1 s
    # for background merges of a store just written; ``rebuild`` waits for all of them
    # before any INSERT, so a DELETE that cannot be done fails the run before anything is
    # added (an INSERT after a stuck DELETE would double the range)
    out: list[tuple[str, dict[str, Any]]] = [
        (f"DELETE FROM {database}.{table} WHERE {RANGE} "
         "SETTINGS lightweight_deletes_sync = 0", p) for table in AGGREGATES]
    for table, columns in AGGREGATES.items():
        names = ", ".join(columns)
        for v in (v for v in VIEWS if v.target == table):
            select = _FROM.sub(lambda m: m[0] + (" FINAL" if m[1] in REPLACED else ""),
                               v.select).replace("{db}", database)
            out.append((f"INSERT INTO {database}.{table} ({names})\n"
                        "SETTINGS insert_deduplication_token = {token:String}\n"
                        f"SELECT {names} FROM (\n{select}\n) WHERE {RANGE}",
                        {**p, "token": f"spanprof-rebuild/{run}/{v.name}"}))
    return out


async def rebuild(store: Store, tenant: str, lo_s: int, hi_s: int) -> None:
    """Make the aggregates of ``tenant`` for the minutes ``lo_s <= minute < hi_s`` (unix
    seconds) again from the base tables' current rows; other tenants and minutes are left
    as they are. Safe to run again after a kill anywhere; ConfigError on a cluster schema."""
    _, distributed = await store.query(
        "SELECT name FROM system.tables WHERE database = {db:String} "
        "AND name IN {names:Array(String)} AND engine = 'Distributed'",
        {"db": store.database, "names": list(AGGREGATES)})
    if distributed:
        raise ConfigError(f"cluster: the aggregates cannot be rebuilt on a cluster schema yet "
                          f"({store.database}.{distributed[0][0]} is a Distributed table; "
                          "its rows must be deleted from each shard's local table)")
    steps = plan(store.database, tenant, lo_s, hi_s)
    deletes = len(AGGREGATES)  # the plan's first statements
    for sql, parameters in steps[:deletes]:
        await store.command(sql, parameters)
    await mutations_done(store, list(AGGREGATES))
    for sql, parameters in steps[deletes:]:
        await store.command(sql, parameters)


async def _pending(store: Store, tables: list[str]) -> list[tuple[str, str, str]]:
    _, rows = await store.query(
        "SELECT table, mutation_id, latest_fail_reason FROM system.mutations "
        "WHERE database = {db:String} AND table IN {names:Array(String)} AND NOT is_done",
        {"db": store.database, "names": tables})
    return [(str(t), str(m), str(r)) for t, m, r in rows]


async def mutations_done(store: Store, tables: list[str], timeout_s: float = 600.0,
                         poll_s: float = 0.02) -> None:
    """Return once the mutations of ``tables`` not done when called are done (this run's
    DELETEs, and any before them, which a part applies first; not those other runs make
    meanwhile); RuntimeError naming the table and ClickHouse's reason if one is still not
    done after ``timeout_s`` (ClickHouse retries a failed mutation itself)."""
    deadline = time.monotonic() + timeout_s
    mine = {(t, m) for t, m, _ in await _pending(store, tables)}
    while True:
        rows = [r for r in await _pending(store, tables) if (r[0], r[1]) in mine]
        if not rows:
            return
        if time.monotonic() >= deadline:
            table, mutation, reason = rows[0]
            raise RuntimeError(f"aggregates: {len(rows)} DELETE mutations not done after "
                               f"{timeout_s:.0f} s ({store.database}.{table} {mutation}"
                               f"{': ' + reason if reason else ''})")
        await asyncio.sleep(poll_s)
        poll_s = min(poll_s * 2, 1.0)

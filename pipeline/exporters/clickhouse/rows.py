"""Records -> column lists per table (column-oriented inserts: no per-row tuples).

Every row carries its batch's tenant (``tenant``, first in every table's ordering key since
migration 11): a batch is always of one tenant.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from pipeline.records import AttributionBatch, ProfileBatch, SpanBatch

Columns = dict[str, list[object]]
# a stack as profile_stacks keys it: the same id in two tenants is two rows
StackKey = tuple[str, int]

# pdata's SpanKind.String() / StatusCode.String(), as the Collector exporter writes them
SPAN_KINDS = ["Unspecified", "Internal", "Server", "Client", "Producer", "Consumer"]
STATUS_CODES = ["Unset", "Ok", "Error"]
KIND_NAMES = dict(enumerate(SPAN_KINDS))  # any other value: "Unspecified"
STATUS_NAMES = dict(enumerate(STATUS_CODES))  # any other value: "Unset"

TRACES_COLUMNS = [
    "tenant", "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName",
    "SpanKind", "ServiceName", "ResourceAttributes", "ScopeName", "ScopeVersion",
    "SpanAttributes", "Duration", "StatusCode", "StatusMessage", "Events.Timestamp",
    "Events.Name", "Events.Attributes", "Links.TraceId", "Links.SpanId", "Links.TraceState",
    "Links.Attributes", "request",
]
SAMPLES_COLUMNS = ["tenant", "time", "service", "trace_id", "span_id", "stack_id", "measure",
                   "sample_type", "unit", "value", "count", "thread_id", "thread_name",
                   "span_name", "pid", "host", "timed", "request"]
STACKS_COLUMNS = ["tenant", "stack_id", "functions", "files", "lines"]
ATTRIBUTION_COLUMNS = ["tenant", "trace_id", "span_id", "method", "source", "service", "name",
                       "parent_span_id", "start_time", "duration_ns", "span_known", "cpu_ns",
                       "wall_ns", "sample_count", "inclusive_cpu_ns", "lock_ns", "alloc_bytes"]
FUNCTIONS_COLUMNS = ["tenant", "trace_id", "span_id", "method", "function", "source",
                     "self_cpu_ns", "self_wall_ns", "service", "operation", "minute",
                     "span_known", "duration_ns", "self_lock_ns", "self_alloc_bytes"]
SPAN_STACKS_COLUMNS = ["tenant", "trace_id", "span_id", "method", "stack_id", "source",
                       "service", "operation", "minute", "span_known", "cpu_ns", "wall_ns",
                       "duration_ns"]
UNATTRIBUTED_COLUMNS = ["tenant", "service", "minute", "source", "cpu_ns", "wall_ns",
                        "sample_count"]

COLUMNS = {
    "otel_traces": TRACES_COLUMNS,
    "profile_stacks": STACKS_COLUMNS,
    "profile_samples": SAMPLES_COLUMNS,
    "span_attribution": ATTRIBUTION_COLUMNS,
    "span_functions": FUNCTIONS_COLUMNS,
    "span_stacks": SPAN_STACKS_COLUMNS,
    "unattributed_cpu": UNATTRIBUTED_COLUMNS,
}

# Nested columns an insert leaves out when every row's is empty: ClickHouse fills them with
# their default, the same empty arrays, and the driver's Python loop over every row of
# each (7 columns, 3-4 us a span; most spans have no events, nearly none links) is skipped
NESTED_GROUPS = {
    "otel_traces": (("Events.Timestamp", "Events.Name", "Events.Attributes"),
                    ("Links.TraceId", "Links.SpanId", "Links.TraceState", "Links.Attributes")),
}


def insert_columns(table: str, cols: Columns) -> list[str]:
    """The columns to insert of ``cols`` (all of ``table``'s): ``COLUMNS[table]`` but the
    nested groups empty in every row."""
    names = COLUMNS[table]
    groups = NESTED_GROUPS.get(table)
    if not groups:
        return names
    left = {c for group in groups if not any(cols[group[0]]) for c in group}
    return [c for c in names if c not in left] if left else names


def extend(into: dict[str, Columns], tables: dict[str, Columns]) -> None:
    """Append the rows of ``tables`` to ``into``, table by table (the columns are copied
    the first time a table is seen, so the batches given are never changed)."""
    for table, cols in tables.items():
        mine = into.get(table)
        if mine is None:
            into[table] = {c: list(v) for c, v in cols.items()}
        else:
            for c, v in cols.items():
                mine[c].extend(v)


def _request_ids(runs: list[tuple[int, int]], n: int) -> list[object]:
    """One request id per row, from the batch's runs (0 where the batch names none)."""
    if not runs:
        return [0] * n
    out: list[object] = []
    for rid, count in runs:
        out.extend([rid] * count)
    return out if len(out) == n else [0] * n  # runs that do not add up are not trusted


def traces(batch: SpanBatch) -> dict[str, Columns]:
    spans = batch.spans
    kinds, statuses = KIND_NAMES, STATUS_NAMES
    # most spans have no events nor links: their seven nested columns are then [] each,
    # without a comprehension per span and column
    events = [s.events for s in spans]
    links = [s.links for s in spans]
    cols: Columns = {
        "tenant": [batch.tenant] * len(spans),
        "Timestamp": [s.start_ns for s in spans],
        "TraceId": [s.trace_id.hex() for s in spans],
        "SpanId": [s.span_id.hex() for s in spans],
        "ParentSpanId": [s.parent_span_id.hex() for s in spans],
        "TraceState": [s.trace_state for s in spans],
        "SpanName": [s.name for s in spans],
        "SpanKind": [kinds.get(s.kind, "Unspecified") for s in spans],
        "ServiceName": [s.service for s in spans],
        "ResourceAttributes": [s.resource_attributes for s in spans],
        "ScopeName": [s.scope_name for s in spans],
        "ScopeVersion": [s.scope_version for s in spans],
        "SpanAttributes": [s.attributes for s in spans],
        "Duration": [s.duration_ns for s in spans],
        "StatusCode": [statuses.get(s.status_code, "Unset") for s in spans],
        "StatusMessage": [s.status_message for s in spans],
        "Events.Timestamp": [[e.time_ns for e in es] if es else [] for es in events],
        "Events.Name": [[e.name for e in es] if es else [] for es in events],
        "Events.Attributes": [[e.attributes for e in es] if es else [] for es in events],
        "Links.TraceId": [[lk.trace_id.hex() for lk in ls] if ls else [] for ls in links],
        "Links.SpanId": [[lk.span_id.hex() for lk in ls] if ls else [] for ls in links],
        "Links.TraceState": [[lk.trace_state for lk in ls] if ls else [] for ls in links],
        "Links.Attributes": [[lk.attributes for lk in ls] if ls else [] for ls in links],
        "request": _request_ids(batch.requests, len(spans)),
    }
    return {"otel_traces": cols}


def profiles(batch: ProfileBatch, skip_stacks: set[int] | frozenset[int] = frozenset()
             ) -> dict[str, Columns]:
    """The batch's samples, and those of its stacks not in ``skip_stacks`` (ids of this
    batch's tenant already written)."""
    ss = batch.samples
    out: dict[str, Columns] = {"profile_samples": {
        "tenant": [batch.tenant] * len(ss),
        "time": [s.time_ns for s in ss],
        "service": [s.service for s in ss],
        "trace_id": [s.trace_id.hex() for s in ss],
        "span_id": [s.span_id.hex() for s in ss],
        "stack_id": [s.stack_id for s in ss],
        "measure": [s.measure for s in ss],
        "sample_type": [s.sample_type for s in ss],
        "unit": [s.unit for s in ss],
        "value": [s.value for s in ss],
        "count": [s.count for s in ss],
        "thread_id": [s.thread_id for s in ss],
        "thread_name": [s.thread_name for s in ss],
        "span_name": [s.span_name for s in ss],
        "pid": [s.pid for s in ss],
        "host": [s.host for s in ss],
        "timed": [int(s.timed) for s in ss],
        "request": _request_ids(batch.requests, len(ss)),
    }}
    stacks = [st for sid, st in batch.stacks.items() if sid not in skip_stacks]
    if stacks:
        out["profile_stacks"] = {
            "tenant": [batch.tenant] * len(stacks),
            "stack_id": [st.stack_id for st in stacks],
            "functions": [st.functions for st in stacks],
            "files": [st.files for st in stacks],
            "lines": [st.lines for st in stacks],
        }
    return out


# spans turned into rows at a time: the exporter lets the event loop run between two
# slices of a large batch (the correlator's reports), about 3 ms each
SLICE = 1000


def attribution_slices(batch: AttributionBatch) -> Iterator[dict[str, Columns]]:
    """``attributions(batch)`` in parts of ``SLICE`` spans (the unattributed CPU with the
    first): their rows, in order, are the whole batch's."""
    items = batch.attributions
    for lo in range(0, max(1, len(items)), SLICE):
        yield attributions(msgspec.structs.replace(
            batch, attributions=items[lo:lo + SLICE],
            unattributed=batch.unattributed if lo == 0 else []))


def _at(col: list[Any], index: list[int]) -> list[Any]:
    """``col``'s values at ``index``: a span's value repeated on each of its rows."""
    return list(map(col.__getitem__, index))


def attributions(batch: AttributionBatch) -> dict[str, Columns]:
    """A span's row, its rows per function (``span_functions``) and per stack
    (``span_stacks``) where it has CPU or wall time, lock wait or allocations there.

    Built column by column: the values a span's function and stack rows repeat (ids,
    service, operation, minute...) are gathered by the index of their span in one C-level
    pass per column, not copied into a tuple per row (half the time: the exporter builds
    these on the event loop, for every span the correlator reports)."""
    rows = batch.attributions
    tenant = batch.tenant
    out: dict[str, Columns] = {}
    if rows:
        tids: list[Any] = [a.trace_id.hex() for a in rows]
        sids: list[Any] = [a.span_id.hex() for a in rows]
        methods: list[Any] = [a.method for a in rows]
        sources: list[Any] = [a.source for a in rows]
        services: list[Any] = [a.service for a in rows]
        operations: list[Any] = [a.name for a in rows]
        starts: list[Any] = [a.start_ns for a in rows]
        durations: list[Any] = [a.duration_ns for a in rows]
        known: list[Any] = [int(a.span_known) for a in rows]
        out["span_attribution"] = {
            "tenant": [tenant] * len(rows),
            "trace_id": tids,
            "span_id": sids,
            "method": methods,
            "source": sources,
            "service": services,
            "name": operations,
            "parent_span_id": [a.parent_span_id.hex() for a in rows],
            "start_time": starts,
            "duration_ns": durations,
            "span_known": known,
            "cpu_ns": [a.cpu_ns for a in rows],
            "wall_ns": [a.wall_ns for a in rows],
            "sample_count": [a.sample_count for a in rows],
            "inclusive_cpu_ns": [a.inclusive_cpu_ns for a in rows],
            "lock_ns": [a.lock_ns for a in rows],
            "alloc_bytes": [a.alloc_bytes for a in rows],
        }
        # per function / stack row: the index of its span, and its own values
        f_at: list[int] = []
        f_name: list[Any] = []
        f_cpu: list[Any] = []
        f_wall: list[Any] = []
        f_lock: list[Any] = []
        f_alloc: list[Any] = []
        s_at: list[int] = []
        s_id: list[Any] = []
        s_cpu: list[Any] = []
        s_wall: list[Any] = []
        for i, a in enumerate(rows):
            sc, sw, sl, sa = a.self_cpu_ns, a.self_wall_ns, a.self_lock_ns, a.self_alloc_bytes
            # one row per function (most spans have one or two), CPU only the usual case
            if sw or sl or sa:
                fns = sc.keys() | sw.keys() | sl.keys() | sa.keys()
                f_at += [i] * len(fns)
                f_name += fns
                f_cpu += [sc.get(k, 0) for k in fns]
                f_wall += [sw.get(k, 0) for k in fns]
                f_lock += [sl.get(k, 0) for k in fns]
                f_alloc += [sa.get(k, 0) for k in fns]
            elif sc:
                zeros = [0] * len(sc)
                f_at += [i] * len(sc)
                f_name += sc
                f_cpu += sc.values()
                f_wall += zeros
                f_lock += zeros
                f_alloc += zeros
            kc, kw = a.stack_cpu_ns, a.stack_wall_ns
            if kw:
                stacks = kc.keys() | kw.keys()
                s_at += [i] * len(stacks)
                s_id += stacks
                s_cpu += [kc.get(k, 0) for k in stacks]
                s_wall += [kw.get(k, 0) for k in stacks]
            elif kc:
                s_at += [i] * len(kc)
                s_id += kc
                s_cpu += kc.values()
                s_wall += [0] * len(kc)
        minutes = [s // 1_000_000_000 // 60 * 60 for s in starts] if f_at or s_at else []

        def per_row(index: list[int], own: Columns, columns: list[str]) -> Columns:
            """A table's columns: the row's own values, and its span's repeated on it."""
            span: Columns = {
                "tenant": [tenant] * len(index), "trace_id": _at(tids, index),
                "span_id": _at(sids, index), "method": _at(methods, index),
                "source": _at(sources, index), "service": _at(services, index),
                "operation": _at(operations, index), "minute": _at(minutes, index),
                "span_known": _at(known, index),  # the span's (migration 13)
                "duration_ns": _at(durations, index)}
            return {c: own[c] if c in own else span[c] for c in columns}

        if f_at:
            out["span_functions"] = per_row(f_at, {
                "function": f_name, "self_cpu_ns": f_cpu, "self_wall_ns": f_wall,
                "self_lock_ns": f_lock, "self_alloc_bytes": f_alloc}, FUNCTIONS_COLUMNS)
        if s_at:
            out["span_stacks"] = per_row(s_at, {
                "stack_id": s_id, "cpu_ns": s_cpu, "wall_ns": s_wall}, SPAN_STACKS_COLUMNS)
    if batch.unattributed:
        u = batch.unattributed
        out["unattributed_cpu"] = {
            "tenant": [tenant] * len(u),
            "service": [x.service for x in u],
            "minute": [x.minute_ns // 1_000_000_000 for x in u],
            "source": [x.source for x in u],
            "cpu_ns": [x.cpu_ns for x in u],
            "wall_ns": [x.wall_ns for x in u],
            "sample_count": [x.sample_count for x in u],
        }
    return out

"""Records -> column lists per table (column-oriented inserts: no per-row tuples).

Every row carries its batch's tenant (``tenant``, first in every table's ordering key since
migration 11): a batch is always of one tenant.
"""

from __future__ import annotations

from pipeline.records import AttributionBatch, ProfileBatch, SpanBatch

Columns = dict[str, list[object]]
# a stack as profile_stacks keys it: the same id in two tenants is two rows
StackKey = tuple[str, int]

# pdata's SpanKind.String() / StatusCode.String(), as the Collector exporter writes them
SPAN_KINDS = ["Unspecified", "Internal", "Server", "Client", "Producer", "Consumer"]
STATUS_CODES = ["Unset", "Ok", "Error"]

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


def _columns(names: list[str], rows: list[tuple[object, ...]]) -> Columns:
    """Rows (tuples in ``names``' order) -> columns."""
    return {name: list(col) for name, col in zip(names, zip(*rows, strict=True), strict=True)}


def _kind(k: int) -> str:
    return SPAN_KINDS[k] if 0 <= k < len(SPAN_KINDS) else "Unspecified"


def _status(c: int) -> str:
    return STATUS_CODES[c] if 0 <= c < len(STATUS_CODES) else "Unset"


def traces(batch: SpanBatch) -> dict[str, Columns]:
    spans = batch.spans
    cols: Columns = {
        "tenant": [batch.tenant] * len(spans),
        "Timestamp": [s.start_ns for s in spans],
        "TraceId": [s.trace_id.hex() for s in spans],
        "SpanId": [s.span_id.hex() for s in spans],
        "ParentSpanId": [s.parent_span_id.hex() for s in spans],
        "TraceState": [s.trace_state for s in spans],
        "SpanName": [s.name for s in spans],
        "SpanKind": [_kind(s.kind) for s in spans],
        "ServiceName": [s.service for s in spans],
        "ResourceAttributes": [s.resource_attributes for s in spans],
        "ScopeName": [s.scope_name for s in spans],
        "ScopeVersion": [s.scope_version for s in spans],
        "SpanAttributes": [s.attributes for s in spans],
        "Duration": [s.duration_ns for s in spans],
        "StatusCode": [_status(s.status_code) for s in spans],
        "StatusMessage": [s.status_message for s in spans],
        "Events.Timestamp": [[e.time_ns for e in s.events] for s in spans],
        "Events.Name": [[e.name for e in s.events] for s in spans],
        "Events.Attributes": [[e.attributes for e in s.events] for s in spans],
        "Links.TraceId": [[lk.trace_id.hex() for lk in s.links] for s in spans],
        "Links.SpanId": [[lk.span_id.hex() for lk in s.links] for s in spans],
        "Links.TraceState": [[lk.trace_state for lk in s.links] for s in spans],
        "Links.Attributes": [[lk.attributes for lk in s.links] for s in spans],
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


def attributions(batch: AttributionBatch) -> dict[str, Columns]:
    rows = batch.attributions
    tenant = batch.tenant
    out: dict[str, Columns] = {}
    if rows:
        out["span_attribution"] = {
            "tenant": [tenant] * len(rows),
            "trace_id": [a.trace_id.hex() for a in rows],
            "span_id": [a.span_id.hex() for a in rows],
            "method": [a.method for a in rows],
            "source": [a.source for a in rows],
            "service": [a.service for a in rows],
            "name": [a.name for a in rows],
            "parent_span_id": [a.parent_span_id.hex() for a in rows],
            "start_time": [a.start_ns for a in rows],
            "duration_ns": [a.duration_ns for a in rows],
            "span_known": [int(a.span_known) for a in rows],
            "cpu_ns": [a.cpu_ns for a in rows],
            "wall_ns": [a.wall_ns for a in rows],
            "sample_count": [a.sample_count for a in rows],
            "inclusive_cpu_ns": [a.inclusive_cpu_ns for a in rows],
            "lock_ns": [a.lock_ns for a in rows],
            "alloc_bytes": [a.alloc_bytes for a in rows],
        }
        fn: list[tuple[object, ...]] = []
        sk: list[tuple[object, ...]] = []
        for a in rows:
            sc, sw, kc, kw = a.self_cpu_ns, a.self_wall_ns, a.stack_cpu_ns, a.stack_wall_ns
            sl, sa = a.self_lock_ns, a.self_alloc_bytes
            if not (sc or sw or kc or kw or sl or sa):
                continue
            tid, sid, method, source = a.trace_id.hex(), a.span_id.hex(), a.method, a.source
            svc, op = a.service, a.name
            minute = a.start_ns // 1_000_000_000 // 60 * 60
            known, dur = int(a.span_known), a.duration_ns  # the span's (migration 13)
            # one row per function / stack, its CPU and wall time (most spans have only one)
            if not (sw or sl or sa):
                fn.extend((tenant, tid, sid, method, name, source, v, 0, svc, op, minute, known,
                           dur, 0, 0) for name, v in sc.items())
            else:
                fn.extend((tenant, tid, sid, method, name, source, sc.get(name, 0), sw.get(name, 0),
                           svc, op, minute, known, dur, sl.get(name, 0), sa.get(name, 0))
                          for name in sc.keys() | sw.keys() | sl.keys() | sa.keys())
            if not kw:
                sk.extend((tenant, tid, sid, method, st, source, svc, op, minute, known, v, 0,
                           dur) for st, v in kc.items())
            else:
                sk.extend((tenant, tid, sid, method, st, source, svc, op, minute, known,
                           kc.get(st, 0), kw.get(st, 0), dur) for st in kc.keys() | kw.keys())
        if fn:
            out["span_functions"] = _columns(FUNCTIONS_COLUMNS, fn)
        if sk:
            out["span_stacks"] = _columns(SPAN_STACKS_COLUMNS, sk)
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

"""Crash recovery of the correlator: reconcile what it held in memory with the stored rows.

The exporters store a batch before the correlator sees it (``pipeline.component.Fanout``),
so an acknowledged batch is always in ``otel_traces`` / ``profile_samples``; what a SIGKILL
loses is only the correlator's progress: spans and samples held for their windows, and
reports not yet sent. The connector keeps a checkpoint (``correlator_checkpoint``): the
arrival of the oldest input it still held unreported (``held_since``). On start, every
trace with a raw row stored since then (less ``margin``) may have lost attribution; for
each, its spans and samples are read back (all of them, whatever their ingest time), run
through a fresh ``CorrelatorState`` to get the rows the correlator would have written, and
only the difference to what ``span_attribution`` already holds is written:

    delta = expected - stored   (per span, method and field; never negative)

so running it twice adds nothing the second time (``reconcile``, with the cap that keeps
a sample placed differently from being counted twice).

Unlabelled samples (no span id) are placed by process, thread and time among every span
of their service (``thread`` / ``window``) or counted in ``unattributed_cpu``; they are
reconciled per service (``recover_unlabelled``): the whole minutes around the unlabelled
samples stored since the checkpoint, every span of the service open in them and every
unlabelled sample in them are replayed, and the difference is written for those spans'
approximate rows and the service's minutes, capped per service as above (expected total
less stored total). A span that reaches beyond those minutes has stored CPU from samples
outside them, which only lowers that cap: such an edge may stay short, never counted
twice. A service with too many spans or unlabelled samples in the window (``readback``) is
skipped and counted in the log line, as are samples labelled with a span id alone whose
span was never stored.

Recovery is per tenant (issue #17): a trace is a (tenant, trace id) pair and a service a
(tenant, service) pair, replayed with that tenant's rows only and reconciled with that
tenant's stored rows; every batch sent names its tenant, so the rows it writes are that
tenant's.

The pure computation is in ``reconcile``; the SQL that reads raw and stored rows in
``readback``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from pipeline.records import AttributionBatch, Unattributed
from pipeline.registry import Store
from processors.correlate.accumulators import LABELLED_METHODS
from processors.correlate.messages import random_source
from processors.correlate.readback import affected, load, load_unlabelled, unlabelled_services
from processors.correlate.reconcile import APPROX_METHODS, UNATTRIBUTED, deltas, expected

# Raw rows stored at most this long before the correlator received them: the exporter's
# insert (batched for its flush_interval, then the insert itself), ClickHouse's now() in
# whole seconds, and a server clock a little off ours. 2 x the correlator's flush_interval
# is added for the flush that follows placing a timed sample (windows: oldest_held).
MARGIN_S = 10.0
CHUNK_TRACES = 500  # traces read, replayed and reconciled at a time
SEND_ROWS = 2_000  # rows per batch sent on (as the connector's outbox)


@dataclass
class Result:
    traces: int = 0
    rows: int = 0
    cpu_ns: int = 0
    skipped_traces: int = 0  # beyond MAX_TRACES
    services: int = 0  # whose unlabelled samples were reconciled
    skipped_services: int = 0  # beyond MAX_SERVICE_SPANS / MAX_SERVICE_SAMPLES


async def read_checkpoint(store: Store, component: str) -> float | None:
    """``held_since`` of this correlator's newest checkpoint (unix seconds), if any."""
    _, rows = await store.query(
        f"SELECT toUnixTimestamp(argMax(held_since, updated)) FROM "
        f"{store.database}.correlator_checkpoint WHERE component = {{c:String}} "
        f"GROUP BY component", {"c": component})
    return float(rows[0][0]) if rows else None


async def write_checkpoint(store: Store, component: str, held_since: float) -> None:
    now = time.time()
    await store.insert("correlator_checkpoint",
                       [[component, datetime.fromtimestamp(held_since, tz=UTC),
                         datetime.fromtimestamp(now, tz=UTC), datetime.fromtimestamp(now, tz=UTC)]],
                       ["component", "held_since", "alive_at", "updated"])


async def recover_unlabelled(store: Store, since: float,
                             send: Callable[[AttributionBatch], Awaitable[None]],
                             res: Result) -> None:
    """Reconcile the unlabelled samples stored since ``since``, service by service of each
    tenant."""
    for tenant, service, lo, hi in await unlabelled_services(store, since):
        got = await load_unlabelled(store, tenant, service, lo, hi)
        if got is None:
            res.skipped_services += 1
            continue
        spans, samples, stacks, stored = got
        rows = deltas(expected(spans, samples, stacks), stored, APPROX_METHODS,
                      per_trace=False)
        spans_rows = [r for r in rows if r.method != UNATTRIBUTED]
        minutes = [Unattributed(service, int.from_bytes(r.span_id, "big"), r.cpu_ns, r.wall_ns,
                                r.sample_count, random_source())
                   for r in rows if r.method == UNATTRIBUTED]
        for j in range(0, max(len(spans_rows), 1), SEND_ROWS):
            batch = AttributionBatch(spans_rows[j:j + SEND_ROWS], minutes if j == 0 else [],
                                     tenant=tenant)
            if len(batch):
                await send(batch)
        res.services += 1
        res.rows += len(rows)
        res.cpu_ns += sum(r.cpu_ns for r in rows)


async def recover(store: Store, since: float,
                  send: Callable[[AttributionBatch], Awaitable[None]]) -> Result:
    """Reconcile every trace with a raw row stored since ``since`` (unix seconds), then
    the unlabelled samples stored since then; each batch of delta rows is durable when
    ``send`` returns."""
    res = Result()
    traces, res.skipped_traces = await affected(store, since)
    by_tenant: dict[str, list[str]] = {}
    for tenant, trace in traces:
        by_tenant.setdefault(tenant, []).append(trace)
    for tenant, ids in sorted(by_tenant.items()):
        for i in range(0, len(ids), CHUNK_TRACES):
            chunk = sorted(ids[i:i + CHUNK_TRACES])
            spans, samples, stacks, stored = await load(store, tenant, chunk)
            rows = deltas(expected(spans, samples, stacks), stored, LABELLED_METHODS)
            for j in range(0, len(rows), SEND_ROWS):
                await send(AttributionBatch(rows[j:j + SEND_ROWS], tenant=tenant))
            res.traces += len(chunk)
            res.rows += len(rows)
            res.cpu_ns += sum(r.cpu_ns for r in rows)
    await recover_unlabelled(store, since, send, res)
    return res

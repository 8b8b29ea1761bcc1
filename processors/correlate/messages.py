"""The Kafka tier's attribution: the rows of each message, as a pure function of it.

Behind Kafka, a batch is a block of messages and the correlator holds nothing: each
message's rows are computed from the message alone (``attribute_message``) under its own
``source`` (``source_id`` of "topic/partition/offset"), so that a redelivered message yields
the same rows and ClickHouse keeps them once. A bounded ``SpanLookup`` of the spans seen in
earlier messages names the span of a sample's row where it can. Rows that summarise the
in-memory state of ``CorrelatorState`` instead take a fresh ``random_source``: they must
never be deduplicated away.
"""

from __future__ import annotations

import os
import random

from pipeline.records import (
    ATTRIBUTED,
    Attribution,
    AttributionBatch,
    ProfileBatch,
    SpanBatch,
    Unattributed,
)
from processors.correlate.accumulators import LINK, MINUTE_NS, Key, M, add, attribution, leaf_of
from processors.correlate.spans import SpanInfo


def source_id(origin: str) -> int:
    """Deterministic 63-bit id of a Kafka message ("topic/partition/offset")."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(origin.encode(), digest_size=8).digest(),
                          "little") >> 1


# seeded once from the system's randomness: a row's id then costs no system call (one per
# row was 3.5% of the event loop's time at 10 k spans/s, the call releasing the GIL to the
# writer's thread and waiting to get it back); 63 random bits per id, as before
_ids = random.Random(os.urandom(32))
# a forked child would otherwise draw the parent's sequence: the same ids twice, rows that a
# ReplacingMergeTree then collapses (the random module reseeds only its own instance)
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def random_source() -> int:
    """A fresh id for a row that summarises in-memory state (never deduplicated away)."""
    return _ids.getrandbits(63)


def attribute_block(batch: SpanBatch | ProfileBatch,
                    spans: SpanLookup | None = None) -> AttributionBatch:
    """The rows of a Kafka block: each message's rows (``attribute_message``, under the
    message's own ``source``), as one batch named by the block, so that the exporter
    inserts them as one deduplicated block, under the block's tenant."""
    rows: list[Attribution] = []
    unattributed: list[Unattributed] = []
    parts = batch.parts or [(batch.origin, len(batch))]
    at = 0
    for origin, n in parts:
        if isinstance(batch, SpanBatch):
            piece: SpanBatch | ProfileBatch = SpanBatch(batch.spans[at:at + n])
        else:
            piece = ProfileBatch(batch.samples[at:at + n], batch.stacks)
        at += n
        got = attribute_message(piece, source_id(origin), spans)
        rows.extend(got.attributions)
        unattributed.extend(got.unattributed)
    return AttributionBatch(rows, unattributed, origin=batch.origin, tenant=batch.tenant)


SpanLookup = dict[bytes, tuple[bytes, "SpanInfo"]]  # span id -> (trace id, span)


def span_lookup_add(lookup: SpanLookup, batch: SpanBatch, bound: int) -> None:
    """Remember the spans of a message (bounded, oldest forgotten first), so that sample
    rows of later messages can name their span's operation and time."""
    for s in batch.spans:
        lookup.pop(s.span_id, None)
        lookup[s.span_id] = (s.trace_id, SpanInfo(s.service, s.name, s.parent_span_id,
                                                  s.start_ns, s.duration_ns))
    while len(lookup) > bound:
        del lookup[next(iter(lookup))]


def attribute_message(batch: SpanBatch | ProfileBatch, source: int,
                      spans: SpanLookup | None = None) -> AttributionBatch:
    """The attribution rows one message contributes, as a pure function of the message.

    The Kafka tier writes these before committing the message's offset. A worker that dies
    before the commit leaves the message to be read again, by itself or by whichever worker
    takes the partition, and the redelivered message yields the very same rows (same
    ``source``), which ClickHouse's ReplacingMergeTree keeps once: exactly one contribution
    per (span, message), whatever crashed where. A span's totals are the sum over messages.
    """
    if isinstance(batch, SpanBatch):
        return AttributionBatch([])  # a span's name and duration are in otel_traces
    accs: dict[Key, M] = {}
    unlinked: dict[tuple[str, int], M] = {}
    services: dict[Key, str] = {}
    for smp in batch.samples:
        if smp.measure not in ATTRIBUTED:
            continue
        if not smp.span_id:
            ukey = (smp.service, smp.time_ns - smp.time_ns % MINUTE_NS)
            um = unlinked.get(ukey) or unlinked.setdefault(ukey, M())
            add(um, smp.measure, smp.value, smp.count, None)
            continue
        key = (smp.trace_id, smp.span_id)
        m = accs.get(key)
        if m is None:
            m = accs[key] = M()
            services[key] = smp.service
        add(m, smp.measure, smp.value, smp.count, leaf_of(batch, smp), smp.stack_id)
    rows = []
    for k, m in accs.items():
        # a span this worker has seen (same partition, usually earlier) gives the row its
        # operation and time, so its CPU reaches the per-operation aggregates. The row
        # stays the same on redelivery as far as ClickHouse is concerned: the message's
        # insert_deduplication_token drops the second block whatever it holds.
        # Only rows that carry their trace: a span-only row keeps trace '' whatever this
        # worker knows, so that a redelivery to another worker writes the very same key
        # (trace_id, span_id, method, source) and ReplacingMergeTree keeps one copy.
        known = spans.get(k[1]) if spans is not None and k[0] else None
        if known is not None and known[0] == k[0]:
            tid, info = known
            rows.append(attribution(tid, k[1], LINK, info.service, info.name,
                                    info.parent_span_id, info.start_ns, info.duration_ns,
                                    True, m, source))
        else:
            rows.append(attribution(k[0], k[1], LINK, services[k], "", b"", 0, 0, False, m,
                                    source))
    return AttributionBatch(
        rows,
        [Unattributed(svc, minute, m.cpu_ns, m.wall_ns, m.count, source)
         for (svc, minute), m in unlinked.items()])

"""The ``kafka`` receiver's data path, from fetched messages to the batches it sends on.

Each fetched message becomes a block ``Entry`` (its OTLP request decoded into records, or
no batch when it is not valid OTLP or holds nothing), a block's entries are merged into one
batch named by the block's token, and a round's batches are grouped into waves the
exporter's bounded queue can hold. No consumer and no state here: the receiver
(``kafka.py``) owns the consumer group, the plans, the waiting and the commits; the blocks
themselves are cut in ``pipeline.kafka.blocks``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.auth import tenant_from_header
from pipeline.errors import InvalidData
from pipeline.kafka import TENANT_HEADER
from pipeline.kafka.blocks import Block, Entry
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.records import DEFAULT_TENANT, ProfileBatch, SpanBatch, concat

Batch = SpanBatch | ProfileBatch


def decode(signal: str, topic: str, value: bytes | None, metrics: Counter[str],
           log: Any) -> SpanBatch | ProfileBatch | None:
    """One message's records; a message that is not valid OTLP (a tombstone, with no value
    at all, included) is logged, counted in ``metrics`` and skipped (None), items the
    decoder refused are counted."""
    if value is None:
        metrics["malformed_messages"] += 1
        log.warning("kafka_message_malformed", topic=topic, error="no value (a tombstone)")
        return None
    try:
        if signal == "traces":
            d: Any = decode_traces(tps.ExportTraceServiceRequest.FromString(value))
        else:
            d = decode_profiles(pps.ExportProfilesServiceRequest.FromString(value))
    except DecodeError as err:
        metrics["malformed_messages"] += 1
        log.warning("kafka_message_malformed", topic=topic, error=str(err))
        return None
    if d.rejected:
        metrics[f"refused_{'spans' if signal == 'traces' else 'profiles'}"] += d.rejected
        log.info("kafka_items_rejected", topic=topic, rejected=d.rejected,
                 reason=d.message[:300])
    return d.batch  # type: ignore[no-any-return]


def tenant_of(rec: Any) -> str | None:
    """The tenant the record's ``tenant`` header names (``default`` without one, as a
    producer before tenants wrote), or None when it names none validly."""
    found = [v for k, v in rec.headers or () if k == TENANT_HEADER]
    if not found:
        return DEFAULT_TENANT
    value = found[0]
    if len(found) > 1 or not isinstance(value, bytes) or not value.isascii():
        return None
    try:  # the rule X-Scope-OrgID is held to
        return tenant_from_header(value.decode("ascii"))
    except InvalidData:
        return None


def to_entry(signal: str, topic: str, rec: Any, metrics: Counter[str], log: Any) -> Entry:
    """A fetched record as a block entry; one without items (malformed, empty, or naming
    no valid tenant) keeps its place in the block, with no batch."""
    tenant = tenant_of(rec)
    batch = None
    if tenant is None:
        metrics["malformed_messages"] += 1
        log.warning("kafka_message_malformed", topic=topic, offset=rec.offset,
                    error="its tenant header is not one tenant name")
    else:
        batch = decode(signal, topic, rec.value, metrics, log)
        if batch is not None:
            batch.tenant = tenant
    if batch is not None and not len(batch):
        batch = None
    return Entry(rec.offset, rec.value, batch, len(batch) if batch is not None else 0,
                 rec.timestamp)


def merge_block(block: Block, signal: str) -> list[SpanBatch | ProfileBatch]:
    """The messages of one block as one batch per tenant, named by the block's token (the
    default tenant's) or the token and the tenant (another's: a deduplication token of
    its own); ``parts`` keeps each message's name and size, so that rows derived per
    message can still name it."""
    tenants: dict[str, list[Entry]] = {}
    for e in block.entries:
        if e.batch is not None:
            tenants.setdefault(e.batch.tenant, []).append(e)
    out: list[SpanBatch | ProfileBatch] = []
    for tenant, got in tenants.items():
        parts = [(f"{block.topic}/{block.partition}/{e.offset}", e.items) for e in got]
        batch = concat([e.batch for e in got])
        if len(got) == 1:  # concat hands back the very batch: name a copy, not the entry's
            batch = msgspec.structs.replace(batch)
        assert isinstance(batch, SpanBatch | ProfileBatch)
        batch.origin = block.token if tenant == DEFAULT_TENANT else f"{block.token}/{tenant}"
        batch.parts = parts
        out.append(batch)
    return out


def waves(batches: list[Batch], budget: int) -> list[list[Batch]]:
    """Consecutive groups of about ``budget`` items (at least one batch each), sent one
    after the other: a round of a dozen partitions' blocks at once would need a dozen
    blocks' rows (and the correlator's rows derived from them) in the exporter's queue
    together, more than it is allowed to hold."""
    out: list[list[Batch]] = []
    items = 0
    for b in batches:
        if not out or items + len(b) > budget:
            out.append([])
            items = 0
        out[-1].append(b)
        items += len(b)
    return out

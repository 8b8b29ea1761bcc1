"""Offset ranges of a Kafka topic and the blocks a backfill cuts them into, without a
broker (``kafka_range.py`` asks the broker and reads; this is what it reads *into*).

**Ranges** are half-open, ``[start, end)``, as Kafka's end offsets are: ``0:100-200`` reads
offsets 100 to 199, and ``0:0-100,...`` then ``0:100-200,...`` read a partition once
(``parse_offsets``). ``split`` cuts ranges into units of work for workers and the ledger.

**Blocks.** Each partition's messages are cut into blocks, one ``RangeBlock`` each, so
that the same offsets come out as the same blocks however the reads were chunked: a block
never spans a multiple of ``Limits.block_offsets`` and, within those segments, closes
before a message that would take it over ``block_items`` spans or samples (the receiver's
``block_items``) or ``block_bytes``. The cut depends only on the messages from the block's
segment start (or the range's start, if later), so ranges split at multiples of
``block_offsets`` (``split``) give the blocks of reading the whole. A block's ``origin``,
``backfill/kafka/TOPIC/PARTITION/FIRST-LAST/CRC32`` (its first and last offset, a CRC of
its messages' bytes so that a topic recreated with the same offsets does not collide), is
the ClickHouse insert deduplication token; each of its batches (one per tenant) carries it
as ``batch.origin``, with ``/TENANT`` appended for tenants other than the default one, as
the receiver names its blocks. The ``backfill/`` prefix keeps them apart from the live
receiver's tokens (``pipeline.kafka.blocks``: the same form without it), so that a
backfill's insert is never dropped as a duplicate of a live block that happens to cover
the same offsets. ``batch.parts`` name each message ``TOPIC/PARTITION/OFFSET`` as live,
so rows derived per message get the same ``source`` as the live ones.

**Bounds.** ``PartitionBlocks`` holds at most one block of its partition; a message over
``max_message_bytes`` is counted as malformed and not decoded; a message that is not OTLP,
has no value (a tombstone), or names no valid tenant is counted as malformed and skipped
(``RangeBlock.malformed``), never fatal; items the decoder refuses are counted
(``rejected``). Decoding is the ``kafka`` receiver's (``pipeline/receivers/
kafka_batches.py``: the same decoding, tenant rule and per-message names).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pipeline.backfill.sniff import Signal
from pipeline.kafka.blocks import Block, Entry
from pipeline.receivers.kafka_batches import Batch, merge_block, to_entry

ORIGIN_PREFIX = "backfill/kafka/"


class Limits(NamedTuple):
    # a block never spans a multiple of this offset: ranges split there read the same blocks
    block_offsets: int = 10_000
    block_items: int = 20_000  # spans or samples per block (the receiver's block_items)
    block_bytes: int = 32 << 20  # message bytes per block
    max_message_bytes: int = 64 << 20  # one message (as files.Limits); over: malformed
    max_poll_records: int = 500  # messages decoded per turn of the event loop
    stall: float = 60.0  # seconds of fetches bringing nothing before giving up (Retryable)


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class PartitionRange:
    """Offsets ``[start, end)`` of one partition."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def messages(self) -> int:
        """Messages in the range: exactly, unless offsets are missing (a compacted topic,
        transaction markers: spanprof's gateway writes neither), then at most."""
        return max(0, self.end - self.start)

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}:{self.start}-{self.end}"


@dataclass(slots=True)
class RangeBlock:
    """One block of a partition: its batches (one per tenant, each ``origin`` its insert
    deduplication token) and what it cost."""

    topic: str
    partition: int
    first: int  # offsets of its first and last message
    last: int
    origin: str  # the block's token (its default-tenant batch's origin)
    batches: list[Batch]
    messages: int  # read, malformed ones included
    malformed: int  # skipped: not OTLP, no value, over max_message_bytes, bad tenant header
    rejected: int  # items the decoder refused (times or values out of bounds)
    bytes: int  # message values, malformed ones included

    @property
    def items(self) -> int:
        return sum(len(b) for b in self.batches)


def parse_offsets(spec: str) -> dict[int, tuple[int, int]]:
    """``"P:FROM-TO,..."`` -> {partition: (FROM, TO)}, half-open ``[FROM, TO)`` (``TO`` is
    one past the last offset read, as Kafka's end offsets; ``FROM == TO`` is empty).
    ``ValueError`` naming the part that is wrong."""
    out: dict[int, tuple[int, int]] = {}
    if not spec.strip():
        raise ValueError("offsets: empty, expected P:FROM-TO[,P:FROM-TO...]")
    for raw in spec.split(","):
        part = raw.strip()
        what = f"offsets: {part[:60]!r}"
        p, colon, rng = part.partition(":")
        lo, dash, hi = rng.partition("-")
        if not colon or not dash:
            raise ValueError(f"{what}: expected P:FROM-TO (partition:first-end offsets)")
        try:
            partition, start, end = _nat(p), _nat(lo), _nat(hi)
        except ValueError:
            raise ValueError(f"{what}: partition and offsets must be integers >= 0") from None
        if start > end:
            raise ValueError(f"{what}: FROM {start} is after TO {end}")
        if partition in out:
            raise ValueError(f"{what}: partition {partition} is given twice")
        out[partition] = (start, end)
    return out


def _nat(text: str) -> int:
    t = text.strip()
    if not t.isdigit() or not t.isascii():
        raise ValueError(text)
    return int(t)


def split(ranges: Iterable[PartitionRange], every: int,
          limits: Limits = DEFAULT_LIMITS) -> list[PartitionRange]:
    """The ranges cut at multiples of ``every`` rounded up to a multiple of
    ``limits.block_offsets``: units of work whose blocks (and origins) are those of reading
    the ranges whole. Empty ranges are dropped."""
    if every < 1:
        raise ValueError(f"split: every must be at least 1, got {every}")
    step = -(-every // limits.block_offsets) * limits.block_offsets
    out: list[PartitionRange] = []
    for r in ranges:
        at = r.start
        while at < r.end:
            cut = min(r.end, (at // step + 1) * step)
            out.append(PartitionRange(r.topic, r.partition, at, cut))
            at = cut
    return out


@dataclass
class PartitionBlocks:
    """The block being filled for one partition's range."""

    rng: PartitionRange
    signal: Signal
    limits: Limits
    log: Any
    entries: list[Entry] = field(default_factory=list)
    segment: int = -1
    items: int = 0
    bytes: int = 0
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, rec: Any) -> list[RangeBlock]:
        """Take the next record; the blocks it completes."""
        out: list[RangeBlock] = []
        counts: Counter[str] = Counter()
        value = rec.value
        size = len(value) if value is not None else 0
        if value is None or size > self.limits.max_message_bytes:
            counts["malformed_messages"] += 1
            self.log.warning("kafka_message_malformed", topic=rec.topic, offset=rec.offset,
                             partition=rec.partition,
                             error="no value (a tombstone)" if value is None else
                             f"{size} bytes, over max_message_bytes")
            entry = Entry(rec.offset, b"", None, 0, rec.timestamp)
        else:
            entry = to_entry(self.signal, rec.topic, rec, counts, self.log)
        segment = rec.offset // self.limits.block_offsets
        if self.entries and (segment != self.segment
                             or self.items + entry.items > self.limits.block_items
                             or self.bytes + size > self.limits.block_bytes):
            out.append(self.flush())
        self.entries.append(entry)
        self.segment, self.items, self.bytes = segment, self.items + entry.items, \
            self.bytes + size
        self.counts.update(counts)
        if (rec.offset + 1) % self.limits.block_offsets == 0 or rec.offset + 1 >= self.rng.end:
            out.append(self.flush())  # no later message can join it: do not hold it
        return out

    def flush(self) -> RangeBlock:
        es = self.entries
        block = Block(self.rng.topic, self.rng.partition, es[0].offset, es[-1].offset, es)
        batches = merge_block(block, self.signal)
        for b in batches:
            b.origin = ORIGIN_PREFIX + b.origin
        refused = "refused_spans" if self.signal == "traces" else "refused_profiles"
        got = RangeBlock(block.topic, block.partition, block.first, block.last,
                         ORIGIN_PREFIX + block.token, batches, len(es),
                         self.counts["malformed_messages"], self.counts[refused], self.bytes)
        self.entries, self.items, self.bytes, self.counts = [], 0, 0, Counter()
        return got

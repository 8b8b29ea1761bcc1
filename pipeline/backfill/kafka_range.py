"""A bounded range of a Kafka topic, read again (issue #15: ``spanprof backfill kafka``).

What spanprof's gateway wrote (``pipeline/exporters/kafka.py``: an OTLP request per
message, the ``tenant`` header naming whose) is read back over an offset range per
partition, or over the offsets a time range resolves to, and handed on as the batches the
``kafka`` receiver would have made of it (``pipeline/receivers/kafka_batches.py``: the same
decoding, tenant rule and per-message names)::

    async with KafkaRange(cfg, "otlp_spans") as src:    # cfg: a kafka receiver's or exporter's
        ranges = await src.plan(since=lo_ns, until=hi_ns)   # or offsets=parse_offsets("0:0-500")
        for unit in split(ranges, 100_000):             # units for workers and the ledger
            async for block in src.read([unit]):
                for batch in block.batches: ...         # batch.origin: its insert token

**No consumer group.** The partitions are ``assign()``-ed to a consumer without a group id:
it joins no group, commits nothing and reads no committed offset, so the live correlator
group (its members, its offsets, its block plans) cannot notice it. Where to read is given,
never stored: a job that must resume records its ranges itself (the ledger).

**Ranges** are half-open, ``[start, end)``, as Kafka's end offsets are: ``0:100-200`` reads
offsets 100 to 199, and ``0:0-100,...`` then ``0:100-200,...`` read a partition once. A
time range ``[since, until)`` selects offsets, not messages: from the first offset stamped
``since`` or later to the first stamped ``until`` or later (``offsets_for_times``; no such
message: the end offset). Stamps are the producer's clock (``CreateTime``) in ms, near
monotone per partition for one gateway, not exactly: a message stamped inside the range but
written after a later-stamped one can fall outside it, and the reverse. An open end
(``until=None``) is the end offset when ``plan`` runs. Either way the plan is fixed offsets:
reading stops at them however much the topic receives meanwhile, and reading the plan again
reads the same messages. Offsets the log no longer holds (retention), offsets not written
yet, and partitions the topic does not have are a ``ConfigError`` naming each, not a
shorter read.

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

**Bounds.** At most one block per partition is held (plus aiokafka's one fetch per
partition, ``max_partition_fetch_bytes``); a message over ``max_message_bytes`` is counted
as malformed and not decoded; a message that is not OTLP, has no value (a tombstone), or
names no valid tenant is counted as malformed and skipped (``RangeBlock.malformed``), never
fatal; items the decoder refuses are counted (``rejected``). Decoding runs on the event
loop per fetch of at most ``max_poll_records`` messages, as in the receiver.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import OffsetOutOfRangeError
from aiokafka.structs import TopicPartition

from pipeline.backfill.sniff import Signal
from pipeline.errors import ConfigError, Retryable
from pipeline.kafka import ClientConfig
from pipeline.kafka.blocks import Block, Entry
from pipeline.receivers.kafka_batches import Batch, merge_block, to_entry

ORIGIN_PREFIX = "backfill/kafka/"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = datetime.resolution  # one microsecond

# an instant: ns since the epoch, or a datetime (naive: local time, as datetime.timestamp)
Instant = int | datetime


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


def signal_of(cfg: ClientConfig, topic: str) -> Signal:
    """The signal of a topic as the receiver knows it: the config's ``traces.topic`` or
    ``profiles.topic``."""
    if topic == cfg.traces.topic:
        return "traces"
    if topic == cfg.profiles.topic:
        return "profiles"
    raise ConfigError(f"backfill kafka: topic {topic!r} is neither traces.topic "
                      f"({cfg.traces.topic!r}) nor profiles.topic ({cfg.profiles.topic!r}) "
                      "of the kafka config: say which signal it holds")


def _ms(t: Instant, name: str) -> int:
    """The first whole millisecond at or after ``t`` (Kafka stamps messages in ms: a
    message is at or after ``t`` exactly when its stamp is at or after this)."""
    if isinstance(t, datetime):
        ns = (t.astimezone(UTC) - _EPOCH) // _US * 1000
    elif isinstance(t, int) and not isinstance(t, bool):
        ns = t
    else:
        raise TypeError(f"{name}: expected ns since the epoch or a datetime, got {t!r}")
    if ns < 0:
        raise ConfigError(f"backfill kafka: {name} {t!r} is before 1970")
    return -(-ns // 1_000_000)


@dataclass
class _Partition:
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


class KafkaRange:
    """Reads ranges of one topic with a consumer of its own that joins no group.

    ``cfg`` is a ``kafka`` receiver's or exporter's config (``ClientConfig``: brokers,
    client id, timeout, TLS and SASL); ``signal`` defaults to the one ``cfg`` gives the
    topic (``signal_of``)."""

    def __init__(self, cfg: ClientConfig, topic: str, *, signal: Signal | None = None,
                 limits: Limits = DEFAULT_LIMITS, log: Any = None) -> None:
        for name in ("block_offsets", "block_items", "block_bytes", "max_message_bytes",
                     "max_poll_records"):
            if getattr(limits, name) < 1:
                raise ValueError(f"limits.{name}: must be at least 1")
        self.cfg = cfg
        self.topic = topic
        self.signal: Signal = signal or signal_of(cfg, topic)
        self.limits = limits
        self.log = log or structlog.get_logger().bind(component="backfill", source="kafka",
                                                      topic=topic)
        self.consumer: AIOKafkaConsumer | None = None
        self.read_messages = 0
        self.read_blocks = 0

    def __repr__(self) -> str:
        state = "started" if self.consumer is not None else "stopped"
        return (f"<KafkaRange {self.topic} {self.signal} {state} "
                f"blocks={self.read_blocks} messages={self.read_messages}>")

    async def start(self) -> None:
        if self.consumer is not None:
            return
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=list(self.cfg.brokers), client_id=f"{self.cfg.client_id}-backfill",
            group_id=None, enable_auto_commit=False,
            # never jump elsewhere when the range is gone: the read fails instead
            auto_offset_reset="none",
            request_timeout_ms=int(self.cfg.timeout * 1000) + 30_000, **self.cfg.security())
        try:
            await self.consumer.start()
        except BaseException:
            await self.consumer.stop()
            self.consumer = None
            raise

    async def stop(self) -> None:
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            await consumer.stop()

    async def __aenter__(self) -> KafkaRange:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _client(self) -> AIOKafkaConsumer:
        if self.consumer is None:
            raise RuntimeError(f"{self!r}: not started")
        return self.consumer

    async def partitions(self) -> list[int]:
        """The topic's partitions, from metadata of all topics: asking for this one by name
        would create it on a broker with ``auto.create.topics.enable``."""
        # private: the public topics() returns the names without their partitions
        cluster = await self._client()._client.fetch_all_metadata()
        parts = cluster.partitions_for_topic(self.topic)
        if not parts:
            raise ConfigError(f"backfill kafka: topic {self.topic!r} does not exist")
        return sorted(parts)

    async def _bounds(self, partitions: Iterable[int] | None = None
                      ) -> dict[int, tuple[int, int]]:
        """{partition: (log start, end offset)} now, of ``partitions`` (None: all); a
        partition the topic does not have is an error (aiokafka would wait for it
        forever)."""
        have = await self.partitions()
        wanted = have if partitions is None else sorted(set(partitions))
        missing = [p for p in wanted if p not in have]
        if missing:
            raise ConfigError(f"backfill kafka: topic {self.topic!r} has no partition "
                              f"{', '.join(map(str, missing))} (it has {_spans(have)})")
        c = self._client()
        tps = [TopicPartition(self.topic, p) for p in wanted]
        first = await c.beginning_offsets(tps)
        end = await c.end_offsets(tps)
        return {tp.partition: (int(first[tp]), int(end[tp])) for tp in tps}

    async def plan(self, *, offsets: Mapping[int, tuple[int, int]] | None = None,
                   since: Instant | None = None, until: Instant | None = None
                   ) -> list[PartitionRange]:
        """The offset ranges to read, per partition, without reading a message:
        ``offsets`` as given (``parse_offsets``), checked against the log; or the offsets
        of ``[since, until)`` on every partition (no ``since``: from the log start; no
        ``until``: to the end offset now); with neither, everything the topic holds now.
        ``messages`` of each is the count ``--dry-run`` reports."""
        if offsets is not None:
            if since is not None or until is not None:
                raise ValueError("plan: offsets or a time range, not both")
            bounds = await self._bounds(offsets)
            problems = []
            for p, (start, end) in sorted(offsets.items()):
                lo, hi = bounds[p]
                if start > end:
                    problems.append(f"partition {p}: {start}-{end} ends before it starts")
                elif start < end and start < lo:
                    problems.append(f"partition {p}: {start}-{end} starts before the log, "
                                    f"which begins at {lo} now (retention deleted the rest)")
                elif end > hi:
                    problems.append(f"partition {p}: {start}-{end} ends after the last "
                                    f"message written, the end offset is {hi}")
            if problems:
                raise ConfigError([f"backfill kafka: topic {self.topic!r} {m}"
                                   for m in problems])
            return [PartitionRange(self.topic, p, s, e) for p, (s, e) in sorted(offsets.items())]
        lo_ms = _ms(since, "since") if since is not None else None
        hi_ms = _ms(until, "until") if until is not None else None
        if lo_ms is not None and hi_ms is not None and lo_ms > hi_ms:
            raise ConfigError(f"backfill kafka: since {since!r} is after until {until!r}")
        bounds = await self._bounds()
        starts = await self._at(bounds, lo_ms, start=True)
        ends = await self._at(bounds, hi_ms, start=False)
        return [PartitionRange(self.topic, p, starts[p], ends[p]) for p in sorted(bounds)]

    async def _at(self, bounds: dict[int, tuple[int, int]], ms: int | None, start: bool
                  ) -> dict[int, int]:
        """Per partition, the first offset stamped ``ms`` or later (none: the end offset);
        no ``ms``: the log start (``start``) or the end offset."""
        if ms is None:
            return {p: lo if start else hi for p, (lo, hi) in bounds.items()}
        found = await self._client().offsets_for_times(
            {TopicPartition(self.topic, p): ms for p in bounds})
        out = {}
        for tp, got in found.items():
            hi = bounds[tp.partition][1]
            # a message written after the end offset was read stays out: the plan is now
            out[tp.partition] = hi if got is None else min(int(got.offset), hi)
        return out

    async def read(self, ranges: Iterable[PartitionRange]) -> AsyncIterator[RangeBlock]:
        """Every message of ``ranges`` (of this topic, one range per partition), once, as
        blocks in offset order per partition (partitions interleaved). Empty ranges yield
        nothing; the ranges are checked against the log first (``ConfigError``)."""
        todo = [r for r in ranges if r.end > r.start]
        seen: set[int] = set()
        for r in todo:
            if r.topic != self.topic:
                raise ValueError(f"read: range {r} is not of topic {self.topic!r}")
            if r.partition in seen:
                raise ValueError(f"read: partition {r.partition} given twice")
            seen.add(r.partition)
        if not todo:
            return
        await self.plan(offsets={r.partition: (r.start, r.end) for r in todo})  # checks
        c = self._client()
        parts = {TopicPartition(self.topic, r.partition):
                 _Partition(r, self.signal, self.limits, self.log) for r in todo}
        c.assign(list(parts))
        try:
            for tp, part in parts.items():
                c.seek(tp, part.rng.start)
            idle = 0.0  # seconds fetches brought nothing in a row (not time spent by
            # whoever consumes the blocks: a slow insert is not a stalled read)
            while parts:
                asked = time.monotonic()
                try:
                    got = await c.getmany(*parts, timeout_ms=500,
                                          max_records=self.limits.max_poll_records)
                except OffsetOutOfRangeError as err:
                    raise ConfigError(f"backfill kafka: {self.topic!r}: offsets were deleted "
                                      f"(retention) while being read: {err}") from None
                idle = 0.0 if any(got.values()) else idle + time.monotonic() - asked
                for tp, records in got.items():
                    part = parts[tp]
                    for rec in records:
                        if rec.offset >= part.rng.end:
                            break
                        if rec.offset < part.rng.start:
                            continue  # a fetch may begin inside a batch before the seek
                        self.read_messages += 1
                        for block in part.add(rec):
                            self.read_blocks += 1
                            yield block
                for tp in list(parts):
                    if await c.position(tp) >= parts[tp].rng.end:
                        part = parts.pop(tp)
                        c.pause(tp)
                        if part.entries:  # the range ends in a gap of offsets
                            self.read_blocks += 1
                            yield part.flush()
                if parts and idle > self.limits.stall:
                    where = ", ".join([f"{tp.partition} at {await c.position(tp)} of "
                                       f"{p.rng.end}" for tp, p in parts.items()])
                    raise Retryable(f"backfill kafka: {self.topic!r}: nothing read for "
                                    f"{self.limits.stall:g}s (partition {where})")
        finally:
            if self.consumer is not None:
                # paused, not unassigned: assign([]) while a fetch is in flight left
                # aiokafka's fetcher unable to stop (consumer.stop() hung for minutes)
                self.consumer.pause(*self.consumer.assignment())


def _spans(ps: list[int]) -> str:
    """``0-5`` for consecutive partitions, else the list."""
    if ps == list(range(ps[0], ps[-1] + 1)):
        return f"{ps[0]}-{ps[-1]}" if len(ps) > 1 else str(ps[0])
    return ", ".join(map(str, ps))

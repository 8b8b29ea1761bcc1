"""A bounded range of a Kafka topic, read again (issue #15: ``spanprof backfill kafka``).

What spanprof's gateway wrote (``pipeline/exporters/kafka.py``: an OTLP request per
message, the ``tenant`` header naming whose) is read back over an offset range per
partition, or over the offsets a time range resolves to, and handed on as the batches the
``kafka`` receiver would have made of it, cut into the blocks ``kafka_blocks.py``
describes::

    async with KafkaRange(cfg, "otlp_spans") as src:    # cfg: a kafka receiver's or exporter's
        ranges = await src.plan(since=lo_ns, until=hi_ns)   # or offsets=parse_offsets("0:0-500")
        for unit in split(ranges, 100_000):             # units for workers and the ledger
            async for block in src.read([unit]):
                for batch in block.batches: ...         # batch.origin: its insert token

**No consumer group.** The partitions are ``assign()``-ed to a consumer without a group id:
it joins no group, commits nothing and reads no committed offset, so the live correlator
group (its members, its offsets, its block plans) cannot notice it. Where to read is given,
never stored: a job that must resume records its ranges itself (the ledger).

**Plans.** A time range ``[since, until)`` selects offsets, not messages: from the first
offset stamped ``since`` or later to the first stamped ``until`` or later
(``offsets_for_times``; no such message: the end offset). Stamps are the producer's clock
(``CreateTime``) in ms, near monotone per partition for one gateway, not exactly: a message
stamped inside the range but written after a later-stamped one can fall outside it, and the
reverse. An open end (``until=None``) is the end offset when ``plan`` runs. Either way the
plan is fixed offsets (half-open ranges, ``kafka_blocks.PartitionRange``): reading stops at
them however much the topic receives meanwhile, and reading the plan again reads the same
messages. Offsets the log no longer holds (retention), offsets not written yet, and
partitions the topic does not have are a ``ConfigError`` naming each, not a shorter read.

**Bounds.** At most one block per partition is held (plus aiokafka's one fetch per
partition, ``max_partition_fetch_bytes``); what is malformed or refused is counted per
block, never fatal (``kafka_blocks.py``). Decoding runs on the event loop per fetch of at
most ``max_poll_records`` messages, as in the receiver.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import OffsetOutOfRangeError
from aiokafka.structs import TopicPartition

from pipeline.backfill.kafka_blocks import (
    DEFAULT_LIMITS,
    Limits,
    PartitionBlocks,
    PartitionRange,
    RangeBlock,
)
from pipeline.backfill.sniff import Signal
from pipeline.errors import ConfigError, Retryable
from pipeline.kafka import ClientConfig

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = datetime.resolution  # one microsecond

# an instant: ns since the epoch, or a datetime (naive: local time, as datetime.timestamp)
Instant = int | datetime


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
                 PartitionBlocks(r, self.signal, self.limits, self.log) for r in todo}
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

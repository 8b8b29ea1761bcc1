"""``kafka`` receiver: the correlator tier's input, a Kafka consumer group.

Reads ``otlp_proto`` messages (a plain ``ExportTraceServiceRequest`` /
``ExportProfilesServiceRequest`` per message, from spanprof's gateway, a stock Collector or
any producer)::

    receivers:
      kafka:
        brokers: [kafka-0:9092]
        group_id: spanprof-correlator
        initial_offset: earliest     # where a new group starts: earliest | latest
        traces: {topic: otlp_spans}
        profiles: {topic: otlp_profiles}
        max_poll_records: 2000
        block_items: 20000           # spans or samples per insert block
        spans_ahead: 5s              # on a backlog, samples wait for spans this much newer
        spans_wait_max: 5m           # ... for at most this long

Messages are grouped into insert blocks per partition (``block_items`` spans or samples
each), planned in the offset commit's metadata before they are delivered, so that after a
crash whoever reads them again builds the same blocks and ClickHouse deduplicates them
whole (``pipeline.kafka.blocks``). The offsets are committed only after every block was
consumed downstream, i.e. is durable, including the correlator's attribution rows derived
from it. A round's blocks go downstream in waves of about ``block_items`` items, so that
the exporter's bounded queue holds them (and what the correlator derives from them). When
downstream refuses (``Retryable``), the partitions are paused, the consumer seeks back to
the first unconsumed offset and resumes after a backoff, keeping the plan (blocks already
inserted are then acknowledged by the exporter without queueing them again): nothing is
buffered without bound and no partition stays paused. Both topics are read with
the range assignor, which gives one worker the same partitions of both, so a trace's spans
and samples meet in one worker; start-up fails if the two topics' partition counts differ.
A message that is not valid OTLP is logged, counted and skipped (``kafka_batches.py``: from
messages to the batches sent on).

Spans before samples: a sample's row names its span's operation (and so reaches the
per-operation aggregates) only if the span was sent on first. Live, samples come seconds
after their spans anyway; on a backlog both topics would be read side by side, so profile
messages are held (bounded, like any held message) until the spans of their partition were
sent on ``spans_ahead`` past their Kafka timestamp, or that spans partition is caught up,
for at most ``spans_wait_max``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Collection
from typing import Literal

from aiokafka.errors import KafkaError

from pipeline.component import raise_worst
from pipeline.config import Duration, NonNegDuration, PositiveInt
from pipeline.errors import ConfigError, InvalidData, Retryable
from pipeline.kafka import ClientConfig
from pipeline.kafka.backend import (
    Consumer,
    ConsumerOptions,
    Consumers,
    TopicPartition,
    aiokafka_consumer,
)
from pipeline.kafka.blocks import Block, Entry, PartitionBlocks, decode_plan, encode_plan
from pipeline.receivers.kafka_batches import merge_block, to_entry, waves
from pipeline.registry import Context, Factory

# per partition of a round: its state, the blocks complete now, where to rewind to
Rounds = dict[TopicPartition, tuple[PartitionBlocks, list[Block], int]]


class Config(ClientConfig, forbid_unknown_fields=True):
    group_id: str = "spanprof-correlator"
    initial_offset: Literal["earliest", "latest"] = "earliest"
    max_poll_records: PositiveInt = 2000
    # items (spans or samples) per insert block; a block is what is deduplicated as one
    block_items: PositiveInt = 20_000
    # on a backlog, a profile message waits until spans this far past it were sent on
    spans_ahead: NonNegDuration = NonNegDuration(5.0)
    # ... but no longer than this (a message stamped far ahead, a backlog that never shrinks)
    spans_wait_max: Duration = Duration(300.0)
    check_copartitioning: bool = True
    # how soon the group notices a dead worker and hands its partitions to the others
    session_timeout: Duration = Duration(10.0)
    heartbeat_interval: Duration = Duration(3.0)

    def validate(self) -> None:
        if not self.brokers:
            raise ConfigError("brokers: at least one broker is required")
        self.validate_security()
        if self.max_poll_records < 1:
            raise ConfigError("max_poll_records: must be at least 1")
        if self.block_items < 1:
            raise ConfigError("block_items: must be at least 1")


class _Rebalance:
    """Partitions taken away: their plans and held messages are the next owner's now."""

    def __init__(self, receiver: KafkaReceiver) -> None:
        self.receiver = receiver

    async def on_partitions_revoked(self, revoked: Collection[TopicPartition]) -> None:
        self.receiver._forget(revoked)

    async def on_partitions_assigned(self, assigned: Collection[TopicPartition]) -> None:
        self.receiver._forget(assigned)  # read afresh from the committed plan


class KafkaReceiver:
    """``consumers`` builds the Kafka client (``pipeline.kafka.backend``): aiokafka's by
    default, ``memory.MemoryBroker.consumer`` in unit tests."""

    def __init__(self, cfg: Config, ctx: Context,
                 consumers: Consumers = aiokafka_consumer) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.consumers = consumers
        self.consumer: Consumer | None = None
        self.metrics: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._stopped = False
        self._parts: dict[TopicPartition, PartitionBlocks] = {}
        # per partition: the newest Kafka timestamp (ms) of the spans sent downstream
        self._spans_sent: dict[int, int] = {}
        # profiles partitions holding messages until their spans are sent on: since when
        self._waiting_since: dict[TopicPartition, float] = {}
        # set when the poll loop died: /health then answers 503
        self.failed: str | None = None
        self.topics: dict[str, str] = {}
        if "traces" in ctx.next:
            self.topics[cfg.traces.topic] = "traces"
        if "profiles" in ctx.next:
            self.topics[cfg.profiles.topic] = "profiles"

    def __repr__(self) -> str:
        return f"<KafkaReceiver {self.ctx.id} group={self.cfg.group_id} {dict(self.metrics)}>"

    async def start(self) -> None:
        self.consumer = self.consumers(ConsumerOptions(
            brokers=list(self.cfg.brokers), client_id=self.cfg.client_id,
            group_id=self.cfg.group_id, initial_offset=self.cfg.initial_offset,
            max_poll_records=self.cfg.max_poll_records,
            session_timeout=float(self.cfg.session_timeout),
            heartbeat_interval=float(self.cfg.heartbeat_interval),
            timeout=float(self.cfg.timeout), security=self.cfg.security()))
        self.consumer.subscribe(list(self.topics), listener=_Rebalance(self))
        try:
            await self.consumer.start()
            if self.cfg.check_copartitioning and len(self.topics) > 1:
                counts = {t: len(await self._partitions(t)) for t in self.topics}
                if len(set(counts.values())) != 1:
                    raise ConfigError(
                        f"receivers.{self.ctx.id}: topics must have the same number of "
                        f"partitions for spans and samples of a trace to meet, got {counts}")
        except BaseException:
            await self.consumer.stop()
            raise
        self._task = asyncio.create_task(self._run(), name=f"{self.ctx.id}-poll")
        self._task.add_done_callback(self._poll_ended)
        self.log.info("kafka_consumer_started", topics=sorted(self.topics),
                      group_id=self.cfg.group_id)

    async def _partitions(self, topic: str) -> set[int]:
        assert self.consumer is not None
        for _ in range(50):
            parts = self.consumer.partitions(topic)
            if parts:
                return parts
            await self.consumer.refresh_metadata()
            await asyncio.sleep(0.1)
        raise ConfigError(f"receivers.{self.ctx.id}: topic {topic!r} does not exist")

    async def _load_plans(self, tps: list[TopicPartition]) -> None:
        """State for partitions new to this worker, with the plan their last owner
        committed (see ``pipeline.kafka.blocks``)."""
        assert self.consumer is not None
        new = [tp for tp in tps if tp not in self._parts]
        if not new:
            return
        committed = await self.consumer.committed(new)
        for tp in new:
            part = PartitionBlocks(tp.topic, tp.partition, self.cfg.block_items)
            _, metadata = committed.get(tp, (-1, None))
            part.plan.extend(decode_plan(metadata))
            if part.plan:
                self.log.info("kafka_plan_resumed", topic=tp.topic, partition=tp.partition,
                              ranges=len(part.plan), first=part.plan[0][0])
            self._parts[tp] = part

    async def _samples_until(self, partition: int) -> float:
        """The newest profile message (by Kafka timestamp) to deliver now: on a backlog
        (after an outage, a replay, a backfill), samples wait until the spans of their
        partition were sent on ``spans_ahead`` past them, so that their spans are known and
        their CPU reaches the per-operation aggregates. Caught up, nothing waits: a span
        that is not in Kafka yet is not waited for here."""
        if "traces" not in self.topics.values():
            return float("inf")
        assert self.consumer is not None
        tp = TopicPartition(self.cfg.traces.topic, partition)
        if tp not in self.consumer.assignment():
            return float("inf")  # not ours (the assignor gives both or neither)
        waiting = self._spans_sent.get(partition, -1) - self.cfg.spans_ahead * 1000
        high = self.consumer.highwater(tp)
        spans = self._parts.get(tp)
        try:
            caught_up = (high is not None and (spans is None or not spans.held)
                         and await self.consumer.position(tp) >= high)
        except KafkaError:  # the partition is being reassigned: decide next round
            return waiting
        return float("inf") if caught_up else waiting

    def _wait_for_spans(self, tp: TopicPartition, part: PartitionBlocks,
                        entries: list[Entry], until: float) -> list[Block]:
        """Cut a profiles partition's blocks up to ``until``; a partition that has waited
        ``spans_wait_max`` for its spans (a message stamped far ahead of them, a backlog
        of spans that does not shrink) is let go, counted."""
        now = time.monotonic()
        since = self._waiting_since.get(tp)
        if since is not None and now - since > self.cfg.spans_wait_max:
            until = float("inf")
            self.metrics["spans_wait_expired"] += 1
            self.log.warning("kafka_spans_wait_expired", topic=tp.topic,
                             partition=tp.partition, waited_s=round(now - since, 1))
        blocks = part.cut(entries, until)
        if part.held and not part.plan and until != float("inf"):
            self._waiting_since.setdefault(tp, now)
        else:
            self._waiting_since.pop(tp, None)
        return blocks

    def _poll_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        self.failed = f"receivers.{self.ctx.id}: the Kafka poll loop stopped: {err!r}"
        self.log.error("kafka_poll_failed", error=repr(err))

    def _forget(self, tps: Collection[TopicPartition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)
            self._waiting_since.pop(tp, None)
            if self.topics.get(tp.topic) == "traces":
                self._spans_sent.pop(tp.partition, None)

    async def _run(self) -> None:
        assert self.consumer is not None
        consumer = self.consumer
        backoff = 0.5
        while not self._stopping.is_set():
            try:
                fetched = await consumer.getmany(timeout_ms=500)
                await self._load_plans(list(fetched))
            except KafkaError as err:
                self.log.warning("kafka_fetch_failed", error=str(err))
                await asyncio.sleep(1.0)
                continue
            # partitions paused with messages held (below) go on from those
            work = {**{tp: [] for tp, p in self._parts.items() if p.held}, **fetched}
            if not work:
                continue
            rounds: Rounds = {}
            spans_sent = dict(self._spans_sent)  # restored if this round is refused
            for tp in sorted(work, key=lambda tp: self.topics[tp.topic] != "traces"):
                records = work[tp]
                part = self._parts.get(tp)
                if part is None:  # revoked while its plan was read: the next owner's
                    continue
                rewind_to = part.held[0].offset if part.held else records[0].offset
                signal = self.topics[tp.topic]
                entries = [to_entry(signal, tp.topic, r, self.metrics, self.log) for r in records]
                if signal == "traces":
                    blocks = part.cut(entries)
                    # spans in this round's blocks go down before any sample of the round
                    if blocks:
                        self._spans_sent[tp.partition] = max(
                            self._spans_sent.get(tp.partition, 0),
                            max(e.timestamp for b in blocks for e in b.entries))
                else:
                    blocks = self._wait_for_spans(
                        tp, part, entries, await self._samples_until(tp.partition))
                rounds[tp] = (part, blocks, rewind_to)
                # messages held beyond what the metadata can plan: read no more for now
                # (not while a planned range waits for its last messages: they must come)
                if len(part.held) > self.cfg.max_poll_records and not part.plan:
                    consumer.pause(tp)
                elif tp in consumer.paused():
                    consumer.resume(tp)
            try:
                await self._plan(rounds)
                await self._deliver(rounds)
            except (Retryable, InvalidData, KafkaError) as err:
                if isinstance(err, InvalidData):
                    self.log.error("kafka_batch_refused", error=str(err))  # not retryable
                else:
                    # pause, rewind to what is not yet delivered, resume after a backoff;
                    # the planned ranges stay, so the same blocks are built again
                    self.log.warning("kafka_downstream_refused", error=str(err),
                                     retry_in_s=backoff)
                    self._spans_sent = spans_sent
                    consumer.pause(*rounds)
                    for tp, (part, blocks, rewind_to) in rounds.items():
                        part.plan.extendleft((b.first, b.last) for b in reversed(blocks))
                        part.held = []
                        consumer.seek(tp, rewind_to)
                    try:
                        await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
                    except TimeoutError:
                        pass
                    consumer.resume(*rounds)
                    backoff = min(backoff * 2, 30.0)
                    continue
            backoff = 0.5
            await self._commit(rounds)

    async def _plan(self, rounds: Rounds) -> None:
        """Step 1: the ranges about to be inserted, in the offset commit's metadata, so that
        whoever reads these messages again builds the same blocks."""
        assert self.consumer is not None
        plans = {tp: (blocks[0].first, encode_plan(
            [*((b.first, b.last) for b in blocks), *part.plan]))
            for tp, (part, blocks, _) in rounds.items()
            if blocks and self._parts.get(tp) is part}
        if plans:
            await self.consumer.commit(plans)

    async def _deliver(self, rounds: Rounds) -> None:
        """Step 2: one batch per block, spans before samples (the correlator then sees a
        trace's span first); all sent together so that they share ClickHouse inserts."""
        invalid: BaseException | None = None
        for signal in ("traces", "profiles"):
            batches = [b for tp, (_, blocks, _) in rounds.items()
                       if self.topics[tp.topic] == signal
                       for blk in blocks for b in merge_block(blk, signal)]
            for wave in waves(batches, self.cfg.block_items):
                results = await asyncio.gather(
                    *(self.ctx.next[signal].consume(b) for b in wave), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                # anything but a refusal of the data itself: rewind and send again (the
                # rest of the round must not be committed unsent)
                raise_worst([e for e in errors if not isinstance(e, InvalidData)])
                invalid = invalid or next(iter(errors), None)
                self.metrics[f"accepted_{'spans' if signal == 'traces' else 'samples'}"] += \
                    sum(len(b) for b, r in zip(wave, results, strict=True)
                        if not isinstance(r, BaseException))
                self.metrics["blocks"] += len(wave)
        if invalid is not None:
            raise invalid  # logged; the other blocks were delivered, the round is committed

    async def _commit(self, rounds: Rounds) -> None:
        """Step 3: the offset after the last block, and what is left of the plan."""
        assert self.consumer is not None
        done = {tp: (blocks[-1].last + 1, encode_plan(part.plan))
                for tp, (part, blocks, _) in rounds.items()
                if blocks and self._parts.get(tp) is part}  # not revoked meanwhile
        if not done:
            return
        try:
            await self.consumer.commit(done)
            self.metrics["committed_messages"] += sum(
                len(b.entries) for tp in done for b in rounds[tp][1])
        except KafkaError as err:
            # the data is durable; a lost commit means a redelivery of the same blocks
            self.log.warning("kafka_commit_failed", error=str(err))

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._task is not None:
            t = self._task
            if not (t.done() and not t.cancelled() and t.exception() is not None):
                await t  # finishes the batch in hand, commits it (a dead loop: logged)
        if self.consumer is not None:
            await self.consumer.stop()


def create(cfg: Config, ctx: Context) -> KafkaReceiver:
    return KafkaReceiver(cfg, ctx)


FACTORY = Factory(type="kafka", kind="receiver", config=Config, create=create,
                  signals=("traces", "profiles"))

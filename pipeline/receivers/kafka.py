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

Each message becomes one batch that names it (``origin``); the offsets of a fetch are
committed only after all its batches were consumed downstream, i.e. are durable, including
the correlator's attribution rows derived from them. When downstream refuses (``Retryable``),
the partitions are paused, the consumer seeks back to the first unconsumed offset and
resumes after a backoff: nothing is buffered without bound and no partition stays paused.
Both topics are read with the range assignor, which gives one worker the same partitions of
both, so a trace's spans and samples meet in one worker; start-up fails if the two topics'
partition counts differ. A message that is not valid OTLP is logged, counted and skipped.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.component import raise_worst
from pipeline.config import Duration
from pipeline.errors import ConfigError, InvalidData, Retryable
from pipeline.kafka import ClientConfig
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.records import ProfileBatch, SpanBatch
from pipeline.registry import Context, Factory


class Config(ClientConfig, forbid_unknown_fields=True):
    group_id: str = "spanprof-correlator"
    initial_offset: Literal["earliest", "latest"] = "earliest"
    max_poll_records: int = 2000
    check_copartitioning: bool = True
    # how soon the group notices a dead worker and hands its partitions to the others
    session_timeout: Duration = Duration(10.0)
    heartbeat_interval: Duration = Duration(3.0)

    def validate(self) -> None:
        if not self.brokers:
            raise ConfigError("brokers: at least one broker is required")
        if self.max_poll_records < 1:
            raise ConfigError("max_poll_records: must be at least 1")


class KafkaReceiver:
    def __init__(self, cfg: Config, ctx: Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.consumer: AIOKafkaConsumer | None = None
        self.metrics: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._stopped = False
        self.topics: dict[str, str] = {}
        if "traces" in ctx.next:
            self.topics[cfg.traces.topic] = "traces"
        if "profiles" in ctx.next:
            self.topics[cfg.profiles.topic] = "profiles"

    def __repr__(self) -> str:
        return f"<KafkaReceiver {self.ctx.id} group={self.cfg.group_id} {dict(self.metrics)}>"

    async def start(self) -> None:
        self.consumer = AIOKafkaConsumer(
            *self.topics, bootstrap_servers=self.cfg.brokers, client_id=self.cfg.client_id,
            group_id=self.cfg.group_id, enable_auto_commit=False,
            auto_offset_reset=self.cfg.initial_offset,
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_poll_records=self.cfg.max_poll_records,
            session_timeout_ms=int(self.cfg.session_timeout * 1000),
            heartbeat_interval_ms=int(self.cfg.heartbeat_interval * 1000),
            request_timeout_ms=int(self.cfg.timeout * 1000) + 30_000)
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
        self.log.info("kafka_consumer_started", topics=sorted(self.topics),
                      group_id=self.cfg.group_id)

    async def _partitions(self, topic: str) -> set[int]:
        assert self.consumer is not None
        for _ in range(50):
            parts = self.consumer.partitions_for_topic(topic)
            if parts:
                return set(parts)
            await self.consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
        raise ConfigError(f"receivers.{self.ctx.id}: topic {topic!r} does not exist")

    def _decode(self, topic: str, value: bytes) -> SpanBatch | ProfileBatch | None:
        signal = self.topics[topic]
        try:
            if signal == "traces":
                d: Any = decode_traces(tps.ExportTraceServiceRequest.FromString(value))
            else:
                d = decode_profiles(pps.ExportProfilesServiceRequest.FromString(value))
        except DecodeError as err:
            self.metrics["malformed_messages"] += 1
            self.log.warning("kafka_message_malformed", topic=topic, error=str(err))
            return None
        if d.rejected:
            self.metrics[f"refused_{'spans' if signal == 'traces' else 'profiles'}"] += \
                d.rejected
            self.log.info("kafka_items_rejected", topic=topic, rejected=d.rejected,
                          reason=d.message[:300])
        return d.batch  # type: ignore[no-any-return]

    async def _run(self) -> None:
        assert self.consumer is not None
        consumer = self.consumer
        backoff = 0.5
        while not self._stopping.is_set():
            try:
                fetched = await consumer.getmany(timeout_ms=500)
            except KafkaError as err:
                self.log.warning("kafka_fetch_failed", error=str(err))
                await asyncio.sleep(1.0)
                continue
            if not fetched:
                continue
            by_signal: dict[str, list[Any]] = {}
            first: dict[TopicPartition, int] = {}
            last: dict[TopicPartition, int] = {}
            for tp, records in fetched.items():
                first[tp] = records[0].offset
                last[tp] = records[-1].offset
                for rec in records:
                    batch = self._decode(tp.topic, rec.value)
                    if batch is not None and len(batch):
                        batch.origin = f"{tp.topic}/{tp.partition}/{rec.offset}"
                        by_signal.setdefault(self.topics[tp.topic], []).append(batch)
            try:
                # spans before samples: the correlator then sees a trace's span first
                # one batch per message, so that what is derived from a message can name it
                # (exactly-once attribution); sent together, they share ClickHouse inserts
                for signal in ("traces", "profiles"):
                    batches = by_signal.get(signal, [])
                    results = await asyncio.gather(
                        *(self.ctx.next[signal].consume(b) for b in batches),
                        return_exceptions=True)
                    raise_worst(results)
                    self.metrics[f"accepted_{'spans' if signal == 'traces' else 'samples'}"] \
                        += sum(len(b) for b in batches)
            except (Retryable, InvalidData) as err:
                if isinstance(err, InvalidData):
                    self.log.error("kafka_batch_refused", error=str(err))  # not retryable
                else:
                    # pause, rewind to what is not yet delivered, resume after a backoff
                    self.log.warning("kafka_downstream_refused", error=str(err),
                                     retry_in_s=backoff)
                    consumer.pause(*fetched)
                    for tp, off in first.items():
                        consumer.seek(tp, off)
                    try:
                        await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
                    except TimeoutError:
                        pass
                    consumer.resume(*fetched)
                    backoff = min(backoff * 2, 30.0)
                    continue
            backoff = 0.5
            try:
                await consumer.commit({tp: off + 1 for tp, off in last.items()})
                self.metrics["committed_messages"] += sum(
                    last[tp] - first[tp] + 1 for tp in last)
            except KafkaError as err:
                # the data is durable; a lost commit only means a redelivery after restart
                self.log.warning("kafka_commit_failed", error=str(err))

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._task is not None:
            await self._task  # finishes the batch in hand, commits it
        if self.consumer is not None:
            await self.consumer.stop()


def create(cfg: Config, ctx: Context) -> KafkaReceiver:
    return KafkaReceiver(cfg, ctx)


FACTORY = Factory(type="kafka", kind="receiver", config=Config, create=create,
                  signals=("traces", "profiles"))

"""``kafka`` exporter: OTLP protobuf messages (``otlp_proto``), keyed by a trace id's hex
so that all spans and all linked samples of a trace land on one partition (as the
Collector's ``partition_traces_by_id``, but one message per partition per request)::

    exporters:
      kafka:
        brokers: [kafka-0:9092]
        traces: {topic: otlp_spans}
        profiles: {topic: otlp_profiles}
        partitioner: sarama_compat  # the Collector's default; murmur2 = Kafka's Java client
        producer:
          compression: snappy       # none | gzip | snappy | lz4 | zstd
          max_message_bytes: 1000000
          linger: 5ms
        timeout: 10s                # waiting for Kafka's acknowledgement

``partitioner`` decides which partition a trace id's key goes to, and must be what every
other writer of these topics uses, or a trace's spans and samples reach different correlator
workers. The default, ``sarama_compat``, is the OpenTelemetry Collector Kafka exporter's
default (``record_partitioner: {sticky_key: {hasher: sarama_compat}}``: FNV-1a 32, Sarama's
remainder; ``pipeline/kafka``), so spanprof gateways and Collector gateways with
``partition_traces_by_id: true`` and the default partitioner can share the topics. Pick
``murmur2`` (Kafka's Java client; the Collector's ``hasher: murmur2``) only when the other
writers use that. ``murmur2`` was spanprof's default before: changing the partitioner of a
running tier moves traces to other partitions (traces in flight across the change may be
split, as with a new partition count), so a tier that should keep its placement sets
``partitioner: murmur2`` explicitly.

Every message is keyed by trace (the join depends on it). Spans and samples are grouped
by partition: one message per partition a request touches, keyed by the first of its
traces (which hashes to that partition, as every other trace in it does): a 500-span
request of 50 traces is a message per partition, not 50, and a busy service's 10 s profile
(samples of thousands of traces) a few. With the partition count unknown (metadata not
reachable in time) it falls back to a message per trace. A profile message carries the
request's dictionary but, of its links, only those its samples name
(``pipeline/otlp/wire_profiles.py``), or, when those copies would add more bytes than the
request has, only what its samples reference. The producer uses
``acks=all`` and idempotence. A message over ``max_message_bytes`` is split (by spans /
samples, each half with only the dictionary entries it references) until it fits, never
refused. ``consume`` returns only when Kafka
has acknowledged every message of the batch; if Kafka is down or slow the caller gets
``Retryable`` (the receiver answers ``UNAVAILABLE``), never a success for unwritten data.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Literal

import msgspec
from aiokafka.errors import KafkaError
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.config import NonNegDuration, PositiveInt
from pipeline.errors import ConfigError, InvalidData, Retryable
from pipeline.kafka import TENANT_HEADER, ClientConfig, PartitionerName
from pipeline.kafka.backend import Producer, ProducerOptions, Producers, aiokafka_producer
from pipeline.kafka.buckets import Buckets
from pipeline.native import TOO_LARGE, profiles_split, traces_split
from pipeline.otlp.builder import encode_profiles
from pipeline.otlp.split import halve_profiles, halve_traces, split_profiles, split_traces
from pipeline.otlp.traces import WireSpans
from pipeline.otlp.wire import split_limit, split_trace_bytes, too_much
from pipeline.otlp.wire_profiles import split_profile_bytes
from pipeline.records import Batch, ProfileBatch, SpanBatch
from pipeline.registry import Context, Factory


class ProducerConfig(msgspec.Struct, forbid_unknown_fields=True):
    # snappy: the cheapest of aiokafka's codecs for a gateway's CPU (zstd: smaller messages
    # for about 1 us more per span; lz4 is aiokafka's level 9, slower still): README
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "snappy"
    max_message_bytes: PositiveInt = 1_000_000
    linger: NonNegDuration = NonNegDuration(0.005)  # 0: send at once


class Config(ClientConfig, forbid_unknown_fields=True):
    partitioner: PartitionerName = "sarama_compat"  # the Collector's default (pipeline/kafka)
    producer: ProducerConfig = msgspec.field(default_factory=ProducerConfig)

    def validate(self) -> None:
        if not self.brokers:
            raise ConfigError("brokers: at least one broker is required")
        self.validate_security()
        if self.producer.max_message_bytes < 1024:
            raise ConfigError("producer.max_message_bytes: must be at least 1024")


# room for the record's key, headers and batch framing inside max_message_bytes
_OVERHEAD = 512


class KafkaExporter:
    """``producers`` builds the Kafka client (``pipeline.kafka.backend``): aiokafka's by
    default, ``memory.MemoryBroker.producer`` in unit tests."""

    def __init__(self, cfg: Config, ctx: Context,
                 producers: Producers = aiokafka_producer) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.producers = producers
        self.producer: Producer | None = None
        self.metrics: Counter[str] = Counter()
        self._stopped = False
        self._closing: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<KafkaExporter {self.ctx.id} {self.cfg.brokers} {dict(self.metrics)}>"

    def _new_producer(self) -> Producer:
        p = self.cfg.producer
        return self.producers(ProducerOptions(
            brokers=list(self.cfg.brokers), client_id=self.cfg.client_id,
            partitioner=self.cfg.partitioner,
            compression=None if p.compression == "none" else p.compression,
            max_message_bytes=p.max_message_bytes, linger=float(p.linger),
            timeout=float(self.cfg.timeout), security=self.cfg.security()))

    async def start(self) -> None:
        self.producer = self._new_producer()
        try:
            await self.producer.start()
        except KafkaError as err:
            # A gateway must come up while Kafka is away and refuse with UNAVAILABLE; the
            # client reconnects by itself. Only a config-level failure stops the start.
            self.log.warning("kafka_unreachable_at_start", brokers=self.cfg.brokers,
                             error=str(err))
        self.log.info("kafka_producer_ready", brokers=self.cfg.brokers)

    def messages(self, batch: Batch, partitions: int = 0
                 ) -> list[tuple[str, bytes | None, bytes]]:
        """(topic, key, value) for every message this batch becomes."""
        limit = self.cfg.producer.max_message_bytes - _OVERHEAD
        out: list[tuple[str, bytes | None, bytes]] = []
        if isinstance(batch, SpanBatch):
            topic, split, halve = self.cfg.traces.topic, split_traces, halve_traces
        elif isinstance(batch, ProfileBatch):
            topic, split, halve = self.cfg.profiles.topic, split_profiles, halve_profiles
        else:
            raise TypeError(f"{self.ctx.id} does not export {batch.signal}")
        sources = batch.sources
        if not sources and len(batch):
            # records that did not arrive as OTLP (Pyroscope, pprof): encode them
            if not isinstance(batch, ProfileBatch):
                raise TypeError("span batches always carry their OTLP request")
            sources = [(encode_profiles(batch), [])]
        bucket = Buckets(self.cfg.partitioner, partitions) if partitions else None
        for req, rejected in sources:
            # always split by trace (the correlator's join depends on it), the traces of one
            # partition in one message when the partition count is known; a request's
            # bytes as received (a gateway's) are split on the wire, without parsing;
            # profiles on their bytes too when the parts can share the dictionary
            parts: dict[str, Any] | None = None
            if isinstance(req, bytes | WireSpans):
                # natively when nothing was refused (the usual request), else in Python
                # (keyed by the receiver's parse of the trace ids when it parsed)
                data, tids = (req, None) if isinstance(req, bytes) else req
                if not rejected:
                    got = traces_split(data, self.cfg.partitioner if bucket else None,
                                       partitions, split_limit(len(data)))
                    if got == TOO_LARGE:  # permanent: the same request would be again
                        raise InvalidData(f"{self.ctx.id}: {too_much(split_limit(len(data)))}")
                    parts = got if isinstance(got, dict) else None
                if parts is None:
                    parts = split_trace_bytes(data, rejected, bucket, tids)
            elif isinstance(batch, ProfileBatch):
                got = profiles_split(req.SerializeToString(), self.cfg.partitioner,
                                     partitions) if bucket and not rejected else None
                if isinstance(got, dict):
                    parts = got
                elif got is None:  # the Python path decides (COMPACT: compact at once)
                    try:
                        parts = split_profile_bytes(req, rejected, bucket)
                    except ValueError:  # a wire type upb kept but the splitter does not cut
                        parts = None
            if parts is None:
                parts = split(req, rejected, bucket_of=bucket)
            for key, msg in parts.items():
                pending = [msg]
                while pending:
                    m = pending.pop()
                    data = m if isinstance(m, bytes) else m.SerializeToString()
                    if len(data) > limit:
                        if isinstance(m, bytes):
                            m = (ExportTraceServiceRequest if isinstance(batch, SpanBatch)
                                 else ExportProfilesServiceRequest).FromString(m)
                        smaller = halve(m)
                        if len(smaller) > 1:
                            self.metrics["split_messages"] += 1
                            pending.extend(smaller)
                            continue
                        # permanent: the same item would be refused again (nothing of the
                        # batch is sent yet); the client is told, not asked to retry
                        raise InvalidData(f"{self.ctx.id}: one item is {len(data)} bytes, "
                                          "over producer.max_message_bytes")
                    out.append((topic, key.encode() if key else None, data))
        return out

    async def consume(self, batch: Batch) -> None:
        if self.producer is None or self._stopped:
            raise Retryable(f"{self.ctx.id}: not running")
        topic = self.cfg.profiles.topic if isinstance(batch, ProfileBatch) \
            else self.cfg.traces.topic
        try:
            partitions = len(await asyncio.wait_for(self.producer.partitions_for(topic),
                                                    timeout=float(self.cfg.timeout)))
        except (KafkaError, TimeoutError):
            partitions = 0  # per-trace messages: slower, still correct
        msgs = self.messages(batch, partitions)
        producer = self.producer

        # whose data it is travels beside it: the consumer's batches are that tenant's
        headers = [(TENANT_HEADER, batch.tenant.encode())]

        async def send_all() -> None:
            futures = [await producer.send(t, value=v, key=k, headers=headers)
                       for t, k, v in msgs]
            await asyncio.gather(*futures)

        try:
            await asyncio.wait_for(send_all(), timeout=float(self.cfg.timeout))
        except (KafkaError, TimeoutError) as err:
            self.metrics["send_failed_messages"] += len(msgs)
            await self._reset_producer()
            raise Retryable(f"{self.ctx.id}: Kafka did not acknowledge the write: "
                            f"{type(err).__name__} {err}", retry_after=5.0) from None
        self.metrics["sent_messages"] += len(msgs)
        self.metrics[f"sent_{'spans' if isinstance(batch, SpanBatch) else 'samples'}"] += \
            len(batch)

    async def _reset_producer(self) -> None:
        """Replace the producer after a failed send.

        Batches that timed out leave gaps in the idempotent producer's sequence numbers,
        which the broker then refuses for good (OutOfOrderSequence); a new producer gets a
        new producer id. The failed messages were reported as not written, so the clients
        resend them: at least once, never silently dropped.
        """
        old, self.producer = self.producer, self._new_producer()
        self.metrics["producer_resets"] += 1
        try:
            await self.producer.start()
        except KafkaError as err:
            self.log.warning("kafka_unreachable", error=str(err))
        if old is not None:
            task = asyncio.create_task(self._close_quietly(old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, producer: Producer) -> None:
        try:
            await asyncio.wait_for(producer.stop(), timeout=float(self.cfg.timeout))
        except (KafkaError, TimeoutError):
            pass

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self.producer is not None:
            try:
                await self.producer.stop()  # flushes what is in flight
            except KafkaError as err:
                self.log.warning("kafka_stop_failed", error=str(err))


def create(cfg: Config, ctx: Context) -> KafkaExporter:
    return KafkaExporter(cfg, ctx)


FACTORY = Factory(type="kafka", kind="exporter", config=Config, create=create,
                  signals=("traces", "profiles"), records=False)

"""What the ``kafka`` exporter and receiver need of a Kafka client, and nothing more.

The exporter produces (``Producer``), the receiver consumes as one member of a consumer
group (``Consumer``). Typing them against these small interfaces instead of aiokafka's
whole clients keeps the I/O swappable: each component is given a factory (``Producers`` /
``Consumers``) that builds its client from the few settings it has (``ProducerOptions`` /
``ConsumerOptions``); by default the aiokafka adapters below, in unit tests the in-memory
broker of ``pipeline.kafka.memory``, in integration tests the real broker.

The adapters are thin, and are where aiokafka's private calls are kept, out of the
components: reading committed offsets *with* their metadata (aiokafka's public
``committed()`` drops the metadata, where the receiver keeps its block plan, see
``pipeline.kafka.blocks``) goes through the group coordinator, refreshing the topic
metadata through the client.

The error contract is part of the interface even though a protocol cannot state it: an
implementation raises aiokafka's errors (``aiokafka.errors.KafkaError`` subclasses for
what Kafka did, ``IllegalStateError`` for a partition that is not assigned), so that the
components' failure handling runs the same on the fake as on the broker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.structs import TopicPartition

from pipeline.kafka import PartitionerName, partitioner

__all__ = ["AioConsumer", "AioProducer", "Consumer", "ConsumerOptions", "Consumers",
           "Producer", "ProducerOptions", "Producers", "RebalanceListener", "Record",
           "TopicPartition", "aiokafka_consumer", "aiokafka_producer"]

# what a commit stores per partition: the next offset to read, and metadata (a block plan)
Committed = Mapping[TopicPartition, tuple[int, str]]


@dataclass(frozen=True)
class ProducerOptions:
    """The exporter's producer settings (``acks=all`` and idempotence are not options)."""

    brokers: list[str]
    client_id: str
    partitioner: PartitionerName
    compression: str | None
    max_message_bytes: int
    linger: float  # seconds
    timeout: float  # seconds, for Kafka's acknowledgement
    # aiokafka's TLS and SASL arguments (pipeline/kafka/security.py); empty: plain text
    security: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConsumerOptions:
    """The receiver's consumer settings (manual commits and the range assignor are not
    options: the plans and the join depend on them)."""

    brokers: list[str]
    client_id: str
    group_id: str
    initial_offset: Literal["earliest", "latest"]
    max_poll_records: int
    session_timeout: float  # seconds
    heartbeat_interval: float  # seconds
    timeout: float  # seconds
    security: dict[str, Any] = field(default_factory=dict)  # as ProducerOptions'


class Record(Protocol):
    """A fetched message: the part of aiokafka's ``ConsumerRecord`` that is read."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...  # ms since the epoch (CreateTime: the producer's clock)
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


class Producer(Protocol):
    async def start(self) -> None:
        """Connect; raises a ``KafkaError`` if Kafka is unreachable (the producer still
        reconnects by itself afterwards)."""

    async def stop(self) -> None:
        """Flush what is in flight and close; idempotent."""

    async def partitions_for(self, topic: str) -> set[int]:
        """The topic's partition ids (``UnknownTopicOrPartitionError`` if it has none)."""

    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> Awaitable[object]:
        """Queue one message (with ``headers``) on the partition the configured
        partitioner picks for ``key``; the returned awaitable resolves once Kafka
        acknowledged it (or raises)."""


class RebalanceListener(Protocol):
    async def on_partitions_revoked(self, revoked: Collection[TopicPartition]) -> None: ...
    async def on_partitions_assigned(self, assigned: Collection[TopicPartition]) -> None: ...


class Consumer(Protocol):
    """One member of a consumer group, committing by hand."""

    def subscribe(self, topics: list[str], listener: RebalanceListener) -> None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    def partitions(self, topic: str) -> set[int] | None:
        """The topic's partitions as far as the metadata known so far says (None: unknown;
        ``refresh_metadata`` asks again)."""

    async def refresh_metadata(self) -> None: ...

    async def committed(self, tps: Collection[TopicPartition]
                        ) -> dict[TopicPartition, tuple[int, str]]:
        """The group's committed (offset, metadata) of those partitions that have one."""

    async def commit(self, offsets: Committed) -> None:
        """Commit (next offset, metadata) per partition; ``IllegalStateError`` for a
        partition not assigned to this member."""

    async def getmany(self, *, timeout_ms: int) -> dict[TopicPartition, list[Record]]:
        """Up to ``max_poll_records`` messages of the assigned, unpaused partitions from
        their positions, waiting up to ``timeout_ms`` for any."""

    def assignment(self) -> set[TopicPartition]: ...

    def highwater(self, tp: TopicPartition) -> int | None:
        """The partition's end offset as of its last fetch (None before one)."""

    async def position(self, tp: TopicPartition) -> int:
        """The next offset ``getmany`` returns for ``tp``."""

    def seek(self, tp: TopicPartition, offset: int) -> None: ...
    def pause(self, *tps: TopicPartition) -> None: ...
    def resume(self, *tps: TopicPartition) -> None: ...
    def paused(self) -> set[TopicPartition]: ...


Producers = Callable[[ProducerOptions], Producer]
Consumers = Callable[[ConsumerOptions], Consumer]


class AioProducer:
    """``Producer`` on aiokafka's ``AIOKafkaProducer`` (``acks=all``, idempotent)."""

    def __init__(self, opts: ProducerOptions) -> None:
        self.opts = opts
        self.client = AIOKafkaProducer(
            bootstrap_servers=opts.brokers, client_id=opts.client_id, acks="all",
            enable_idempotence=True, compression_type=opts.compression,
            max_request_size=opts.max_message_bytes, linger_ms=int(opts.linger * 1000),
            max_batch_size=batch_bytes(opts.max_message_bytes),
            request_timeout_ms=int(opts.timeout * 1000),
            partitioner=partitioner(opts.partitioner), **opts.security)

    def __repr__(self) -> str:
        return f"<AioProducer {self.opts.brokers} {self.opts.partitioner}>"

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    async def partitions_for(self, topic: str) -> set[int]:
        return set(await self.client.partitions_for(topic))

    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> Awaitable[object]:
        fut: Awaitable[object] = await self.client.send(topic, value=value, key=key,
                                                        headers=headers)
        return fut


def batch_bytes(max_message_bytes: int) -> int:
    """aiokafka's ``max_batch_size``: how many bytes (uncompressed) of one partition's
    messages go into one record batch. Its default, 16 KiB, is below one message of a
    500-span request's partition (about 35 KB): each message was then a batch of its own
    (its own compression, CRC and produce entry), and a second message for a partition
    whose batch was still lingering waited for that batch to be sent. Half of
    ``max_message_bytes`` lets the messages of concurrent requests share batches while a
    compressed batch stays under the broker's limit even when compression makes it
    larger (snappy's worst case is +1/6). The gateway went from about 10.9 to 7.2-8.7 us
    of CPU per span and the broker's CPU fell by about 40% (``../shared/bench/collector``).
    A single message larger than this is still sent, as a batch of its own."""
    return max(16384, max_message_bytes // 2)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """aiokafka accepts only its own listener class: forwards to ours."""

    def __init__(self, to: RebalanceListener) -> None:
        self.to = to

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.to.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self.to.on_partitions_assigned(assigned)


class AioConsumer:
    """``Consumer`` on aiokafka's ``AIOKafkaConsumer``: manual commits, the range assignor
    (one worker gets the same partitions of both topics)."""

    def __init__(self, opts: ConsumerOptions) -> None:
        self.opts = opts
        self.client = AIOKafkaConsumer(
            bootstrap_servers=opts.brokers, client_id=opts.client_id,
            group_id=opts.group_id, enable_auto_commit=False,
            auto_offset_reset=opts.initial_offset,
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_poll_records=opts.max_poll_records,
            session_timeout_ms=int(opts.session_timeout * 1000),
            heartbeat_interval_ms=int(opts.heartbeat_interval * 1000),
            request_timeout_ms=int(opts.timeout * 1000) + 30_000, **opts.security)

    def __repr__(self) -> str:
        return f"<AioConsumer {self.opts.brokers} group={self.opts.group_id}>"

    def subscribe(self, topics: list[str], listener: RebalanceListener) -> None:
        self.client.subscribe(topics, listener=_Listener(listener))

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    def partitions(self, topic: str) -> set[int] | None:
        parts = self.client.partitions_for_topic(topic)
        return set(parts) if parts is not None else None

    async def refresh_metadata(self) -> None:
        await self.client._client.force_metadata_update()  # private: no public call

    async def committed(self, tps: Collection[TopicPartition]
                        ) -> dict[TopicPartition, tuple[int, str]]:
        # private: the public committed() returns the offset without its metadata
        got = await self.client._coordinator.fetch_committed_offsets(list(tps))
        return {tp: (om.offset, om.metadata) for tp, om in got.items()}

    async def commit(self, offsets: Committed) -> None:
        await self.client.commit(dict(offsets))

    async def getmany(self, *, timeout_ms: int) -> dict[TopicPartition, list[Record]]:
        got: dict[TopicPartition, list[Record]] = await self.client.getmany(
            timeout_ms=timeout_ms)
        return got

    def assignment(self) -> set[TopicPartition]:
        return set(self.client.assignment())

    def highwater(self, tp: TopicPartition) -> int | None:
        high: int | None = self.client.highwater(tp)
        return high

    async def position(self, tp: TopicPartition) -> int:
        return int(await self.client.position(tp))

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.client.seek(tp, offset)

    def pause(self, *tps: TopicPartition) -> None:
        self.client.pause(*tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.client.resume(*tps)

    def paused(self) -> set[TopicPartition]:
        return set(self.client.paused())


def aiokafka_producer(opts: ProducerOptions) -> Producer:
    return AioProducer(opts)


def aiokafka_consumer(opts: ConsumerOptions) -> Consumer:
    return AioConsumer(opts)

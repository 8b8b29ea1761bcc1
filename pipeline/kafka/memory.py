"""In-memory Kafka for unit tests: a broker, its producers and one consumer per group.

``MemoryBroker`` keeps topics of N partitions as lists of aiokafka ``ConsumerRecord``s
(offsets from 0, CreateTime timestamps from the broker's ``clock`` unless given) and each
group's committed (offset, metadata). Its ``producer`` and ``consumer`` methods are
``backend.Producers`` / ``backend.Consumers`` factories, given to the exporter and the
receiver in place of aiokafka's:

* ``MemoryProducer`` picks partitions with the configured partitioner (the very function
  given to aiokafka, ``pipeline.kafka.partitioner``), writes at once and acknowledges on
  the next turn of the event loop;
* ``MemoryConsumer`` (``memory_consumer.py``) is the group's only member, assigned every
  partition of its topics.

Failures on demand (``fail``): an operation (``start``, ``metadata``, ``send``, ``ack``,
``fetch``: ``getmany`` and reading committed offsets, ``commit``) raises the given aiokafka
error, for the next ``times`` calls or until ``recover()``; an error of None is a broker
that does not answer (the caller's timeout fires); ``lands=True`` stores a send or commit
whose answer is then lost. ``unreachable()`` and ``timed_out()`` build the errors aiokafka
raises for a broker that is down or slow.
Checked against the real broker in ``tests/pipeline/test_kafka_memory.py``.

Not imitated: rebalances (a second live member of a group is refused), retention and
compaction, transactions, compression, topics created after a consumer started (headers
are kept as sent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    ProducerClosed,
    UnknownTopicOrPartitionError,
)
from aiokafka.structs import ConsumerRecord, RecordMetadata

from pipeline.kafka import partitioner
from pipeline.kafka.backend import ConsumerOptions, ProducerOptions, TopicPartition

if TYPE_CHECKING:
    from pipeline.kafka.memory_consumer import MemoryConsumer

Op = Literal["start", "metadata", "send", "ack", "fetch", "commit"]
Error = BaseException | type[BaseException]
# what a record adds to its key and value in a batch, about (aiokafka's estimate)
RECORD_OVERHEAD = 80


def unreachable(broker: str = "127.0.0.1:9092") -> KafkaConnectionError:
    """What aiokafka raises when no broker answers (``start``, a lost connection)."""
    host, _, port = broker.rpartition(":")
    return KafkaConnectionError(f"Unable to bootstrap from [('{host}', {port}, "
                                "<AddressFamily.AF_UNSPEC: 0>)]")


def timed_out() -> KafkaTimeoutError:
    """What a send's acknowledgement fails with when the broker did not answer in time."""
    return KafkaTimeoutError()


@dataclass
class _Fault:
    error: Error | None
    ops: frozenset[str]
    times: int | None
    lands: bool


def raised(error: Error) -> BaseException:
    """The exception to raise for a fault's error (a class is instantiated)."""
    return error() if isinstance(error, type) else error


class MemoryBroker:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.logs: dict[str, list[list[ConsumerRecord[bytes, bytes]]]] = {}
        self.groups: dict[str, dict[TopicPartition, tuple[int, str]]] = {}
        self.members: dict[str, MemoryConsumer] = {}
        self.producers: list[MemoryProducer] = []
        self._faults: list[_Fault] = []
        self._waiters: set[asyncio.Future[None]] = set()

    def __repr__(self) -> str:
        sizes = {t: [len(p) for p in parts] for t, parts in self.logs.items()}
        return f"<MemoryBroker topics={sizes} groups={sorted(self.groups)} " \
               f"faults={len(self._faults)}>"

    def create_topic(self, name: str, partitions: int = 1) -> None:
        if name in self.logs:
            raise ValueError(f"MemoryBroker: topic {name!r} exists")
        self.logs[name] = [[] for _ in range(partitions)]

    def append(self, topic: str, value: bytes, *, partition: int = 0,
               key: bytes | None = None, timestamp_ms: int | None = None,
               headers: list[tuple[str, bytes]] | None = None
               ) -> ConsumerRecord[bytes, bytes]:
        """Write one message, as any producer could (a test's raw producer)."""
        log = self._log(TopicPartition(topic, partition))
        rec = ConsumerRecord(
            topic, partition, len(log),
            int(self.clock() * 1000) if timestamp_ms is None else timestamp_ms, 0, key, value,
            None, len(key) if key is not None else -1, len(value), tuple(headers or ()))
        log.append(rec)
        self._wake()
        return rec

    def records(self, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
        """Every message of the topic, partition by partition."""
        return [r for part in self.logs[topic] for r in part]

    def committed(self, group: str, tp: TopicPartition) -> tuple[int, str] | None:
        return self.groups.get(group, {}).get(tp)

    def fail(self, error: Error | None, *, ops: Iterable[Op] = ("send", "ack"),
             times: int | None = None, lands: bool = False) -> None:
        """Make ``ops`` raise ``error`` (None: never answer) for ``times`` calls, or until
        ``recover``; with ``lands`` a send or commit is stored before its answer is lost."""
        self._faults.append(_Fault(error, frozenset(ops), times, lands))

    def recover(self) -> None:
        self._faults.clear()

    def producer(self, opts: ProducerOptions) -> MemoryProducer:
        p = MemoryProducer(self, opts)
        self.producers.append(p)
        return p

    def consumer(self, opts: ConsumerOptions) -> MemoryConsumer:
        from pipeline.kafka.memory_consumer import MemoryConsumer

        return MemoryConsumer(self, opts)

    def _log(self, tp: TopicPartition) -> list[ConsumerRecord[bytes, bytes]]:
        parts = self.logs.get(tp.topic)
        if parts is None or not 0 <= tp.partition < len(parts):
            raise UnknownTopicOrPartitionError(f"{tp.topic}/{tp.partition}")
        return parts[tp.partition]

    def _fault(self, op: Op) -> _Fault | None:
        for f in self._faults:
            if op in f.ops:
                if f.times is not None:
                    f.times -= 1
                    if f.times <= 0:
                        self._faults.remove(f)
                return f
        return None

    async def _gate(self, op: Op) -> _Fault | None:
        """Fail ``op`` as told: raise, or hang until cancelled; a fault that lands is
        returned for the caller to store first."""
        f = self._fault(op)
        if f is None or f.lands:
            return f
        if f.error is None:
            await asyncio.Event().wait()
        assert f.error is not None
        raise raised(f.error)

    def _wake(self) -> None:
        """Something to fetch may have changed: waiting ``getmany`` calls look again."""
        for w in self._waiters:
            if not w.done():
                w.set_result(None)

    async def _wait(self, within: float) -> None:
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(w)
        try:
            await asyncio.wait_for(w, within)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(w)


class MemoryProducer:
    """``backend.Producer`` writing to a ``MemoryBroker``."""

    def __init__(self, broker: MemoryBroker, opts: ProducerOptions) -> None:
        self.broker = broker
        self.opts = opts
        self.state: Literal["new", "started", "failed", "stopped"] = "new"
        self.sent = 0
        self._choose = partitioner(opts.partitioner)

    def __repr__(self) -> str:
        return f"<MemoryProducer {self.state} sent={self.sent} {self.opts.partitioner}>"

    async def start(self) -> None:
        self.state = "failed"
        await self.broker._gate("start")
        self.state = "started"

    async def stop(self) -> None:
        self.state = "stopped"

    async def partitions_for(self, topic: str) -> set[int]:
        await self.broker._gate("metadata")
        if topic not in self.broker.logs:
            raise UnknownTopicOrPartitionError(topic)
        return set(range(len(self.broker.logs[topic])))

    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> Awaitable[object]:
        if self.state == "stopped":
            raise ProducerClosed()
        parts = sorted(await self.partitions_for(topic))
        size = len(value) + len(key or b"") + RECORD_OVERHEAD + sum(
            len(k) + len(v) for k, v in headers or ())
        if size > self.opts.max_message_bytes:
            raise MessageSizeTooLargeError(f"The message is {size} bytes when serialized")
        await self.broker._gate("send")
        loop = asyncio.get_running_loop()
        ack: asyncio.Future[object] = loop.create_future()
        if self.state != "started":  # never connected: nothing is sent, the wait expires
            loop.call_later(self.opts.timeout, _settle, ack, None, KafkaTimeoutError())
            return ack
        fault = self.broker._fault("ack")
        if fault is not None and not fault.lands:  # lost on the way: not stored
            if fault.error is not None:  # (None: no answer at all, the caller times out)
                loop.call_soon(_settle, ack, None, raised(fault.error))
            return ack
        rec = self.broker.append(topic, value, partition=self._choose(key, parts, parts),
                                 key=key, headers=headers)
        self.sent += 1
        if fault is not None:  # stored, the acknowledgement lost
            if fault.error is not None:
                loop.call_soon(_settle, ack, None, raised(fault.error))
            return ack
        loop.call_soon(_settle, ack, RecordMetadata(
            topic, rec.partition, TopicPartition(topic, rec.partition), rec.offset,
            rec.timestamp, 0, 0), None)
        return ack


def _settle(fut: asyncio.Future[object], result: object, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

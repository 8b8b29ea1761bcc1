"""The in-memory broker (``pipeline.kafka.memory``), and against the real one.

``TestFakeMatchesKafka`` runs the same script of consumer calls on both, the semantics the
receiver relies on: its ``real`` case needs the real broker (``tests/kafka_broker.py``),
``-k "not real"`` leaves it out.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.errors import (
    IllegalStateError,
    KafkaConnectionError,
    KafkaTimeoutError,
    OffsetMetadataTooLargeError,
)

from pipeline.kafka import PARTITIONERS
from pipeline.kafka.backend import (
    Consumer,
    ConsumerOptions,
    ProducerOptions,
    TopicPartition,
    aiokafka_consumer,
)
from pipeline.kafka.memory import MemoryBroker, timed_out, unreachable


@dataclass
class World:
    """One backend to run the consumer script on: write a message, build a consumer."""

    topic: str
    append: Callable[[bytes, int], Awaitable[None]]
    consumer: Callable[[str], Consumer]


class Assigned:
    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.tps: set[TopicPartition] = set()

    async def on_partitions_revoked(self, revoked: Collection[TopicPartition]) -> None:
        self.tps -= set(revoked)

    async def on_partitions_assigned(self, assigned: Collection[TopicPartition]) -> None:
        self.tps |= set(assigned)
        self.event.set()


def _options(group: str, bootstrap: str = "memory") -> ConsumerOptions:
    return ConsumerOptions(brokers=[bootstrap], client_id="t", group_id=group,
                           initial_offset="earliest", max_poll_records=100,
                           session_timeout=10.0, heartbeat_interval=3.0, timeout=10.0)


@pytest.fixture(params=["fake", "real"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    topic = f"contract_{uuid.uuid4().hex[:8]}"
    if request.param == "fake":
        mem = MemoryBroker()
        mem.create_topic(topic, 2)

        async def put(value: bytes, partition: int) -> None:
            mem.append(topic, value, partition=partition)

        yield World(topic, put, lambda g: mem.consumer(_options(g)))
        return
    from aiokafka import AIOKafkaProducer

    from tests.kafka_broker import create_topics

    kafka = request.getfixturevalue("kafka_broker")
    await create_topics(kafka.bootstrap, topic, partitions=2)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
    await producer.start()

    async def send(value: bytes, partition: int) -> None:
        await producer.send_and_wait(topic, value, partition=partition)

    try:
        yield World(topic, send, lambda g: aiokafka_consumer(_options(g, kafka.bootstrap)))
    finally:
        await producer.stop()


async def _fetch(c: Consumer, n: int) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(20):
        while len(out) < n:
            for recs in (await c.getmany(timeout_ms=200)).values():
                out.extend(recs)
    return out


async def _member(world: World, group: str) -> tuple[Consumer, Assigned]:
    c, listener = world.consumer(group), Assigned()
    c.subscribe([world.topic], listener)
    await c.start()
    await asyncio.wait_for(listener.event.wait(), 30)
    return c, listener


class TestFakeMatchesKafka:
    async def test_what_the_receiver_relies_on(self, world: World) -> None:
        """The same consumer calls give the same answers on the in-memory broker and the
        real one: assignment of every partition, records with offsets and timestamps,
        highwater and position, seek then getmany, pause and resume, commit metadata
        round trip to the next member, errors for partitions not assigned and for metadata
        over 4096 bytes."""
        tp = TopicPartition(world.topic, 0)
        for i in range(5):
            await world.append(b"m%d" % i, 0)
        group = f"g-{uuid.uuid4().hex[:6]}"
        c, listener = await _member(world, group)
        assert listener.tps == {tp, TopicPartition(world.topic, 1)} == c.assignment()
        assert c.partitions(world.topic) == {0, 1}
        assert await c.committed([tp]) == {}
        assert await c.position(tp) == 0
        got = await _fetch(c, 5)
        assert [(r.topic, r.partition, r.offset, r.value, r.key) for r in got] == \
            [(world.topic, 0, i, b"m%d" % i, None) for i in range(5)]
        assert all(isinstance(r.timestamp, int) and r.timestamp > 1e12 for r in got)
        assert c.highwater(tp) == 5 and await c.position(tp) == 5

        c.seek(tp, 2)
        assert [r.offset for r in await _fetch(c, 3)] == [2, 3, 4]
        c.pause(tp)
        assert c.paused() == {tp}
        await world.append(b"m5", 0)
        assert tp not in await c.getmany(timeout_ms=300)
        c.resume(tp)
        assert c.paused() == set()
        assert [r.offset for r in await _fetch(c, 1)] == [5]

        await c.commit({tp: (6, "spb1:0-5")})
        other = TopicPartition("not_assigned", 0)
        with pytest.raises(IllegalStateError):
            c.seek(other, 0)
        with pytest.raises(IllegalStateError):
            c.pause(other)
        with pytest.raises(IllegalStateError):
            await c.commit({other: (1, "")})
        with pytest.raises(OffsetMetadataTooLargeError):
            await c.commit({tp: (6, "x" * 5000)})
        await c.stop()

        c2, _ = await _member(world, group)
        try:
            assert await c2.committed([tp, TopicPartition(world.topic, 1)]) == \
                {tp: (6, "spb1:0-5")}
            assert await c2.position(tp) == 6
        finally:
            await c2.stop()


class TestFake:
    async def test_max_poll_records_taken_in_turns(self) -> None:
        """With a backlog on two partitions and one record per fetch, neither starves."""
        b = MemoryBroker()
        b.create_topic("t", 2)
        for i in range(4):
            b.append("t", b"%d" % i, partition=i % 2)
        c = b.consumer(ConsumerOptions(**{**_options("g").__dict__, "max_poll_records": 1}))
        c.subscribe(["t"], Assigned())
        await c.start()
        assert c.highwater(TopicPartition("t", 0)) is None  # before any fetch
        got = [tp.partition for _ in range(4) for tp in await c.getmany(timeout_ms=0)]
        assert sorted(got[:2]) == [0, 1] and sorted(got) == [0, 0, 1, 1]

    async def test_getmany_wakes_on_a_write(self) -> None:
        """A fetch waiting for messages returns as soon as one is written."""
        b = MemoryBroker()
        b.create_topic("t", 1)
        c = b.consumer(_options("g"))
        c.subscribe(["t"], Assigned())
        await c.start()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: b.append("t", b"late"))
        t0 = loop.time()
        got = await c.getmany(timeout_ms=5000)
        assert [r.value for r in got[TopicPartition("t", 0)]] == [b"late"]
        assert loop.time() - t0 < 1.0

    async def test_latest_starts_at_the_end_and_one_live_member(self) -> None:
        b = MemoryBroker()
        b.create_topic("t", 1)
        b.append("t", b"old")
        c = b.consumer(ConsumerOptions(**{**_options("g").__dict__,
                                          "initial_offset": "latest"}))
        c.subscribe(["t"], Assigned())
        await c.start()
        assert await c.position(TopicPartition("t", 0)) == 1
        second = b.consumer(_options("g"))
        second.subscribe(["t"], Assigned())
        with pytest.raises(RuntimeError, match="one member per group"):
            await second.start()
        await c.stop()
        await second.start()

    async def test_producer_partitions_and_faults(self) -> None:
        """The producer picks the configured partitioner's partition; faults raise the
        aiokafka errors asked for, once, and a landing fault stores the message."""
        b = MemoryBroker(clock=lambda: 1234.5)
        b.create_topic("t", 6)
        p = b.producer(ProducerOptions(brokers=["memory"], client_id="t",
                                       partitioner="murmur2", compression=None,
                                       max_message_bytes=1_000_000, linger=0, timeout=1.0))
        b.fail(unreachable(), ops=["start"], times=1)
        with pytest.raises(KafkaConnectionError):
            await p.start()
        await p.start()
        meta: Any = await (await p.send("t", b"v", key=b"k"))
        assert meta.partition == PARTITIONERS["murmur2"](b"k", 6) and meta.offset == 0
        assert b.records("t")[0].timestamp == 1_234_500
        b.fail(timed_out(), ops=["ack"], times=1, lands=True)
        with pytest.raises(KafkaTimeoutError):
            await (await p.send("t", b"w", key=b"k"))
        assert [r.value for r in b.records("t")] == [b"v", b"w"]
        await (await p.send("t", b"x", key=b"k"))
        assert len(b.records("t")) == 3

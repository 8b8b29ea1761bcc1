"""The Kafka exporter and receiver on the in-memory broker (``pipeline.kafka.memory``), and
the in-memory broker itself against the real one.

The behaviours ``test_kafka.py`` proves on the real broker, here in a fraction of a second
each and with failures the real broker cannot be made to produce on cue (an acknowledgement
lost, a commit refused once). ``TestFakeMatchesKafka`` runs the same script of consumer
calls on both, the semantics the receiver relies on: its ``real`` case needs the real
broker (``tests/kafka_broker.py``), ``-k "not real"`` leaves it out.
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
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.errors import ConfigError, Retryable
from pipeline.exporters.kafka import Config as ExporterConfig
from pipeline.exporters.kafka import KafkaExporter, ProducerConfig
from pipeline.kafka import PARTITIONERS, PartitionerName
from pipeline.kafka.backend import (
    Consumer,
    ConsumerOptions,
    ProducerOptions,
    TopicPartition,
    aiokafka_consumer,
)
from pipeline.kafka.memory import MemoryBroker, timed_out, unreachable
from pipeline.kafka.memory_consumer import MemoryConsumer
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.kafka import Config as ReceiverConfig
from pipeline.receivers.kafka import KafkaReceiver
from pipeline.records import Batch, ProfileBatch, SpanBatch
from pipeline.registry import Context
from tests.pipeline import kafka_keyed
from tests.pipeline.receivers.test_otlp_grpc import TID, span_request

PARTITIONS = 6
SPANS, PROFILES = "otlp_spans", "otlp_profiles"


@pytest.fixture
def broker() -> MemoryBroker:
    b = MemoryBroker()
    b.create_topic(SPANS, PARTITIONS)
    b.create_topic(PROFILES, PARTITIONS)
    return b


def _exporter(broker: MemoryBroker, **kw: Any) -> KafkaExporter:
    cfg = ExporterConfig(**{"timeout": 1.0, **kw})
    cfg.validate()
    return KafkaExporter(cfg, Context("kafka", ["traces", "profiles"]),
                         producers=broker.producer)


def _sample_request(sids: list[bytes], trace_id: bytes = TID) -> bytes:
    b = ProfileBuilder()
    for sid in sids:
        b.sample(["f"], 10, trace_id, sid, service="s")
    return bytes(b.build().SerializeToString())


def _spans(value: bytes | None) -> list[Any]:
    assert value is not None
    return [s for rs in tps.ExportTraceServiceRequest.FromString(value).resource_spans
            for ss in rs.scope_spans for s in ss.spans]


class TestExporter:
    @pytest.mark.parametrize("name", [None, "murmur2"])
    async def test_messages_per_partition_keyed_and_copartitioned(
            self, broker: MemoryBroker, name: PartitionerName | None) -> None:
        """One message per partition per request, keyed by one of its traces, on the
        configured partitioner's partition (unset: sarama_compat's); a trace's samples go
        where its spans went; unlinked samples go unkeyed."""
        ex = _exporter(broker, **({"partitioner": name} if name else {}))
        part = PARTITIONERS[name or "sarama_compat"]
        await ex.start()
        await kafka_keyed.send_load(ex)
        kafka_keyed.check(part, PARTITIONS, ex, broker.records(SPANS), broker.records(PROFILES))
        assert repr(broker.producers[0]).startswith("<MemoryProducer stopped sent=")

    async def test_big_trace_is_split_under_max_message_bytes(
            self, broker: MemoryBroker) -> None:
        """A trace over max_message_bytes becomes several messages with one key, each of
        which the producer accepts (the fake refuses what aiokafka would)."""
        ex = _exporter(broker, producer=ProducerConfig(max_message_bytes=4096))
        await ex.start()
        await ex.consume(decode_traces(span_request(
            [i.to_bytes(8, "big") for i in range(1, 301)])).batch)
        await ex.shutdown()
        recs = broker.records(SPANS)
        assert ex.metrics["split_messages"] > 0 and len(recs) == ex.metrics["sent_messages"]
        assert sorted(s.span_id for r in recs for s in _spans(r.value)) == \
            sorted(i.to_bytes(8, "big") for i in range(1, 301))
        assert all(len(r.value or b"") <= 4096 for r in recs) and len({r.key for r in recs}) == 1

    @pytest.mark.parametrize("error", [unreachable(), timed_out()],
                             ids=["connection", "timeout"])
    async def test_a_failed_send_is_retryable_and_replaces_the_producer(
            self, broker: MemoryBroker, error: Exception) -> None:
        """Kafka not acknowledging a message is Retryable, never a success; the producer is
        replaced (its idempotence sequence has a gap now) and the next batch goes out."""
        ex = _exporter(broker)
        await ex.start()
        broker.fail(error, ops=["ack"], times=1)
        batch = decode_traces(span_request([b"\x01" * 8])).batch
        with pytest.raises(Retryable, match=f"Kafka did not acknowledge the write: "
                                            f"{type(error).__name__}"):
            await ex.consume(batch)
        assert ex.metrics["producer_resets"] == 1 and ex.metrics["send_failed_messages"] == 1
        assert broker.records(SPANS) == []
        await ex.consume(batch)
        await ex.shutdown()
        assert [p.state for p in broker.producers] == ["stopped", "stopped"]
        assert [p.sent for p in broker.producers] == [0, 1]

    async def test_no_answer_times_out_as_retryable(self, broker: MemoryBroker) -> None:
        """A broker that takes the message and never answers: Retryable after ``timeout``."""
        ex = _exporter(broker, timeout=0.2)
        await ex.start()
        broker.fail(None, ops=["ack"])
        with pytest.raises(Retryable, match="TimeoutError"):
            await ex.consume(decode_traces(span_request([b"\x01" * 8])).batch)
        await ex.shutdown()

    async def test_kafka_down_at_start_comes_up_then_refuses_until_back(
            self, broker: MemoryBroker) -> None:
        """Kafka unreachable at start: the exporter starts anyway (a gateway must come up
        and answer UNAVAILABLE); its first batch is Retryable, the one after the producer
        was replaced goes out."""
        ex = _exporter(broker, timeout=0.2)
        broker.fail(unreachable(), ops=["start"], times=1)
        await ex.start()
        batch = decode_traces(span_request([b"\x01" * 8])).batch
        with pytest.raises(Retryable):
            await ex.consume(batch)
        await ex.consume(batch)
        await ex.shutdown()
        assert [p.sent for p in broker.producers] == [0, 1]


class Recorder:
    """A downstream consumer that refuses its first ``failures`` batches."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.batches: list[Batch] = []

    async def consume(self, batch: Batch) -> None:
        if self.failures:
            self.failures -= 1
            raise Retryable("sink down")
        self.batches.append(batch)


def _receiver(broker: MemoryBroker, sink: Recorder, group: str = "g",
              **kw: Any) -> KafkaReceiver:
    cfg = ReceiverConfig(group_id=group, **kw)
    cfg.validate()
    return KafkaReceiver(cfg, Context("kafka", ["traces", "profiles"],
                                      next={"traces": sink, "profiles": sink}),
                         consumers=broker.consumer)


async def _committed(r: KafkaReceiver, n: int, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while r.metrics["committed_messages"] < n:
            await asyncio.sleep(0.01)


class TestReceiver:
    async def test_garbage_skipped_offsets_committed(self, broker: MemoryBroker) -> None:
        """Messages of any producer are read, a garbage message is skipped and counted,
        and the committed offsets cover it, with no plan left in their metadata."""
        broker.append(SPANS, span_request([b"\x01" * 8]).SerializeToString())
        broker.append(SPANS, b"\xff\xff not protobuf")
        broker.append(PROFILES, _sample_request([b"\x03" * 8], b"\x02" * 16))
        sink = Recorder()
        r = _receiver(broker, sink)
        await r.start()
        await _committed(r, 3)
        await r.shutdown()
        assert r.metrics["malformed_messages"] == 1
        assert sorted(b.signal for b in sink.batches) == ["profiles", "traces"]
        assert broker.committed("g", TopicPartition(SPANS, 0)) == (2, "")
        assert broker.committed("g", TopicPartition(PROFILES, 0)) == (1, "")

    async def test_refusing_sink_pauses_then_delivers_once(self, broker: MemoryBroker) -> None:
        """While downstream refuses, the partition is paused and rewound; once it accepts,
        every message is delivered once, as the same block (same origin), and nothing
        stays paused."""
        for i in range(5):
            broker.append(SPANS, span_request([(i + 1).to_bytes(8, "big")])
                          .SerializeToString(), partition=1)
        sink = Recorder(failures=2)
        r = _receiver(broker, sink)
        await r.start()
        await _committed(r, 5)
        consumer = r.consumer
        await r.shutdown()
        assert [len(b.parts) for b in sink.batches] == [5]  # type: ignore[union-attr]
        assert sink.failures == 0 and r.metrics["accepted_spans"] == 5
        assert broker.committed("g", TopicPartition(SPANS, 1)) == (5, "")
        assert isinstance(consumer, MemoryConsumer)
        calls = consumer.calls
        assert calls["pause"] >= 2 and calls["seek"] >= 2 and calls["resume"] >= 2
        assert "paused=[]" in repr(consumer)

    async def test_blocks_planned_before_a_crash_are_rebuilt_the_same(
            self, broker: MemoryBroker) -> None:
        """A worker plans its blocks in the commit metadata, hands them on and dies before
        committing. The next worker of the group, reading one message per fetch with more
        messages arrived, delivers the same blocks (same tokens) first, then new ones."""
        def send(ids: range) -> None:
            for i in ids:
                broker.append(SPANS, span_request([(i + 1).to_bytes(8, "big")])
                              .SerializeToString(), partition=2)

        send(range(0, 8))
        hang = asyncio.Event()

        class Dies(Recorder):
            async def consume(self, batch: Batch) -> None:
                self.batches.append(batch)
                if sum(len(b) for b in self.batches) == 8:
                    await hang.wait()  # dies here, its rows already written

        first = Dies()
        a = _receiver(broker, first, block_items=3)
        await a.start()
        async with asyncio.timeout(10):
            while sum(len(b) for b in first.batches) < 8:
                await asyncio.sleep(0.01)
        tp = TopicPartition(SPANS, 2)
        assert broker.committed("g", tp) == (0, "spb1:0-2,3-5,6-7")
        assert a._task is not None and a.consumer is not None
        a._task.cancel()
        await a.consumer.stop()
        send(range(8, 12))

        second = Recorder()
        b = _receiver(broker, second, block_items=3, max_poll_records=1)
        await b.start()
        await _committed(b, 12)
        await b.shutdown()
        before = [x.origin for x in first.batches]
        after = [x.origin for x in second.batches]
        assert len(before) == 3 and after[:3] == before
        assert [len(x) for x in second.batches] == [3, 3, 2, 1, 1, 1, 1]
        assert broker.committed("g", tp) == (12, "")

    async def test_a_refused_plan_commit_rewinds_and_delivers_once(
            self, broker: MemoryBroker) -> None:
        """Kafka refusing the plan's commit: nothing is delivered unplanned; the round is
        read again and delivered once."""
        for i in range(3):
            broker.append(SPANS, span_request([(i + 1).to_bytes(8, "big")])
                          .SerializeToString(), partition=3)
        broker.fail(unreachable(), ops=["commit"], times=1)
        sink = Recorder()
        r = _receiver(broker, sink)
        await r.start()
        await _committed(r, 3)
        await r.shutdown()
        assert [len(b) for b in sink.batches] == [3]

    @pytest.mark.parametrize("refusals", [0, 2])
    async def test_on_a_backlog_samples_wait_for_their_spans(
            self, broker: MemoryBroker, refusals: int) -> None:
        """A backlog with the samples written before their spans, read one message per
        fetch: every sample goes after its span, none is lost; also when the first span
        deliveries are refused (the spans are read again, the samples wait again)."""
        n = 12
        ids = [(i + 1).to_bytes(8, "big") for i in range(n)]
        for sid in ids:
            broker.append(PROFILES, _sample_request([sid]), partition=4)
        for sid in ids:
            broker.append(SPANS, span_request([sid]).SerializeToString(), partition=4)
        sink = Ordered(refusals)
        r = _receiver(broker, sink, max_poll_records=1)
        await r.start()
        await _committed(r, 2 * n)
        await r.shutdown()
        assert sink.early == []
        assert r.metrics["accepted_samples"] == n and r.metrics["accepted_spans"] == n

    async def test_samples_go_on_as_their_spans_pass_them(self, broker: MemoryBroker) -> None:
        """On a backlog a minute long, samples are let through as the spans sent on pass
        their Kafka timestamp by ``spans_ahead``, not all at the end."""
        n = 6
        ids = [(i + 1).to_bytes(8, "big") for i in range(n)]
        for i, sid in enumerate(ids):
            broker.append(PROFILES, _sample_request([sid]), partition=0,
                          timestamp_ms=1_000_000 + 10_000 * i)
        for i, sid in enumerate(ids):
            broker.append(SPANS, span_request([sid]).SerializeToString(), partition=0,
                          timestamp_ms=1_000_000 + 10_000 * i)
        sink = Ordered(0)
        r = _receiver(broker, sink, max_poll_records=1)
        await r.start()
        await _committed(r, 2 * n)
        await r.shutdown()
        assert sink.early == []
        order = ["s" if isinstance(b, SpanBatch) else "p" for b in sink.batches]
        assert order.index("p") < order.index("s", n - 1), order

    async def test_samples_of_a_partition_without_spans_are_not_held(
            self, broker: MemoryBroker) -> None:
        """An empty spans partition is caught up: its samples are not held."""
        broker.append(PROFILES, _sample_request([b"\x09" * 8]), partition=5)
        sink = Recorder()
        r = _receiver(broker, sink)
        await r.start()
        await _committed(r, 1)
        await r.shutdown()
        assert [b.signal for b in sink.batches] == ["profiles"]

    async def test_topics_with_different_partition_counts_refused_at_start(self) -> None:
        """Spans and samples of a trace can only meet on co-partitioned topics."""
        broker = MemoryBroker()
        broker.create_topic(SPANS, 6)
        broker.create_topic(PROFILES, 3)
        r = _receiver(broker, Recorder())
        with pytest.raises(ConfigError, match=r"receivers\.kafka: topics must have the same "
                                              r"number of partitions.*'otlp_profiles': 3"):
            await r.start()
        assert broker.members == {}

    async def test_a_dead_poll_loop_is_reported(self, broker: MemoryBroker) -> None:
        """An unexpected error ends the poll loop: ``failed`` says so (/health: 503)."""
        r = _receiver(broker, Recorder())
        await r.start()
        broker.fail(RuntimeError("boom"), ops=["fetch"])
        async with asyncio.timeout(5):
            while r.failed is None:
                await asyncio.sleep(0.01)
        assert "the Kafka poll loop stopped" in r.failed and "boom" in r.failed
        await r.shutdown()

    async def test_the_tenant_travels_in_a_header(self, broker: MemoryBroker) -> None:
        """The exporter names each message's tenant in a ``tenant`` header; the receiver
        gives a block's messages of each tenant their own batch (and deduplication token),
        takes a message without the header as the default tenant's, and skips, counted, one
        whose header is not a tenant name."""
        ex = _exporter(broker)
        await ex.start()
        for tenant in ("team-a", "team-b"):
            batch = decode_traces(span_request([b"\x01" * 8])).batch
            batch.tenant = tenant
            await ex.consume(batch)
        await ex.shutdown()
        assert [r.headers for r in broker.records(SPANS)] == [
            (("tenant", b"team-a"),), (("tenant", b"team-b"),)]
        raw = span_request([b"\x01" * 8]).SerializeToString()
        broker.append(SPANS, raw)
        broker.append(SPANS, raw, headers=[("tenant", b"x' OR 1=1 --")])
        broker.append(SPANS, raw, headers=[("tenant", b"a"), ("tenant", b"b")])
        sink = Recorder()
        r = _receiver(broker, sink)
        await r.start()
        await _committed(r, 5)
        await r.shutdown()
        assert r.metrics["malformed_messages"] == 2
        got = sorted((b.tenant, len(b)) for b in sink.batches)
        assert got == [("default", 1), ("team-a", 1), ("team-b", 1)]
        origins = {b.tenant: b.origin for b in sink.batches}
        assert len(set(origins.values())) == 3 and origins["team-b"].endswith("/team-b")

    async def test_exporter_to_receiver(self, broker: MemoryBroker) -> None:
        """What the exporter writes the receiver reads back, spans before samples."""
        ex = _exporter(broker)
        await ex.start()
        tids = [bytes([i + 1]) * 16 for i in range(10)]
        req = tps.ExportTraceServiceRequest()
        for t in tids:
            req.MergeFrom(span_request([t[:8]], trace_id=t))
        b = ProfileBuilder()
        for t in tids:
            b.sample(["f"], 10, t, t[:8], service="s")
        await ex.consume(decode_profiles(b.build()).batch)  # samples first: they wait
        await ex.consume(decode_traces(req).batch)
        await ex.shutdown()
        sink = Ordered(0)
        r = _receiver(broker, sink)
        await r.start()
        await _committed(r, ex.metrics["sent_messages"])
        await r.shutdown()
        assert sink.early == [] and len(sink.seen) == 10
        assert r.metrics["accepted_samples"] == 10


class Ordered(Recorder):
    """Records samples delivered before their span (``early``)."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.seen: set[bytes] = set()
        self.early: list[bytes] = []
        self.refuse = refusals

    async def consume(self, batch: Batch) -> None:
        if isinstance(batch, SpanBatch):
            if self.refuse:
                self.refuse -= 1
                raise Retryable("not now")
            self.seen |= {s.span_id for s in batch.spans}
        elif isinstance(batch, ProfileBatch):
            self.early += [s.span_id for s in batch.samples if s.span_id not in self.seen]
        await super().consume(batch)


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
        assert repr(b) == "<MemoryBroker topics={'t': [1]} groups=[] faults=0>"

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

"""Kafka exporter and receiver against the real broker (tests/kafka_broker.py)."""

from __future__ import annotations

import asyncio
import math
import random
import struct
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.trace.v1 import trace_pb2 as tr

from pipeline.config import load_file
from pipeline.errors import InvalidData, Retryable
from pipeline.exporters import kafka as kafka_exporter
from pipeline.exporters.kafka import Config as ExporterConfig
from pipeline.exporters.kafka import KafkaExporter, ProducerConfig
from pipeline.kafka import (
    PARTITIONERS,
    PartitionerName,
    TopicConfig,
    fnv1a_32,
    murmur2_partition,
    partitioner,
    sarama_partition,
)
from pipeline.kafka.backend import AioProducer, ProducerOptions, batch_bytes
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.traces import decode_traces
from pipeline.otlp.wire import _header
from pipeline.receivers.kafka import Config as ReceiverConfig
from pipeline.receivers.kafka import KafkaReceiver
from pipeline.records import Batch, SpanBatch
from pipeline.registry import Context, default_factories
from tests.kafka_broker import create_topics
from tests.pipeline import kafka_keyed
from tests.pipeline.receivers.test_otlp_grpc import TID, span_request

PARTITIONS = 6
ROOT = Path(__file__).resolve().parents[2]


class TestPartitioners:
    def test_murmur2_matches_the_java_client(self) -> None:
        """Kafka's own test vectors (signed murmur2) give the same partitions."""
        for key, signed in ((b"21", -973932308), (b"foobar", -790332482),
                            (b"a-little-bit-long-string", -985981536), (b"abc", 479470107)):
            assert murmur2_partition(key, 1_000_003) == (signed & 0x7FFFFFFF) % 1_000_003

    def test_sarama_compat_is_fnv1a_with_go_remainder(self) -> None:
        """FNV-1a 32 vectors, then int32 remainder made non-negative, as sarama does."""
        assert fnv1a_32(b"") == 0x811C9DC5
        assert fnv1a_32(b"a") == 0xE40C292C
        assert fnv1a_32(b"foobar") == 0xBF9CF968
        # 0xbf9cf968 is negative as int32: -1080231576; Go: -(-1080231576 % 6) = 0
        assert sarama_partition(b"foobar", 6) == 1080231576 % 6
        assert sarama_partition(b"a", 7) == (0x100000000 - 0xE40C292C) % 7

    def test_sarama_compat_is_franz_go_sarama_compat_hasher(self) -> None:
        """What the Collector's exporter runs, franz-go's ``SaramaCompatHasher(fnv32a)``,
        spelled out with Go's semantics (``p := int32(h) % int32(n); if p < 0 { p = -p }``,
        a remainder with the dividend's sign) gives sarama_compat's partition for trace-id
        keys and any partition count."""
        rng = random.Random(3)
        for _ in range(2000):
            key = rng.randbytes(16).hex().encode()
            n = rng.randint(1, 300)
            h = struct.unpack("<i", struct.pack("<I", fnv1a_32(key)))[0]
            p = int(math.fmod(h, n))
            assert sarama_partition(key, n) == (-p if p < 0 else p)

    def test_default_is_the_collectors(self) -> None:
        """Unset (``{}``) and in the shipped gateway config, the exporter's partitioner is
        sarama_compat, the Collector Kafka exporter's default; the aiokafka partitioner
        built from each name picks that name's partition."""
        assert msgspec.convert({}, ExporterConfig).partitioner == "sarama_compat"
        assert list(PARTITIONERS)[0] == "sarama_compat"
        gateway = load_file(str(ROOT / "config" / "gateway.yaml"), default_factories(), env={})
        assert gateway.exporters["kafka"].partitioner == "sarama_compat"
        parts = list(range(100, 112))
        keys = [random.Random(i).randbytes(16).hex().encode() for i in range(50)]
        for name, fn in PARTITIONERS.items():
            choose = partitioner(name)
            for t in keys:
                assert choose(t, parts, parts) == parts[fn(t, len(parts))]

    @pytest.mark.parametrize("name", ["sarama_compat", "murmur2"])
    def test_messages_are_grouped_by_the_configured_partitioner(
            self, name: PartitionerName) -> None:
        """With the partition count known, a request becomes one message per partition of
        the configured partitioner, keyed by a trace of that partition (no broker needed)."""
        ex = KafkaExporter(ExporterConfig(partitioner=name),
                           Context("kafka", ["traces", "profiles"]))
        tids = [bytes([i + 1]) * 16 for i in range(24)]
        req = tps.ExportTraceServiceRequest()
        for t in tids:
            req.MergeFrom(span_request([bytes([7]) * 8], trace_id=t))
        fn = PARTITIONERS[name]
        msgs = ex.messages(decode_traces(req).batch, partitions=PARTITIONS)
        assert len(msgs) == len({fn(t.hex().encode(), PARTITIONS) for t in tids})
        for _, key, value in msgs:
            assert key is not None
            got = {bytes(s.trace_id).hex() for rs in tps.ExportTraceServiceRequest.FromString(
                value).resource_spans for ss in rs.scope_spans for s in ss.spans}
            assert key.decode() in got
            assert {fn(t.encode(), PARTITIONS) for t in got} == {fn(key, PARTITIONS)}

    @pytest.mark.parametrize("native_path", [True, False])
    def test_a_request_that_would_multiply_is_refused_for_good(
            self, native_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        """A message per trace (partition count unknown) repeats the resource: a 100 KB
        resource over 2 000 traces would be 200 MB of messages. InvalidData (the client is
        told, not asked to retry), on the native path and on the Python one."""
        if not native_path:
            monkeypatch.setattr(kafka_exporter, "traces_split", lambda *a: None)
        ex = KafkaExporter(ExporterConfig(), Context("kafka", ["traces", "profiles"]))
        req = tps.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="big").value.string_value = "x" * 100_000
        ss = rs.scope_spans.add()
        for i in range(2000):
            ss.spans.add(trace_id=(i + 1).to_bytes(16, "big"), span_id=b"\x02" * 8,
                         end_time_unix_nano=1)
        data = req.SerializeToString()
        batch = decode_traces(req, records=False, wire=data).batch
        with pytest.raises(InvalidData, match="resource and scope fields"):
            ex.messages(batch, partitions=0)
        assert len(ex.messages(batch, partitions=PARTITIONS)) <= PARTITIONS


    @pytest.mark.parametrize("name", ["sarama_compat", "murmur2"])
    def test_odd_encodings_reach_their_traces_partition(self, name: PartitionerName) -> None:
        """What the receiver's parse accepts from an odd writer: a span giving its trace id
        twice (upb keeps the last) and a span field whose tag takes two bytes. Each span is
        in exactly one message, on its own (last) trace's partition; none is lost."""
        ex = KafkaExporter(ExporterConfig(partitioner=name),
                           Context("kafka", ["traces", "profiles"]))
        first, last, other = b"\x11" * 16, b"\x22" * 16, b"\x33" * 16
        twice = (tr.Span(trace_id=first).SerializeToString()
                 + tr.Span(trace_id=last, span_id=b"\x01" * 8, name="twice",
                           end_time_unix_nano=1).SerializeToString())
        longer = tr.Span(trace_id=other, span_id=b"\x02" * 8, name="longer",
                         end_time_unix_nano=1).SerializeToString()
        field = _header(2, len(twice)) + twice + bytes([0x92, 0x00, len(longer)]) + longer
        scope = _header(2, len(field)) + field
        data = _header(1, len(scope)) + scope
        req = tps.ExportTraceServiceRequest.FromString(data)
        assert [(s.name, s.trace_id) for s in req.resource_spans[0].scope_spans[0].spans] == \
            [("twice", last), ("longer", other)]
        batch = decode_traces(req, records=False, wire=data).batch  # the receiver's parse
        assert batch.items == 2
        fn = PARTITIONERS[name]
        seen = []
        for _, key, value in ex.messages(batch, partitions=PARTITIONS):
            assert key is not None
            for rs in tps.ExportTraceServiceRequest.FromString(value).resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        seen.append(sp.name)
                        assert fn(sp.trace_id.hex().encode(), PARTITIONS) == \
                            fn(key, PARTITIONS), sp.name
        assert sorted(seen) == ["longer", "twice"]


async def _read_all(bootstrap: str, topic: str, n: int, within: float = 30.0) -> list[Any]:
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                         group_id=None)
    await c.start()
    out: list[Any] = []
    try:
        async with asyncio.timeout(within):
            while len(out) < n:
                for recs in (await c.getmany(timeout_ms=500)).values():
                    out.extend(recs)
    finally:
        await c.stop()
    return out


@pytest.fixture
async def topics(kafka_broker: Any) -> tuple[str, str]:
    suffix = uuid.uuid4().hex[:8]
    names = (f"spans_{suffix}", f"profiles_{suffix}")
    await create_topics(kafka_broker.bootstrap, *names, partitions=PARTITIONS)
    return names


def _exporter(bootstrap: str, topics: tuple[str, str], **kw: Any) -> KafkaExporter:
    cfg = ExporterConfig(brokers=[bootstrap], traces=TopicConfig(topics[0]),
                         profiles=TopicConfig(topics[1]), timeout=5.0, **kw)
    cfg.validate()
    return KafkaExporter(cfg, Context("kafka", ["traces", "profiles"]))


class TestProducerBatches:
    async def test_messages_of_a_partition_share_batches(self) -> None:
        """aiokafka's 16 KiB default made each ~35 KB message a batch of its own (and a
        partition's next message wait for it): batches hold half of max_message_bytes, so a
        compressed batch stays under the broker's limit."""
        assert batch_bytes(1_000_000) == 500_000
        assert batch_bytes(1024) == 16384  # never below aiokafka's default
        opts = ProducerOptions(brokers=["127.0.0.1:1"], client_id="t",
                               partitioner="sarama_compat", compression="zstd",
                               max_message_bytes=1_000_000, linger=0.005, timeout=1.0)
        producer = AioProducer(opts)
        assert producer.client._message_accumulator._batch_size == 500_000


class TestKafkaExporter:
    @pytest.mark.parametrize("name", [None, "murmur2"])
    async def test_messages_per_partition_keyed_and_copartitioned(
            self, kafka_broker: Any, topics: tuple[str, str], name: PartitionerName | None
    ) -> None:
        """Span and sample messages are plain OTLP requests grouping the traces of one
        partition, keyed by one of them (one message per partition per request); a trace's
        spans and samples land on the same partition, the configured partitioner's
        (unset: sarama_compat's)."""
        ex = _exporter(kafka_broker.bootstrap, topics, **({"partitioner": name} if name else {}))
        part = PARTITIONERS[name or "sarama_compat"]
        await ex.start()
        await kafka_keyed.send_load(ex)
        n_spans, n_samples = kafka_keyed.message_counts(part, PARTITIONS)
        kafka_keyed.check(part, PARTITIONS, ex,
                          await _read_all(kafka_broker.bootstrap, topics[0], n_spans),
                          await _read_all(kafka_broker.bootstrap, topics[1], n_samples))

    async def test_big_trace_is_split_not_refused(self, kafka_broker: Any,
                                                  topics: tuple[str, str]) -> None:
        """A trace bigger than max_message_bytes becomes several messages with one key."""
        ex = _exporter(kafka_broker.bootstrap, topics,
                       producer=ProducerConfig(max_message_bytes=4096))
        await ex.start()
        req = span_request([i.to_bytes(8, "big") for i in range(1, 301)])
        await ex.consume(decode_traces(req).batch)
        await ex.shutdown()
        assert ex.metrics["split_messages"] > 0
        n = ex.metrics["sent_messages"]
        recs = await _read_all(kafka_broker.bootstrap, topics[0], n)
        ids = [s.span_id for r in recs for rs in tps.ExportTraceServiceRequest.FromString(
            r.value).resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert sorted(ids) == sorted(i.to_bytes(8, "big") for i in range(1, 301))
        assert all(len(r.value) <= 4096 for r in recs) and len({r.key for r in recs}) == 1

    async def test_kafka_down_is_retryable_not_success(self, topics: tuple[str, str]) -> None:
        """With no broker reachable, consume raises Retryable within the timeout."""
        from tests.conftest import free_port

        ex = _exporter(f"127.0.0.1:{free_port()}", topics)
        ex.cfg.timeout = 2.0  # type: ignore[misc]
        await ex.start()
        with pytest.raises(Retryable, match="Kafka did not acknowledge"):
            await ex.consume(decode_traces(span_request([b"\x01" * 8])).batch)
        await ex.shutdown()


async def _committed(r: KafkaReceiver, n: int, within: float) -> None:
    """Wait until the receiver committed ``n`` messages."""
    async with asyncio.timeout(within):
        while r.metrics["committed_messages"] < n:
            await asyncio.sleep(0.05)


class Recorder:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.batches: list[Batch] = []

    async def consume(self, batch: Batch) -> None:
        if self.failures:
            self.failures -= 1
            raise Retryable("sink down")
        self.batches.append(batch)


@pytest.fixture
async def raw_producer(kafka_broker: Any) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    await p.start()
    yield p
    await p.stop()


class TestKafkaReceiver:
    async def _receiver(self, bootstrap: str, topics: tuple[str, str], sink: Recorder,
                        group: str) -> KafkaReceiver:
        cfg = ReceiverConfig(brokers=[bootstrap], traces=TopicConfig(topics[0]),
                             profiles=TopicConfig(topics[1]), group_id=group)
        r = KafkaReceiver(cfg, Context("kafka", ["traces", "profiles"],
                                       next={"traces": sink, "profiles": sink}))
        await r.start()
        return r

    async def test_any_producer_garbage_skipped_offsets_committed(
            self, kafka_broker: Any, topics: tuple[str, str], raw_producer: Any) -> None:
        """Messages written by a plain producer are accepted, a garbage message is skipped
        and counted, and the group's committed offsets cover everything consumed."""
        await raw_producer.send_and_wait(topics[0], span_request([b"\x01" * 8])
                                         .SerializeToString(), partition=0)
        await raw_producer.send_and_wait(topics[0], b"\xff\xff not protobuf", partition=0)
        b = ProfileBuilder()
        b.sample(["f"], 10, b"\x02" * 16, b"\x03" * 8, service="s")
        await raw_producer.send_and_wait(topics[1], b.build().SerializeToString(), partition=0)
        sink = Recorder()
        group = f"g-{uuid.uuid4().hex[:6]}"
        r = await self._receiver(kafka_broker.bootstrap, topics, sink, group)
        async with asyncio.timeout(30):
            while sum(len(x) for x in sink.batches) < 2:
                await asyncio.sleep(0.1)
            while r.metrics["committed_messages"] < 3:
                await asyncio.sleep(0.1)
        await r.shutdown()
        assert r.metrics["malformed_messages"] == 1
        signals = sorted(x.signal for x in sink.batches)
        assert signals == ["profiles", "traces"]
        c = AIOKafkaConsumer(bootstrap_servers=kafka_broker.bootstrap, group_id=group)
        await c.start()
        try:
            assert await c.committed(TopicPartition(topics[0], 0)) == 2
            assert await c.committed(TopicPartition(topics[1], 0)) == 1
        finally:
            await c.stop()

    async def test_tenant_header_round_trip(self, kafka_broker: Any, topics: tuple[str, str]
                                            ) -> None:
        """On a real broker, the exporter's ``tenant`` header comes back to the receiver:
        each tenant's spans arrive as that tenant's batch."""
        ex = _exporter(kafka_broker.bootstrap, topics)
        await ex.start()
        for tenant in ("team-a", "team-b"):
            batch = decode_traces(span_request([b"\x01" * 8])).batch
            batch.tenant = tenant
            await ex.consume(batch)
        await ex.shutdown()
        sink = Recorder()
        r = await self._receiver(kafka_broker.bootstrap, topics, sink,
                                 f"g-{uuid.uuid4().hex[:6]}")
        try:
            async with asyncio.timeout(30):
                while r.metrics["committed_messages"] < 2:
                    await asyncio.sleep(0.1)
        finally:
            await r.shutdown()
        assert sorted(b.tenant for b in sink.batches) == ["team-a", "team-b"]

    async def test_refusing_sink_pauses_then_delivers_once(
            self, kafka_broker: Any, topics: tuple[str, str], raw_producer: Any) -> None:
        """While the sink refuses, the receiver backs off and re-reads; once it recovers every
        message is delivered and committed. A message delivered again carries the same
        origin, which is what makes the correlator's rows for it deduplicate."""
        for i in range(5):
            await raw_producer.send_and_wait(topics[0], span_request(
                [(i + 1).to_bytes(8, "big")]).SerializeToString(), partition=1)
        sink = Recorder(failures=2)
        r = await self._receiver(kafka_broker.bootstrap, topics, sink,
                                 f"g-{uuid.uuid4().hex[:6]}")
        await _committed(r, 5, within=30)
        await r.shutdown()
        origins: dict[bytes, set[str]] = {}
        for b in sink.batches:
            for s in b.spans:  # type: ignore[union-attr]
                origins.setdefault(s.span_id, set()).add(b.origin)  # type: ignore[union-attr]
        assert sorted(origins) == [(i + 1).to_bytes(8, "big") for i in range(5)]
        assert all(len(o) == 1 for o in origins.values())
        # the five messages are one block (one insert), its parts name each message
        assert [len(b.parts) for b in sink.batches] == [5]  # type: ignore[union-attr]
        assert sink.failures == 0

    async def test_blocks_planned_before_a_crash_are_rebuilt_the_same(
            self, kafka_broker: Any, topics: tuple[str, str], raw_producer: Any) -> None:
        """A worker takes a fetch, plans its blocks in the commit metadata, hands them on
        and dies before committing. The next worker of the group, reading one message per
        fetch while more messages have arrived, delivers exactly the same blocks (same
        deduplication tokens) first, then new ones, and commits past all of them."""
        async def send(ids: range) -> None:
            for i in ids:
                await raw_producer.send_and_wait(topics[0], span_request(
                    [(i + 1).to_bytes(8, "big")]).SerializeToString(), partition=2)

        await send(range(0, 8))
        group = f"g-{uuid.uuid4().hex[:6]}"
        hang = asyncio.Event()

        class Dies(Recorder):
            async def consume(self, batch: Batch) -> None:
                self.batches.append(batch)
                if sum(len(b) for b in self.batches) == 8:  # blocks go one after the other
                    await hang.wait()  # the worker dies here, its rows already written

        first = Dies()
        cfg = ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                             profiles=TopicConfig(topics[1]), group_id=group, block_items=3)
        a = KafkaReceiver(cfg, Context("kafka", ["traces", "profiles"],
                                       next={"traces": first, "profiles": first}))
        await a.start()
        async with asyncio.timeout(30):
            while sum(len(b) for b in first.batches) < 8:
                await asyncio.sleep(0.05)
        assert a._task is not None and a.consumer is not None
        a._task.cancel()  # no commit after the delivery
        await a.consumer.stop()
        await send(range(8, 12))

        second = Recorder()
        cfg2 = ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                              profiles=TopicConfig(topics[1]), group_id=group, block_items=3,
                              max_poll_records=1)
        b = KafkaReceiver(cfg2, Context("kafka", ["traces", "profiles"],
                                        next={"traces": second, "profiles": second}))
        await b.start()
        await _committed(b, 12, within=30)
        await b.shutdown()
        before = [x.origin for x in first.batches]  # type: ignore[union-attr]
        after = [x.origin for x in second.batches]  # type: ignore[union-attr]
        assert len(before) == 3 and after[:3] == before, (before, after)
        assert [len(x) for x in second.batches] == [3, 3, 2, 1, 1, 1, 1]
        c = AIOKafkaConsumer(bootstrap_servers=kafka_broker.bootstrap, group_id=group)
        await c.start()
        try:
            assert await c.committed(TopicPartition(topics[0], 2)) == 12
        finally:
            await c.stop()

    @pytest.mark.parametrize("refusals", [0, 2])
    async def test_on_a_backlog_samples_wait_for_their_spans(
            self, kafka_broker: Any, topics: tuple[str, str], raw_producer: Any,
            refusals: int) -> None:
        """A backlog on one partition pair, the samples written a moment before their spans
        (a profiler's upload can be), read one message per fetch: every sample is delivered
        after its span (so that its row names the span's operation), none is lost, and
        everything is committed; also when the first deliveries of spans are refused
        (the spans read then are read again, and samples wait for them again)."""
        n = 12
        ids = [(i + 1).to_bytes(8, "big") for i in range(n)]
        for sid in ids:
            b = ProfileBuilder()
            b.sample(["f"], 10, TID, sid, service="s")
            await raw_producer.send_and_wait(topics[1], b.build().SerializeToString(),
                                             partition=4)
        for sid in ids:
            await raw_producer.send_and_wait(topics[0], span_request([sid])
                                             .SerializeToString(), partition=4)

        class Ordered(Recorder):
            def __init__(self) -> None:
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
                else:
                    self.early += [s.span_id for s in batch.samples  # type: ignore[union-attr]
                                   if s.span_id not in self.seen]
                await super().consume(batch)

        sink = Ordered()
        cfg = ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                             profiles=TopicConfig(topics[1]),
                             group_id=f"g-{uuid.uuid4().hex[:6]}", max_poll_records=1)
        r = KafkaReceiver(cfg, Context("kafka", ["traces", "profiles"],
                                       next={"traces": sink, "profiles": sink}))
        await r.start()
        await _committed(r, 2 * n, within=30)
        await r.shutdown()
        assert sink.early == []
        assert r.metrics["accepted_samples"] == n and r.metrics["accepted_spans"] == n

    async def test_a_round_bigger_than_the_exporters_queue_goes_in_waves(
            self, kafka_broker: Any, topics: tuple[str, str], raw_producer: Any,
            tmp_path: Any) -> None:
        """Twelve blocks in one fetch, six times what the ClickHouse exporter may hold:
        they go downstream in waves the queue takes, nothing is refused, everything is
        stored once and committed."""
        from pipeline.exporters.clickhouse.exporter import ClickHouseExporter
        from pipeline.exporters.clickhouse.exporter import Config as CHConfig

        for p in range(6):
            for m in range(10):
                sids = [(p * 1000 + m * 10 + k + 1).to_bytes(8, "big") for k in range(10)]
                await raw_producer.send_and_wait(topics[0], span_request(sids)
                                                 .SerializeToString(), partition=p)
        ex = ClickHouseExporter(
            CHConfig(endpoint=f"chdb://{tmp_path}/ch", batch_rows=100, max_pending_rows=120,
                     flush_interval=0.05, ttl=0),  # type: ignore[arg-type]
            Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
        await ex.start()
        cfg = ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                             profiles=TopicConfig(topics[1]),
                             group_id=f"g-{uuid.uuid4().hex[:6]}", block_items=50)
        r = KafkaReceiver(cfg, Context("kafka", ["traces"], next={"traces": ex}))
        await r.start()
        await _committed(r, 60, within=60)
        await r.shutdown()
        _, rows = await ex.query("SELECT count(), uniqExact(SpanId) FROM spanprof.otel_traces")
        await ex.shutdown()
        assert rows == [(600, 600)]
        assert r.metrics["blocks"] == 12 and ex.metrics["refused_rows"] == 0

    async def test_samples_of_a_partition_without_spans_are_not_held(
            self, kafka_broker: Any, topics: tuple[str, str], raw_producer: Any) -> None:
        """A spans partition that is empty is caught up: samples on its profiles partition
        go through (waiting for spans is only for a backlog of them)."""
        b = ProfileBuilder()
        b.sample(["f"], 10, TID, b"\x09" * 8, service="s")
        await raw_producer.send_and_wait(topics[1], b.build().SerializeToString(), partition=5)
        sink = Recorder()
        r = await self._receiver(kafka_broker.bootstrap, topics, sink,
                                 f"g-{uuid.uuid4().hex[:6]}")
        await _committed(r, 1, within=20)
        await r.shutdown()
        assert [b.signal for b in sink.batches] == ["profiles"]


    async def test_a_dead_poll_loop_is_reported(self, kafka_broker: Any,
                                               topics: tuple[str, str]) -> None:
        """If the poll loop dies, the receiver says so (``failed``, which /health reports
        with a 503) instead of idling as if healthy."""
        from types import SimpleNamespace

        from pipeline.admin.server import AdminServer

        sink = Recorder()
        r = await self._receiver(kafka_broker.bootstrap, topics, sink,
                                 f"g-{uuid.uuid4().hex[:6]}")
        graph = SimpleNamespace(nodes={"receiver:kafka": SimpleNamespace(component=r)},
                                components=lambda kind: {})
        admin = AdminServer("127.0.0.1:0", graph)  # type: ignore[arg-type]
        assert (await admin.health(None)).status == 200  # type: ignore[arg-type]

        async def broken(**kw: Any) -> Any:
            raise RuntimeError("boom")

        assert r.consumer is not None
        r.consumer.getmany = broken  # type: ignore[method-assign]
        async with asyncio.timeout(10):
            while r.failed is None:
                await asyncio.sleep(0.05)
        assert "boom" in r.failed
        resp = await admin.health(None)  # type: ignore[arg-type]
        assert resp.status == 503 and b'"failed"' in resp.body  # type: ignore[operator]
        await r.shutdown()


class TestWaitForSpans:
    def test_a_partition_waits_then_is_let_go_after_spans_wait_max(self) -> None:
        from pipeline.kafka.blocks import Entry, PartitionBlocks

        cfg = ReceiverConfig(spans_wait_max=0.2)  # type: ignore[arg-type]
        r = KafkaReceiver(cfg, Context("kafka", ["profiles"], next={"profiles": Recorder()}))
        tp = TopicPartition("otlp_profiles", 0)
        part = PartitionBlocks(tp.topic, 0, 100)
        entries = [Entry(o, b"m", object(), 1, timestamp=5_000 + o) for o in range(3)]
        (first,) = r._wait_for_spans(tp, part, entries, until=5_000)
        assert (first.first, first.last) == (0, 0)
        assert [e.offset for e in part.held] == [1, 2] and tp in r._waiting_since
        assert r._wait_for_spans(tp, part, [], until=5_000) == []  # still waiting
        time.sleep(0.25)
        (block,) = r._wait_for_spans(tp, part, [], until=5_000)
        assert (block.first, block.last) == (1, 2) and not part.held
        assert r.metrics["spans_wait_expired"] == 1 and tp not in r._waiting_since

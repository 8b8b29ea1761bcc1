"""pipeline/backfill/kafka_range.py and kafka_blocks.py against the real broker
(tests/kafka_broker.py): what the gateway's kafka exporter wrote, replayed over offset and
time ranges."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Collection
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.backfill.kafka_blocks import (
    DEFAULT_LIMITS,
    ORIGIN_PREFIX,
    Limits,
    PartitionRange,
    RangeBlock,
    parse_offsets,
    split,
)
from pipeline.backfill.kafka_range import KafkaRange, signal_of
from pipeline.errors import ConfigError
from pipeline.exporters.kafka import Config as ExporterConfig
from pipeline.exporters.kafka import KafkaExporter
from pipeline.kafka import TopicConfig
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.kafka import Config as ReceiverConfig
from pipeline.receivers.kafka import KafkaReceiver
from pipeline.records import DEFAULT_TENANT, Batch, ProfileBatch, SpanBatch
from pipeline.registry import Context
from tests.kafka_broker import create_topics
from tests.pipeline.receivers.test_otlp_grpc import span_request

PARTITIONS = 3
TENANTS = ("default", "team-a", "team-b")
# (tenant, span id): one per span or sample; span ids are unique across a test's load
Item = tuple[str, bytes]


def sid(i: int) -> bytes:
    return (i + 1).to_bytes(8, "big")


def tid(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


@pytest.fixture
async def topics(kafka_broker: Any) -> tuple[str, str]:
    suffix = uuid.uuid4().hex[:8]
    names = (f"bf_spans_{suffix}", f"bf_profiles_{suffix}")
    await create_topics(kafka_broker.bootstrap, *names, partitions=PARTITIONS)
    return names


@pytest.fixture
def cfg(kafka_broker: Any, topics: tuple[str, str]) -> ReceiverConfig:
    """The correlator's receiver config: what ``backfill kafka -c`` hands the reader."""
    return ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                          profiles=TopicConfig(topics[1]), timeout=5.0)  # type: ignore[arg-type]


@pytest.fixture
async def gateway(kafka_broker: Any, topics: tuple[str, str]) -> AsyncIterator[KafkaExporter]:
    """The gateway's kafka exporter: messages keyed by trace, the ``tenant`` header."""
    ex = KafkaExporter(ExporterConfig(brokers=[kafka_broker.bootstrap],
                                      traces=TopicConfig(topics[0]),
                                      profiles=TopicConfig(topics[1]), timeout=5.0),  # type: ignore[arg-type]
                       Context("kafka", ["traces", "profiles"]))
    await ex.start()
    yield ex
    await ex.shutdown()


@pytest.fixture
async def raw_producer(kafka_broker: Any) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    await p.start()
    yield p
    await p.stop()


async def send_spans(ex: KafkaExporter, first: int, n: int, per: int = 2) -> None:
    """``n`` requests of one trace of ``per`` spans each, tenants in turn: a message each."""
    for i in range(first, first + n):
        batch = decode_traces(span_request([sid(i * per + k) for k in range(per)],
                                           trace_id=tid(i))).batch
        batch.tenant = TENANTS[i % len(TENANTS)]
        await ex.consume(batch)


async def send_samples(ex: KafkaExporter, first: int, n: int, tenant: str) -> None:
    for i in range(first, first + n):
        b = ProfileBuilder()
        for k in range(2):
            b.sample(["main", f"f{k}"], 10, tid(i), sid(i * 2 + k), service="svc")
        batch = decode_profiles(b.build()).batch
        batch.tenant = tenant
        await ex.consume(batch)


class Message:
    """A span message as read by a plain consumer, decoded from the wire (not by the
    receiver's decoder)."""

    def __init__(self, rec: Any) -> None:
        self.partition, self.offset = rec.partition, rec.offset
        self.size = len(rec.value)
        header = [v for k, v in rec.headers if k == "tenant"]
        self.tenant = header[0].decode() if header else DEFAULT_TENANT
        req = tps.ExportTraceServiceRequest.FromString(rec.value)
        ids = [bytes(s.span_id) for rs in req.resource_spans for ss in rs.scope_spans
               for s in ss.spans]
        self.items: list[Item] = [(self.tenant, i) for i in ids]


async def truth(bootstrap: str, topic: str) -> dict[int, list[Message]]:
    """Every message of the topic, read by a plain consumer: partition -> messages."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                         auto_offset_reset="earliest")
    await c.start()
    try:
        tps_ = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        c.assign(tps_)
        end = await c.end_offsets(tps_)
        await c.seek_to_beginning(*tps_)
        out: dict[int, list[Message]] = {p: [] for p in range(PARTITIONS)}
        async with asyncio.timeout(30):
            while any([await c.position(tp) < end[tp] for tp in tps_]):
                for tp, recs in (await c.getmany(timeout_ms=200)).items():
                    out[tp.partition] += [Message(r) for r in recs if r.offset < end[tp]]
    finally:
        await c.stop()
    return out


def items_of(blocks: list[RangeBlock]) -> list[Item]:
    out: list[Item] = []
    for block in blocks:
        for b in block.batches:
            recs: Any = b.spans if isinstance(b, SpanBatch) else b.samples
            out += [(b.tenant, r.span_id) for r in recs]
    return sorted(out)


async def replay(cfg: ReceiverConfig, topic: str, ranges: list[PartitionRange],
                 limits: Limits = DEFAULT_LIMITS) -> list[RangeBlock]:
    async with KafkaRange(cfg, topic, limits=limits) as src:
        return [b async for b in src.read(ranges)]


class TestParseOffsets:
    def test_partitions_and_half_open_ranges(self) -> None:
        """Several partitions, spaces allowed; ``FROM == TO`` is an empty range."""
        assert parse_offsets(" 0:0-10, 2:5-5,1:7-9 ") == {0: (0, 10), 2: (5, 5), 1: (7, 9)}

    @pytest.mark.parametrize(("spec", "message"), [
        ("", "offsets: empty"),
        ("  ", "offsets: empty"),
        ("0", "'0': expected P:FROM-TO"),
        ("0:5", "'0:5': expected P:FROM-TO"),
        ("0:1-2,", "'': expected P:FROM-TO"),
        ("x:1-2", "'x:1-2': partition and offsets must be integers >= 0"),
        ("0:-1-3", "'0:-1-3': partition and offsets must be integers >= 0"),
        ("0:1-", "'0:1-': partition and offsets must be integers >= 0"),
        ("0:1.5-3", "'0:1.5-3': partition and offsets must be integers >= 0"),
        ("0:²-3", "'0:²-3': partition and offsets must be integers >= 0"),
        ("1:0-4,0:5-3", "'0:5-3': FROM 5 is after TO 3"),
        ("0:1-2, 0:3-4", "'0:3-4': partition 0 is given twice"),
    ])
    def test_errors_name_the_bad_part(self, spec: str, message: str) -> None:
        """Each malformed spec is a ValueError quoting the part that is wrong."""
        with pytest.raises(ValueError) as err:
            parse_offsets(spec)
        assert message in str(err.value)


class TestSplit:
    def test_cuts_at_multiples_of_the_block_alignment(self) -> None:
        """Units end at multiples of ``every`` rounded up to ``block_offsets``; empty
        ranges are dropped; the units cover the ranges exactly."""
        lim = Limits(block_offsets=10)
        r = [PartitionRange("t", 0, 5, 47), PartitionRange("t", 1, 3, 3)]
        got = split(r, 15, lim)
        assert [(u.partition, u.start, u.end) for u in got] == [(0, 5, 20), (0, 20, 40),
                                                                  (0, 40, 47)]
        assert [(u.start, u.end) for u in split(r, 10, lim)] == [
            (5, 10), (10, 20), (20, 30), (30, 40), (40, 47)]
        with pytest.raises(ValueError, match="at least 1"):
            split(r, 0, lim)


class TestReplay:
    async def test_offset_range_is_replayed_exactly(
            self, kafka_broker: Any, cfg: ReceiverConfig, topics: tuple[str, str],
            gateway: KafkaExporter) -> None:
        """Messages the gateway wrote for three tenants; all but the first and last offset
        of each partition with messages are replayed: every span in that range comes back
        once, as its tenant's, nothing outside it; the plan counts the messages without
        reading them; bytes, messages and names of each block add up."""
        await send_spans(gateway, 0, 30)
        msgs = await truth(kafka_broker.bootstrap, topics[0])
        spec = ",".join(f"{p}:{1 if m else 0}-{max(len(m) - 1, 0)}" for p, m in msgs.items())
        offsets = parse_offsets(spec)
        assert sum(e - s for s, e in offsets.values()) >= 20  # the load spread
        want = [m for p, ms in msgs.items() for m in ms
                if offsets[p][0] <= m.offset < offsets[p][1]]
        async with KafkaRange(cfg, topics[0]) as src:
            ranges = await src.plan(offsets=offsets)
            assert {r.partition: r.messages for r in ranges} == {
                p: e - s for p, (s, e) in offsets.items()}
            blocks = [b async for b in src.read(ranges)]
            assert repr(src) == (f"<KafkaRange {topics[0]} traces started blocks={len(blocks)} "
                                 f"messages={len(want)}>")
        assert repr(src).startswith(f"<KafkaRange {topics[0]} traces stopped")
        assert items_of(blocks) == sorted(i for m in want for i in m.items)
        assert len(set(items_of(blocks))) == len(items_of(blocks))
        assert {t for t, _ in items_of(blocks)} == set(TENANTS)
        assert sum(b.messages for b in blocks) == len(want)
        assert sum(b.bytes for b in blocks) == sum(m.size for m in want)
        assert sum(b.malformed for b in blocks) == 0
        for block in blocks:
            s, e = offsets[block.partition]
            assert s <= block.first <= block.last < e
            assert block.origin.startswith(f"{ORIGIN_PREFIX}{topics[0]}/{block.partition}/"
                                           f"{block.first}-{block.last}/")
            for b in block.batches:
                assert b.origin == (block.origin if b.tenant == DEFAULT_TENANT
                                    else f"{block.origin}/{b.tenant}")
                for name, _ in b.parts:
                    t, p, o = name.split("/")
                    assert (t, int(p)) == (topics[0], block.partition)
                    assert block.first <= int(o) <= block.last

    async def test_time_range_of_profiles(
            self, kafka_broker: Any, cfg: ReceiverConfig, topics: tuple[str, str],
            gateway: KafkaExporter) -> None:
        """Samples written in three phases: ``[t1, t2)`` replays exactly the second
        phase's, ``since=t1`` with an open end the second and third, ``until=t1`` the
        first; ns and datetimes alike, each sample once and as its tenant's."""
        await send_samples(gateway, 0, 6, "team-a")
        await asyncio.sleep(0.03)
        t1 = time.time_ns()
        await asyncio.sleep(0.03)
        await send_samples(gateway, 100, 6, "team-b")
        await asyncio.sleep(0.03)
        t2 = time.time_ns()
        await asyncio.sleep(0.03)
        await send_samples(gateway, 200, 6, DEFAULT_TENANT)

        def phase(first: int, tenant: str) -> list[Item]:
            return sorted((tenant, sid(i * 2 + k)) for i in range(first, first + 6)
                          for k in range(2))

        async with KafkaRange(cfg, topics[1]) as src:
            assert src.signal == "profiles"

            async def between(**kw: Any) -> list[Item]:
                ranges = await src.plan(**kw)
                blocks = [b async for b in src.read(ranges)]
                assert sum(b.messages for b in blocks) == sum(r.messages for r in ranges)
                assert all(isinstance(x, ProfileBatch) for b in blocks for x in b.batches)
                return items_of(blocks)

            assert await between(since=t1, until=t2) == phase(100, "team-b")
            assert await between(since=datetime.fromtimestamp(t1 / 1e9, UTC)) == sorted(
                phase(100, "team-b") + phase(200, DEFAULT_TENANT))
            assert await between(until=t1) == phase(0, "team-a")
            assert await between(since=t2, until=t2) == []
            assert await between(since=time.time_ns() + 10**9) == []

    async def test_time_bounds_are_exact_to_the_nanosecond(
            self, cfg: ReceiverConfig, topics: tuple[str, str], raw_producer: Any) -> None:
        """Messages stamped T, T+1 and T+2 ms: a bound one ns after T's stamp leaves it
        out, a bound on it keeps it in (``since``) or out (``until``), as datetimes too."""
        t = time.time_ns() // 10**6 - 60_000
        for k in range(3):
            await raw_producer.send_and_wait(topics[0], span_request([sid(k)])
                                             .SerializeToString(), partition=0,
                                             timestamp_ms=t + k)
        ms = 10**6
        async with KafkaRange(cfg, topics[0]) as src:
            async def ids(**kw: Any) -> list[int]:
                blocks = [b async for b in src.read(await src.plan(**kw))]
                return [int.from_bytes(i, "big") - 1 for _, i in items_of(blocks)]

            assert await ids(since=t * ms) == [0, 1, 2]
            assert await ids(since=t * ms + 1) == [1, 2]
            assert await ids(since=t * ms, until=(t + 1) * ms) == [0]
            assert await ids(since=t * ms, until=(t + 1) * ms + 1) == [0, 1]
            at = datetime.fromtimestamp(t / 1000, UTC)
            assert await ids(since=at + timedelta(microseconds=1),
                             until=at + timedelta(milliseconds=2)) == [1]

    async def test_same_origins_however_chunked(
            self, cfg: ReceiverConfig, topics: tuple[str, str], gateway: KafkaExporter
    ) -> None:
        """Blocks within segments of 5 offsets and of at most 7 spans (3 messages of 2):
        the whole topic read at once, read again, and read in units cut by ``split`` (at
        multiples of 10 and of 5) give the same blocks, origins and spans; a unit cut off
        the alignment changes them (the origins depend on the cut)."""
        await send_spans(gateway, 0, 40, per=2)
        lim = Limits(block_offsets=5, block_items=7)
        async with KafkaRange(cfg, topics[0], limits=lim) as src:
            ranges = await src.plan()
        whole = await replay(cfg, topics[0], ranges, lim)
        again = await replay(cfg, topics[0], ranges, lim)
        units: list[RangeBlock] = []
        for unit in split(ranges, 8, lim):
            units += await replay(cfg, topics[0], [unit], lim)  # a reader per unit
        fives = [b for u in split(ranges, 5, lim) for b in await replay(cfg, topics[0], [u], lim)]

        def origins(blocks: list[RangeBlock]) -> list[tuple[str, list[str]]]:
            """Each block's, with its batches' (their insert tokens)."""
            return sorted((b.origin, sorted(x.origin for x in b.batches)) for b in blocks)

        tokens = [x for _, xs in origins(whole) for x in xs]
        assert len(set(tokens)) == len(tokens) > 20
        assert origins(whole) == origins(again) == origins(units) == origins(fives)
        assert items_of(whole) == items_of(units) == items_of(fives)
        assert len(items_of(whole)) == 80
        for b in whole:  # the cut: within a segment, at most 3 messages of 2 spans
            assert b.first // 5 == b.last // 5 and b.items <= 7 and b.messages <= 3
        assert any(b.messages == 3 for b in whole) and any(b.messages == 2 for b in whole)
        longest = max(ranges, key=lambda r: r.messages)
        assert longest.messages >= 10
        odd = [PartitionRange(longest.topic, longest.partition, longest.start, 4),
               PartitionRange(longest.topic, longest.partition, 4, longest.end)]
        moved = [b for u in odd for b in await replay(cfg, topics[0], [u], lim)]
        mine = [b for b in whole if b.partition == longest.partition]
        assert items_of(moved) == items_of(mine)
        assert origins(moved) != origins(mine)

    async def test_live_consumer_group_untouched(
            self, kafka_broker: Any, cfg: ReceiverConfig, topics: tuple[str, str],
            gateway: KafkaExporter) -> None:
        """A live correlator (the kafka receiver, group G) has consumed and committed the
        topic; a replay of all of it leaves G's committed offsets and metadata as they
        were, creates no consumer group, and triggers no rebalance of G's member."""
        await send_spans(gateway, 0, 12)
        delivered: list[Batch] = []

        class Sink:
            async def consume(self, batch: Batch) -> None:
                delivered.append(batch)

        group = f"live-{uuid.uuid4().hex[:6]}"
        live = KafkaReceiver(
            ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                           profiles=TopicConfig(topics[1]), group_id=group),
            Context("kafka", ["traces"], next={"traces": Sink()}))
        rebalances: list[set[TopicPartition]] = []
        forget = live._forget

        def counted(tps: Collection[TopicPartition]) -> None:  # revoked or assigned
            rebalances.append(set(tps))
            forget(tps)

        live._forget = counted  # type: ignore[method-assign]
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        await admin.start()
        await live.start()
        try:
            async with asyncio.timeout(30):
                while live.metrics["committed_messages"] < 12:
                    await asyncio.sleep(0.05)
            before = await admin.list_consumer_group_offsets(group)
            groups = sorted(g[0] for g in await admin.list_consumer_groups())
            assert group in groups and before
            seen = len(rebalances)
            async with KafkaRange(cfg, topics[0]) as src:
                blocks = [b async for b in src.read(await src.plan())]
            assert len(items_of(blocks)) == 24
            await asyncio.sleep(4)  # past a heartbeat: a joining member would rebalance G
            assert await admin.list_consumer_group_offsets(group) == before
            assert sorted(g[0] for g in await admin.list_consumer_groups()) == groups
            assert len(rebalances) == seen and live.failed is None
            assert live.metrics["committed_messages"] == 12
        finally:
            await live.shutdown()
            await admin.close()

    async def test_malformed_messages_are_counted_not_fatal(
            self, cfg: ReceiverConfig, topics: tuple[str, str], raw_producer: Any) -> None:
        """Garbage, a tombstone, a message naming two tenants and one over
        ``max_message_bytes`` among good ones: four counted as malformed in their block,
        the good ones replayed as their tenants', in one read."""
        topic = topics[0]
        big = span_request([sid(900 + k) for k in range(200)]).SerializeToString()
        assert len(big) > 2048
        msgs: list[tuple[bytes | None, list[tuple[str, bytes]]]] = [
            (span_request([sid(1)]).SerializeToString(), [("tenant", b"team-a")]),
            (b"\xff\xff not protobuf", []),
            (None, []),
            (span_request([sid(2)]).SerializeToString(),
             [("tenant", b"team-a"), ("tenant", b"team-b")]),
            (big, []),
            (span_request([sid(3)]).SerializeToString(), []),
        ]
        for value, headers in msgs:
            await raw_producer.send_and_wait(topic, value, key=b"k", partition=1,
                                             headers=headers)
        async with KafkaRange(cfg, topic, limits=Limits(max_message_bytes=2048)) as src:
            blocks = [b async for b in src.read(await src.plan(offsets={1: (0, 6)}))]
        assert sum(b.malformed for b in blocks) == 4
        assert sum(b.messages for b in blocks) == 6
        assert items_of(blocks) == [(DEFAULT_TENANT, sid(3)), ("team-a", sid(1))]

    async def test_stops_at_the_range_end_while_the_topic_grows(
            self, cfg: ReceiverConfig, topics: tuple[str, str], raw_producer: Any) -> None:
        """A writer keeps adding to the partition before and during the read: the read of
        the plan (open end: the end offset when planned) ends, with exactly the planned
        messages, none after them."""
        topic = topics[0]
        for i in range(150):
            await raw_producer.send(topic, span_request([sid(i)]).SerializeToString(),
                                    partition=2)
        await raw_producer.flush()
        stop = asyncio.Event()

        async def writer() -> None:
            i = 1000
            while not stop.is_set():
                await raw_producer.send_and_wait(
                    topic, span_request([sid(i)]).SerializeToString(), partition=2)
                i += 1

        task = asyncio.create_task(writer())
        try:
            await asyncio.sleep(0.2)
            lim = Limits(max_poll_records=5, block_bytes=1000)
            async with KafkaRange(cfg, topic, limits=lim) as src:
                (rng,) = [r for r in await src.plan() if r.partition == 2]
                assert rng.messages > 150
                async with asyncio.timeout(60):
                    blocks = [b async for b in src.read([rng])]
                tp = TopicPartition(topic, 2)
                grown = (await src._client().end_offsets([tp]))[tp]
        finally:
            stop.set()
            await task
        assert grown > rng.end  # it was written to while being read
        assert sum(b.messages for b in blocks) == rng.messages
        assert max(b.last for b in blocks) == rng.end - 1
        assert len(items_of(blocks)) == rng.messages
        # no block over block_bytes (the messages are ~140 bytes: several per block)
        assert all(b.bytes <= 1000 for b in blocks) and max(b.messages for b in blocks) > 3

    async def test_bad_ranges_are_clear_errors(
            self, kafka_broker: Any, cfg: ReceiverConfig, topics: tuple[str, str],
            raw_producer: Any) -> None:
        """A partition the topic lacks, a topic that does not exist (and is not created by
        asking), offsets not written yet, offsets retention deleted: each a ConfigError
        naming it; an empty range reads nothing."""
        topic = topics[0]
        for i in range(5):
            await raw_producer.send_and_wait(topic, span_request([sid(i)]).SerializeToString(),
                                             partition=0)
        async with KafkaRange(cfg, topic) as src:
            with pytest.raises(ConfigError, match=r"has no partition 3, 7 \(it has 0-2\)"):
                await src.plan(offsets={0: (0, 1), 7: (0, 1), 3: (0, 0)})
            with pytest.raises(ConfigError, match=r"partition 0: 2-9 ends after the last "
                                                  r"message written, the end offset is 5"):
                await src.plan(offsets={0: (2, 9)})
            empty = await src.plan(offsets={0: (3, 3), 1: (0, 0)})
            assert [r.messages for r in empty] == [0, 0]
            assert [b async for b in src.read(empty)] == []
            with pytest.raises(ConfigError, match="has no partition 5"):
                [b async for b in src.read([PartitionRange(topic, 5, 0, 1)])]
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        await admin.start()
        try:
            await admin.delete_records({TopicPartition(topic, 0): RecordsToDelete(2)},
                                       timeout_ms=10_000)
            async with KafkaRange(cfg, topic) as src:
                with pytest.raises(ConfigError, match="partition 0: 1-4 starts before the "
                                                      "log, which begins at 2 now"):
                    await src.plan(offsets={0: (1, 4)})
                blocks = [b async for b in src.read(await src.plan())]
                assert items_of(blocks) == [(DEFAULT_TENANT, sid(i)) for i in range(2, 5)]
            ghost = f"bf_absent_{uuid.uuid4().hex[:8]}"
            gone = cfg.__class__(brokers=cfg.brokers, traces=TopicConfig(ghost))
            async with KafkaRange(gone, ghost) as src:
                with pytest.raises(ConfigError, match=f"topic '{ghost}' does not exist"):
                    await src.plan(since=0)
            assert ghost not in await admin.list_topics()
        finally:
            await admin.close()
        with pytest.raises(ConfigError, match="neither traces.topic"):
            signal_of(cfg, "elsewhere")
        assert Counter(signal_of(cfg, t) for t in topics) == {"traces": 1, "profiles": 1}

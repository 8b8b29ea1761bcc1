"""``backfill kafka`` end to end (issue #15): what the gateway wrote to a real broker, replayed
into an empty embedded store, gives exactly the live correlator's per-span CPU for the
same data, for two tenants with the same ids; replayed again, every table is unchanged."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.backfill.job import Job, plan_only
from pipeline.backfill.sources import KafkaSource
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter
from pipeline.exporters.kafka import Config as ExporterConfig
from pipeline.exporters.kafka import KafkaExporter
from pipeline.kafka import TopicConfig
from pipeline.otlp.builder import encode_profiles
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.kafka import Config as ReceiverConfig
from pipeline.records import ProfileBatch
from pipeline.registry import Context
from tests.backfill.dataset import Data, generate, traces_request
from tests.backfill.test_job import live, open_store, per_span, snapshot
from tests.kafka_broker import create_topics

TENANTS = ("default", "team-b")


@pytest.fixture
async def topics(kafka_broker: Any) -> tuple[str, str]:
    names = (f"bfj_spans_{uuid.uuid4().hex[:8]}", f"bfj_profiles_{uuid.uuid4().hex[:8]}")
    await create_topics(kafka_broker.bootstrap, *names, partitions=3)
    return names


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[ClickHouseExporter, ...]]:
    opened = [await open_store(tmp_path, db) for db in ("live", "bf")]
    try:
        yield tuple(opened)
    finally:
        for ex in opened:
            await ex.shutdown()


async def gateway_writes(bootstrap: str, topics: tuple[str, str], data: Data,
                         tenant: str) -> None:
    """The data as the gateway writes it: OTLP requests of 200 spans or samples, a
    message per trace, the tenant header."""
    ex = KafkaExporter(ExporterConfig(brokers=[bootstrap], traces=TopicConfig(topics[0]),  # type: ignore[arg-type]
                                      profiles=TopicConfig(topics[1]), timeout=10.0),
                       Context("kafka", ["traces", "profiles"]))
    await ex.start()
    try:
        for i in range(0, len(data.spans), 200):
            batch = decode_traces(traces_request(data.spans[i:i + 200])).batch
            batch.tenant = tenant
            await ex.consume(batch)
        for i in range(0, len(data.samples), 200):
            req = encode_profiles(ProfileBatch(data.samples[i:i + 200], data.stacks))
            pbatch = decode_profiles(req).batch
            pbatch.tenant = tenant
            await ex.consume(pbatch)
    finally:
        await ex.shutdown()


async def end_offsets(bootstrap: str, topics: tuple[str, ...]) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(3)]
        return sum((await c.end_offsets(tps)).values())
    finally:
        await c.stop()


async def test_kafka_replay_is_live(kafka_broker: Any, topics: tuple[str, str],
                                    stores: tuple[ClickHouseExporter, ...]) -> None:
    live_db, bf = stores
    datasets = {"default": generate(300, seed=5), "team-b": generate(300, seed=5)}
    for s in datasets["team-b"].samples:  # same ids, other CPU
        s.value *= 2
    for tenant, d in datasets.items():
        await gateway_writes(kafka_broker.bootstrap, topics, d, tenant)
        await live(live_db, d, tenant)
    # the correlator's receiver config: its topics say which signal each holds
    cfg = ReceiverConfig(brokers=[kafka_broker.bootstrap], traces=TopicConfig(topics[0]),
                         profiles=TopicConfig(topics[1]), timeout=10.0)  # type: ignore[arg-type]
    summary = await Job(bf, bf.consume, "kafka-1").run(KafkaSource(cfg, list(topics)))
    assert not summary["failed"] and not summary["refused"], summary
    assert summary["spans"] == sum(len(d.spans) for d in datasets.values())
    assert summary["samples"] == sum(len(d.samples) for d in datasets.values())
    for tenant in TENANTS:
        want = await per_span(live_db, tenant)
        assert want and await per_span(bf, tenant) == want, tenant
    once = await snapshot(bf)
    dry = await plan_only(bf, KafkaSource(cfg, list(topics)), None, None)
    # a unit per partition of each topic, and what the topics hold (their end offsets)
    ends = await end_offsets(kafka_broker.bootstrap, topics)
    assert dry["load_units"] == 6 and dry["messages"] == ends > 0, dry
    await Job(bf, bf.consume, "kafka-2").run(KafkaSource(cfg, list(topics)))
    assert await snapshot(bf) == once

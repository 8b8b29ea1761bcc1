"""The Kafka exporter co-partitions with the OpenTelemetry Collector's Kafka exporter: the
same traces sent through a real Collector (OTLP receiver -> kafka exporter with
``partition_traces_by_id: true`` and its default ``record_partitioner``) and through
spanprof's exporter (its default ``partitioner``) land on the same partition numbers, spans
and samples alike; ``murmur2`` would not.

Needs a Collector binary with the contrib Kafka exporter: ``SPANPROF_OTELCOL``, or the one
the gateway benchmark builds under ``~/.cache/spanprof-bench/collector-*/otelcol``
(``SPANPROF_BENCH_CACHE``), built here with that benchmark's build (Go and the module
proxy, about 90 s the first time on a machine, cached after) when the team's harness is
beside the project (``../shared/bench/collector``); skipped only without either. Uses the
real broker (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiokafka import AIOKafkaConsumer
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from pipeline.config import Duration
from pipeline.exporters.kafka import Config, KafkaExporter
from pipeline.kafka import TopicConfig, murmur2_partition, sarama_partition
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.registry import Context
from tests.conftest import free_port
from tests.kafka_broker import create_topics
from tests.pipeline.receivers.test_otlp_grpc import span_request

PARTITIONS = 12  # more buckets than the usual 6: a different hash shows on more traces
TRACES = [random.Random(i).randbytes(16) for i in range(48)]


def _collector_binary() -> Path | None:
    if os.environ.get("SPANPROF_OTELCOL"):
        return Path(os.environ["SPANPROF_OTELCOL"])
    cache = Path(os.environ.get("SPANPROF_BENCH_CACHE",
                                Path.home() / ".cache" / "spanprof-bench"))
    found = sorted(cache.glob("collector-*/otelcol"), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1]
    harness = Path(__file__).resolve().parents[3].parent / "shared/bench/collector/bench.py"
    if not harness.exists() or shutil.which("go") is None:
        return None
    spec = importlib.util.spec_from_file_location("collector_bench", harness)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return Path(bench.build_collector())  # the harness's own build, cached as above


@pytest.fixture
def otelcol(tmp_path: Path) -> Path:
    binary = _collector_binary()
    if binary is None or not os.access(binary, os.X_OK):
        pytest.skip("no OpenTelemetry Collector binary: set SPANPROF_OTELCOL (the gateway "
                    "benchmark builds one under ~/.cache/spanprof-bench)")
    return binary


@pytest.fixture
def collector(otelcol: Path, kafka_broker: Any, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A running Collector writing traces to a fresh topic: (its OTLP endpoint, the topic)."""
    topic = f"collector_spans_{uuid.uuid4().hex[:8]}"
    asyncio.run(create_topics(kafka_broker.bootstrap, topic, partitions=PARTITIONS))
    endpoint = f"127.0.0.1:{free_port()}"
    config = tmp_path / "otelcol.yaml"
    config.write_text(f"""\
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "{endpoint}"}}
exporters:
  kafka:
    brokers: ["{kafka_broker.bootstrap}"]
    traces: {{topic: {topic}, encoding: otlp_proto}}
    partition_traces_by_id: true
service:
  telemetry:
    metrics: {{level: none}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [kafka]}}
""")
    log = tmp_path / "otelcol.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(otelcol), "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        host, port = endpoint.rsplit(":", 1)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(0.1)
        yield endpoint, topic
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


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


def _request() -> tps.ExportTraceServiceRequest:
    req = tps.ExportTraceServiceRequest()
    for t in TRACES:
        req.MergeFrom(span_request([bytes([7]) * 8, bytes([8]) * 8], trace_id=t))
    return req


def _trace_ids(value: bytes) -> set[str]:
    msg = tps.ExportTraceServiceRequest.FromString(value)
    return {bytes(s.trace_id).hex() for rs in msg.resource_spans for ss in rs.scope_spans
            for s in ss.spans}


class TestCollectorPartitions:
    async def test_default_partitioner_puts_traces_where_the_collector_does(
            self, collector: tuple[str, str], kafka_broker: Any) -> None:
        """Spans written by the Collector and spans and samples written by spanprof's
        exporter with its defaults: every trace is on the same partition number in all
        three topics, which is sarama_compat's (FNV-1a), not murmur2's."""
        endpoint, collector_topic = collector
        async with grpc.aio.insecure_channel(endpoint) as channel:
            await trace_service_pb2_grpc.TraceServiceStub(channel).Export(_request(),
                                                                           timeout=30)
        # one message per trace, keyed by its hex
        theirs = {}
        for rec in await _read_all(kafka_broker.bootstrap, collector_topic, len(TRACES)):
            assert _trace_ids(rec.value) == {rec.key.decode()}
            theirs[rec.key.decode()] = rec.partition
        assert sorted(theirs) == sorted(t.hex() for t in TRACES)

        suffix = uuid.uuid4().hex[:8]
        spans_topic, profiles_topic = f"spans_{suffix}", f"profiles_{suffix}"
        await create_topics(kafka_broker.bootstrap, spans_topic, profiles_topic,
                            partitions=PARTITIONS)
        cfg = Config(brokers=[kafka_broker.bootstrap], traces=TopicConfig(spans_topic),
                     profiles=TopicConfig(profiles_topic), timeout=Duration(5.0))
        assert cfg.partitioner == "sarama_compat"
        ex = KafkaExporter(cfg, Context("kafka", ["traces", "profiles"]))
        await ex.start()
        try:
            await ex.consume(decode_traces(_request()).batch)
            b = ProfileBuilder()
            for t in TRACES:
                b.sample(["f"], 10, t, bytes([7]) * 8, service="svc")
            await ex.consume(decode_profiles(b.build()).batch)
        finally:
            await ex.shutdown()

        n_parts = len(set(theirs.values()))  # spanprof: a message per partition touched
        ours: dict[str, int] = {}
        for rec in await _read_all(kafka_broker.bootstrap, spans_topic, n_parts):
            for hex_id in _trace_ids(rec.value):
                ours[hex_id] = rec.partition
        assert ours == theirs
        samples: dict[str, int] = {}
        for rec in await _read_all(kafka_broker.bootstrap, profiles_topic, n_parts):
            d = decode_profiles(pps.ExportProfilesServiceRequest.FromString(rec.value))
            for s in d.batch.samples:
                samples[s.trace_id.hex()] = rec.partition
        assert samples == theirs

        assert all(sarama_partition(k.encode(), PARTITIONS) == p for k, p in theirs.items())
        # the test tells the two apart: murmur2 would have split these traces
        assert sum(murmur2_partition(k.encode(), PARTITIONS) != p
                   for k, p in theirs.items()) > len(TRACES) // 2

"""Three correlator workers in one consumer group over 6-partition topics; one is killed
with SIGKILL mid-stream and restarted. Afterwards every span has exactly one attribution,
equal to the ground truth, including traces whose samples carry only a span id.

The embedded engine can be opened by one process only and no ClickHouse server can be
installed here, so each worker writes its own embedded store; at the end the three stores
are loaded into one ClickHouse table of the same engine, which is what a shared server
would hold, and the answer is read from there with the same views.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.exporters.clickhouse.migrate import bootstrap, statements
from pipeline.exporters.clickhouse.schema import SchemaOptions
from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, clickhouse, side_by_side, wait_until
from tests.e2e.otlp_clients import profiles_stub, traces_stub
from tests.e2e.test_kafka_tier import CORRELATOR, GATEWAY
from tests.e2e.test_sigterm import _spans
from tests.kafka_broker import create_topics

pytestmark = pytest.mark.e2e
MS = 1_000_000
PARTITIONS = 6
TABLES = ["span_attribution", "span_functions", "span_index", "otel_traces"]


async def _lag(bootstrap_servers: str, group: str, topics: list[str]) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, group_id=group)
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]
        ends = await c.end_offsets(tps)
        lag = 0
        for tp in tps:
            lag += ends[tp] - ((await c.committed(tp)) or 0)
        return lag
    finally:
        await c.stop()


async def _stable_members(bootstrap_servers: str, group: str) -> int:
    """The group's members once it is Stable (every member joined and assigned); 0 while
    it rebalances."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        (resp,) = await admin.describe_consumer_groups([group])
        (g,) = resp.to_object()["groups"]
        return len(g["members"]) if g["error_code"] == 0 and g["state"] == "Stable" else 0
    finally:
        await admin.close()


async def _rewind(bootstrap_servers: str, group: str, topics: list[str],
                  partitions: range = range(3)) -> None:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, group_id=group,
                         enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in partitions]
        c.assign(tps)
        await c.commit({tp: 0 for tp in tps})
    finally:
        await c.stop()


class TestWorkerCrash:
    def test_sigkill_and_restart_exactly_one_attribution(self, tmp_path: Path,
                                                         kafka_broker: Any) -> None:
        """SIGKILL one of three workers mid-stream, restart it; every span ends with exactly
        one attribution row whose cpu_ns is the ground truth (no loss, no double count)."""
        suffix = uuid.uuid4().hex[:6]
        names = {"brokers": kafka_broker.bootstrap, "group": f"crash{suffix}",
                 "spans": f"spans{suffix}", "profiles": f"profiles{suffix}"}
        asyncio.run(create_topics(kafka_broker.bootstrap, names["spans"], names["profiles"],
                                  partitions=PARTITIONS))
        worker_cfg = (CORRELATOR % names).replace(
            "traces: {{topic:", "session_timeout: 6s\n    heartbeat_interval: 1s\n"
            "    traces: {{topic:", 1)
        gateway = SpanprofProcess(tmp_path / "gw", config_text=GATEWAY % names)
        workers = [SpanprofProcess(tmp_path / f"w{i}", config_text=worker_cfg)
                   for i in range(3)]
        rng = random.Random(3)
        truth: dict[tuple[bytes, bytes], int] = defaultdict(int)
        all_spans: list[tuple[bytes, bytes]] = []
        try:
            side_by_side(gateway.start, *(w.start for w in workers))
            # the group settled on its three members (each owns partitions)
            wait_until(lambda: asyncio.run(_stable_members(kafka_broker.bootstrap,
                                                           names["group"])) == 3,
                       timeout=60, interval=0.2)
            channel = grpc.insecure_channel(gateway.grpc_target)
            tstub, pstub = traces_stub(channel), profiles_stub(channel)
            for wave in range(8):
                req, keys = _spans(wave, 0)
                tstub.Export(req, timeout=30)
                all_spans.extend(keys)
                b = ProfileBuilder()
                for j, (tid, sid) in enumerate(keys):
                    span_only = j % 3 == 0  # a third carry only the span id
                    for k in range(rng.randint(1, 3)):
                        v = rng.randint(1, 30) * MS
                        truth[(tid, sid)] += v
                        b.sample([f"fn{k}", "main"], v, bytes(16) if span_only else tid, sid,
                                 service=f"load-{wave}")
                pstub.Export(b.build(), timeout=30)
                if wave == 3:  # while the wave is in flight in the workers
                    workers[1].stop(signal.SIGKILL)
                if wave == 5:
                    workers[1].start()
                if wave != 3:
                    time.sleep(0.3)
            topics = [names["spans"], names["profiles"]]
            # every message delivered (offsets are committed after delivery); a stop
            # reports and writes everything a worker holds
            wait_until(lambda: asyncio.run(_lag(kafka_broker.bootstrap, names["group"],
                                                topics)) == 0, timeout=120, interval=0.25)
            for w, rc in zip(workers, side_by_side(*(w.stop for w in workers)), strict=True):
                assert rc == 0, w.logs()[-2000:]
            # Whatever the kill hit, force a redelivery too: rewind half the partitions to 0
            # and let one worker read them again.
            asyncio.run(_rewind(kafka_broker.bootstrap, names["group"], topics))
            workers[0].start()
            wait_until(lambda: asyncio.run(_lag(kafka_broker.bootstrap, names["group"],
                                                topics)) == 0, timeout=120, interval=0.25)
            assert workers[0].stop() == 0
            assert gateway.stop() == 0
        finally:
            for p in (gateway, *workers):
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.kill()

        merged = tmp_path / "merged"
        copies: dict[str, list[tuple[list[str], list[tuple[Any, ...]]]]] = defaultdict(list)
        written = 0
        for w in workers:
            with clickhouse(w.data) as ch:
                for table in TABLES:
                    res = ch.query(f"SELECT * FROM spanprof.{table}")
                    copies[table].append((list(res.column_names), list(res.result_rows)))
                written += ch.query("SELECT count() FROM spanprof.span_attribution"
                                    ).result_rows[0][0]
        with clickhouse(merged) as ch:
            o = SchemaOptions(ttl_seconds=0)
            for sql in bootstrap(o) + [s for _, stmts in statements(o) for s in stmts]:
                ch.command(sql)
            for table in TABLES:
                for cols, rows in copies[table]:
                    if rows and table != "span_index":  # span_index fills from otel_traces
                        ch.insert(f"spanprof.{table}", rows, column_names=cols)
            raw_rows = ch.query("SELECT count() FROM spanprof.span_attribution").result_rows[0][0]
            final_rows = ch.query("SELECT count() FROM spanprof.span_attribution FINAL"
                                  ).result_rows[0][0]
            totals = ch.query("SELECT trace_id, span_id, count() OVER (PARTITION BY trace_id, "
                              "span_id) AS n, cpu_ns FROM "
                              "spanprof.span_attribution_totals").result_rows
            # a span's name and duration are in otel_traces (attribution rows carry them
            # only when the worker had seen the span before its samples)
            stored = {(bytes.fromhex(t), bytes.fromhex(s)) for t, s in ch.query(
                "SELECT TraceId, SpanId FROM spanprof.otel_traces FINAL").result_rows}
        got = {(bytes.fromhex(t), bytes.fromhex(s)): (n, cpu) for t, s, n, cpu in totals}
        assert not [k for k in got if not k[0]], "span-only samples left unresolved"
        assert stored == set(all_spans)
        for key in all_spans:
            n, cpu = got[key]
            assert n == 1
            assert cpu == truth[key], (key, cpu, truth[key])
        assert len(got) == len(all_spans)
        assert raw_rows > final_rows, "the rewind should have redelivered messages"
        # rows written twice (a message redelivered after the kill) were kept once
        print(f"attribution rows written {raw_rows}, kept {final_rows}, spans {len(got)}")


class TestRedelivery:
    def test_redelivered_range_writes_no_new_rows(self, tmp_path: Path,
                                                  kafka_broker: Any) -> None:
        """A worker reads everything, its group is rewound to the start, and it reads it all
        again: spans (FINAL), samples and attribution come out exactly as after one read."""
        suffix = uuid.uuid4().hex[:6]
        names = {"brokers": kafka_broker.bootstrap, "group": f"redo{suffix}",
                 "spans": f"spans{suffix}", "profiles": f"profiles{suffix}"}
        topics = [names["spans"], names["profiles"]]
        asyncio.run(create_topics(kafka_broker.bootstrap, *topics, partitions=PARTITIONS))
        gateway = SpanprofProcess(tmp_path / "gw", config_text=GATEWAY % names)
        worker = SpanprofProcess(tmp_path / "w", config_text=CORRELATOR % names)
        truth: dict[tuple[bytes, bytes], int] = defaultdict(int)
        n_samples = 0
        try:
            gateway.start()
            channel = grpc.insecure_channel(gateway.grpc_target)
            for wave in range(3):
                req, keys = _spans(wave, 0)
                traces_stub(channel).Export(req, timeout=30)
                b = ProfileBuilder()
                for j, (tid, sid) in enumerate(keys):
                    truth[(tid, sid)] += (j + 1) * MS
                    b.sample([f"fn{j % 4}"], (j + 1) * MS, tid, sid, service="svc")
                    n_samples += 1
                profiles_stub(channel).Export(b.build(), timeout=30)

            def start_as_the_gateway_stops() -> None:
                # every Export above was answered once Kafka had acknowledged its messages:
                # the topics are complete before the gateway's stop
                _, rc = side_by_side(worker.start, gateway.stop)
                assert rc == 0

            def read_all(start: Callable[[], None] = worker.start) -> None:
                start()
                # every message delivered (offsets are committed after delivery); a stop
                # reports and writes everything the worker holds
                wait_until(lambda: asyncio.run(_lag(kafka_broker.bootstrap, names["group"],
                                                    topics)) == 0, timeout=90, interval=0.1)
                assert worker.stop() == 0

            read_all(start_as_the_gateway_stops)
            asyncio.run(_rewind(kafka_broker.bootstrap, names["group"], topics,
                                range(PARTITIONS)))
            read_all()
        finally:
            for p in (gateway, worker):
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.kill()
        with clickhouse(worker.data) as ch:
            assert ch.query("SELECT count() FROM spanprof.otel_traces FINAL"
                            ).result_rows[0][0] == len(truth)
            assert ch.query("SELECT count() FROM spanprof.profile_samples").result_rows[0][0] \
                == n_samples
            got = {(bytes.fromhex(t), bytes.fromhex(s)): c for t, s, c in ch.query(
                "SELECT trace_id, span_id, cpu_ns FROM spanprof.span_attribution_totals"
            ).result_rows}
        assert got == dict(truth)

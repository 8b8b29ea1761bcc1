"""The Kafka tier gets child-span attribution by re-attribution (issue #15): behind Kafka the
correlator writes link rows only (a sample on the span it is labelled with, the root), so
a child span with no label of its own gets nothing; ``spanprof backfill reattribute`` over
the closed range (what the chart's CronJob runs) places the same samples as the embedded
pipeline does. Measured against ground truth on bench/accuracy.py's ``sync`` case."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench import accuracy
from pipeline.otlp.builder import encode_profiles
from pipeline.records import ProfileBatch
from tests.backfill.dataset import traces_request
from tests.conftest import SpanprofProcess, clickhouse, wait_until
from tests.e2e.otlp_clients import profiles_stub, traces_stub
from tests.e2e.test_kafka_tier import GATEWAY

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

# the Kafka tier's correlator, keeping what it stores (the generated data is from 2023)
CORRELATOR = """
receivers:
  kafka:
    brokers: ["%(brokers)s"]
    group_id: %(group)s
    traces: {{topic: %(spans)s}}
    profiles: {{topic: %(profiles)s}}
connectors:
  spancorrelator: {{grace: 1s, flush_interval: 200ms}}
exporters:
  clickhouse: {{endpoint: "chdb://{data}", flush_interval: 200ms, ttl: 0s}}
service:
  admin: {{endpoint: "127.0.0.1:{admin_port}"}}
  telemetry: {{logs: {{encoding: json}}}}
  pipelines:
    traces: {{receivers: [kafka], exporters: [clickhouse, spancorrelator]}}
    profiles: {{receivers: [kafka], exporters: [clickhouse, spancorrelator]}}
    attributions: {{receivers: [spancorrelator], exporters: [clickhouse]}}
"""


def accuracy_of(data: Path, g: accuracy.Generated) -> float:
    """Share of the true CPU each stored function row puts on the span its sample was
    really taken in (every sample has a leaf frame of its own: ``g.where``)."""
    with clickhouse(data) as ch:
        rows = ch.query("SELECT span_id, function, sum(self_cpu_ns) FROM "
                        "spanprof.span_functions FINAL GROUP BY span_id, function").result_rows
    right = sum(int(v) for s, fn, v in rows if g.where.get(fn) == bytes.fromhex(s))
    return right / sum(g.truth.values())


def test_reattribution_gives_the_kafka_tier_child_spans(tmp_path: Path,
                                                        kafka_broker: Any) -> None:
    sc = next(s for s in accuracy.SCENARIOS if s.name == "sync")
    g = accuracy.generate(sc)
    embedded = accuracy.run(sc).accuracy
    names = {"brokers": kafka_broker.bootstrap, "group": f"g{uuid.uuid4().hex[:6]}",
             "spans": f"s{uuid.uuid4().hex[:6]}", "profiles": f"p{uuid.uuid4().hex[:6]}"}
    gateway = SpanprofProcess(tmp_path / "gw", config_text=GATEWAY % names)
    correlator = SpanprofProcess(tmp_path / "co", config_text=CORRELATOR % names)
    gateway.start()
    correlator.start()
    channel = grpc.insecure_channel(gateway.grpc_target)
    for i in range(0, len(g.spans), 500):
        traces_stub(channel).Export(traces_request(g.spans[i:i + 500]), timeout=30)
    for i in range(0, len(g.samples), 500):
        profiles_stub(channel).Export(encode_profiles(ProfileBatch(g.samples[i:i + 500],
                                                                   g.stacks)), timeout=30)
    # every sample stored, and its block's rows with it (the Kafka tier writes a block's
    # attribution before it commits the block)
    wait_until(lambda: sent_rows(correlator, "profile_samples") >= len(g.samples), timeout=90)
    wait_until(lambda: sent_rows(correlator, "span_functions") > 0, timeout=30)
    assert gateway.stop() == 0
    assert correlator.stop() == 0
    kafka_tier = accuracy_of(correlator.data, g)

    lo = (min(s.start_ns for s in g.spans) // 10**9) - 60
    hi = (max(s.end_ns for s in g.spans) // 10**9) + 120

    def iso(t: int) -> str:
        return datetime.fromtimestamp(t, tz=UTC).isoformat()

    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "backfill", "reattribute",
         "--range", f"{iso(lo)}..{iso(hi)}", "-c", str(correlator.config), "--format", "json"],
        cwd=correlator.tmp, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    after = accuracy_of(correlator.data, g)
    # link rows put every sample on the root: its children's CPU lands on the wrong span
    assert kafka_tier < 0.5, kafka_tier
    assert after >= embedded - 0.005, (after, embedded)


def sent_rows(p: SpanprofProcess, table: str) -> int:
    """Rows the process's clickhouse exporter has inserted into ``table`` (/metrics)."""
    with urllib.request.urlopen(p.admin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = f'spanprof_exporter_sent_rows_total{{exporter="clickhouse",table="{table}"}} '
    return sum(int(line[len(want):]) for line in text.splitlines() if line.startswith(want))

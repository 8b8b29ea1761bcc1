"""Two tiers joined by the real Kafka broker: a gateway process (OTLP -> Kafka) and a
correlator process (Kafka -> ClickHouse), as config/gateway.yaml and config/correlator.yaml
run them."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest

from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, clickhouse, side_by_side, wait_until
from tests.e2e.otlp_clients import profiles_stub, sdk_spans

pytestmark = pytest.mark.e2e
MS = 1_000_000

GATEWAY = """
receivers:
  otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:{grpc_port}"}}}}}}
exporters:
  kafka:
    brokers: ["%(brokers)s"]
    traces: {{topic: %(spans)s}}
    profiles: {{topic: %(profiles)s}}
service:
  admin: {{endpoint: "127.0.0.1:{admin_port}"}}
  telemetry: {{logs: {{encoding: json}}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [kafka]}}
    profiles: {{receivers: [otlp], exporters: [kafka]}}
"""

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
  clickhouse: {{endpoint: "chdb://{data}", flush_interval: 200ms}}
service:
  admin: {{endpoint: "127.0.0.1:{admin_port}"}}
  telemetry: {{logs: {{encoding: json}}}}
  pipelines:
    traces: {{receivers: [kafka], exporters: [clickhouse, spancorrelator]}}
    profiles: {{receivers: [kafka], exporters: [clickhouse, spancorrelator]}}
    attributions: {{receivers: [spancorrelator], exporters: [clickhouse]}}
"""


class TestKafkaTier:
    def test_gateway_to_correlator_through_kafka(self, tmp_path: Path,
                                                 kafka_broker: Any) -> None:
        """Spans from the OpenTelemetry SDK and linked profiles go into the gateway; the
        correlator, reading Kafka, stores every span with cpu_ns equal to its samples."""
        names = {"brokers": kafka_broker.bootstrap, "group": f"g{uuid.uuid4().hex[:6]}",
                 "spans": f"s{uuid.uuid4().hex[:6]}", "profiles": f"p{uuid.uuid4().hex[:6]}"}
        gateway = SpanprofProcess(tmp_path / "gw", config_text=GATEWAY % names)
        correlator = SpanprofProcess(tmp_path / "co", config_text=CORRELATOR % names)
        gateway.start()  # (a test that fails half-way: conftest's fixture kills both)
        keys = sdk_spans(gateway.grpc_target, "checkout", 20)
        correlator.start()  # after the spans: it reads the topics from the start
        wait_until(lambda: len(correlator.get("/api/v1/spans?limit=1000")["spans"]) == 20,
                   timeout=60)
        # profiles come later, as profilers upload every 10-60 s
        truth: dict[tuple[bytes, bytes], int] = defaultdict(int)
        b = ProfileBuilder()
        for j, (tid, sid) in enumerate(keys):
            for k in range(j % 3 + 1):
                truth[(tid, sid)] += (k + 1) * MS
                b.sample([f"fn{k}", "main"], (k + 1) * MS, tid, sid, service="checkout")
        stub = profiles_stub(grpc.insecure_channel(gateway.grpc_target))
        assert not stub.Export(b.build(), timeout=30).HasField("partial_success")

        def all_attributed() -> bool:
            got = {(s["trace_id"], s["span_id"]): s["cpu_ns"] for s in
                   correlator.get("/api/v1/spans?limit=1000")["spans"]}
            return all(got.get((t.hex(), s.hex())) == v for (t, s), v in truth.items())
        wait_until(all_attributed, timeout=60)
        assert gateway.stop() == 0
        assert correlator.stop() == 0
        with clickhouse(correlator.data) as ch:
            assert ch.query("SELECT count() FROM spanprof.otel_traces").result_rows[0][0] == 20
            rows = dict(((bytes.fromhex(t), bytes.fromhex(s)), c) for t, s, c in ch.query(
                "SELECT trace_id, span_id, cpu_ns FROM spanprof.span_attribution_totals"
            ).result_rows)
            assert rows == dict(truth)
            # the samples' rows named their spans (seen earlier on the same partitions), so
            # the per-operation aggregates hold all the CPU too
            assert ch.query("SELECT sum(cpu_ns), uniqExactMerge(calls) FROM spanprof.op_minute"
                            ).result_rows == [(sum(truth.values()), 20)]


class TestBrokerOutage:
    def test_client_told_retry_while_broker_down_nothing_acked_lost(
            self, tmp_path: Path) -> None:
        """A client keeps sending while the broker is stopped and started again: during the
        outage it gets UNAVAILABLE, never OK; afterwards every span it was told was accepted
        is in ClickHouse, written by the correlator."""
        import threading
        import time

        from tests.e2e.otlp_clients import traces_stub
        from tests.e2e.test_sigterm import _spans
        from tests.kafka_broker import KafkaBroker

        broker = KafkaBroker(tmp_path / "kafka")  # its own broker: this test stops it
        broker.start()
        names = {"brokers": broker.bootstrap, "group": "outage", "spans": "otlp_spans",
                 "profiles": "otlp_profiles"}
        # a write Kafka does not acknowledge within 1 s is refused (UNAVAILABLE): the
        # outage shows in about 2 s a request (the metadata wait, then the write's)
        gateway = SpanprofProcess(tmp_path / "gw", config_text=(GATEWAY % names).replace(
            "service:", "    timeout: 1s\nservice:"))
        correlator = SpanprofProcess(tmp_path / "co", config_text=CORRELATOR % names)
        acked: list[tuple[bytes, bytes]] = []
        codes: list[str] = []
        stop = threading.Event()
        try:
            side_by_side(gateway.start, correlator.start)  # the two come up at once
            stub = traces_stub(grpc.insecure_channel(gateway.grpc_target))

            def client() -> None:
                n = 0
                while not stop.is_set():
                    req, keys = _spans(1, n)
                    n += 1
                    try:
                        stub.Export(req, timeout=20)
                    except grpc.RpcError as err:
                        codes.append(err.code().name)
                        time.sleep(0.2)
                        continue
                    acked.extend(keys)
                    codes.append("OK")
                    time.sleep(0.05)

            t = threading.Thread(target=client)
            t.start()
            wait_until(lambda: len(acked) > 200)
            broker.stop()
            outage_start = len(codes)
            wait_until(lambda: codes[outage_start:].count("UNAVAILABLE") >= 3, timeout=60)
            broker.start()
            wait_until(lambda: codes[-3:] == ["OK"] * 3, timeout=90)
            stop.set()
            t.join(timeout=60)
            assert "UNAVAILABLE" in codes[outage_start:]
            want = {(tid.hex(), sid.hex()) for tid, sid in acked}

            def stored() -> bool:
                got = {(s["trace_id"], s["span_id"]) for s in
                       correlator.get("/api/v1/spans?limit=10000")["spans"]}
                return want <= got
            wait_until(stored, timeout=90)
            assert gateway.stop() == 0
            assert correlator.stop() == 0
        finally:
            stop.set()
            for p in (gateway, correlator):
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.kill()
            broker.stop()
        with clickhouse(correlator.data) as ch:
            got = {(t, s) for t, s in ch.query(
                "SELECT TraceId, SpanId FROM spanprof.otel_traces").result_rows}
        assert want <= got, f"{len(want - got)} acknowledged spans missing"

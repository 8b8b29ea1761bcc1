"""SIGTERM during steady load: everything a client was told was accepted is in ClickHouse."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, clickhouse
from tests.e2e.otlp_clients import profiles_stub, traces_stub

pytestmark = pytest.mark.e2e
SPANS_PER_REQUEST = 50


def _spans(worker: int, n: int) -> tuple[tps.ExportTraceServiceRequest, list[tuple[bytes, bytes]]]:
    req = tps.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add(key="service.name")
    kv.value.string_value = f"load-{worker}"
    ss = rs.scope_spans.add()
    keys = []
    now = time.time_ns()
    for i in range(SPANS_PER_REQUEST):
        tid = os.urandom(16)
        sid = (n * SPANS_PER_REQUEST + i + 1).to_bytes(4, "big") + worker.to_bytes(4, "big")
        ss.spans.add(trace_id=tid, span_id=sid, name="work", start_time_unix_nano=now,
                     end_time_unix_nano=now + 5_000_000)
        keys.append((tid, sid))
    return req, keys


@pytest.fixture(params=[False, True], ids=["answered_once_stored", "intake"])
def process(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpanprofProcess]:
    """spanprof, with or without the otlp receiver's intake (then the requests answered
    may not even be decoded when SIGTERM comes)."""
    p = SpanprofProcess(tmp_path, receiver_extra="intake: {}" if request.param else "")
    yield p
    if p.proc is not None and p.proc.poll() is None:
        p.stop(signal.SIGKILL)


class TestGracefulStop:
    def test_sigterm_under_load_loses_nothing_acknowledged(
            self, process: SpanprofProcess) -> None:
        """Four clients send spans and linked samples; SIGTERM arrives mid-stream. The process
        exits 0, and every span and sample acknowledged with OK is in ClickHouse, with the
        attribution of each span equal to its stored samples."""
        spanprof = process
        spanprof.start()
        acked_spans: list[tuple[bytes, bytes]] = []
        acked_cpu: dict[tuple[bytes, bytes], int] = defaultdict(int)
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[str] = []

        def client(worker: int) -> None:
            channel = grpc.insecure_channel(spanprof.grpc_target)
            tstub, pstub = traces_stub(channel), profiles_stub(channel)
            n = 0
            while not stop.is_set():
                req, keys = _spans(worker, n)
                n += 1
                try:
                    tstub.Export(req, timeout=30)
                except grpc.RpcError as err:
                    errors.append(err.code().name)
                    time.sleep(0.05)
                    continue
                with lock:
                    acked_spans.extend(keys)
                b = ProfileBuilder()
                for j, (tid, sid) in enumerate(keys):
                    b.sample([f"fn{j % 7}", "main"], (j + 1) * 1000, tid, sid,
                             service=f"load-{worker}")
                try:
                    pstub.Export(b.build(), timeout=30)
                except grpc.RpcError as err:
                    errors.append(err.code().name)
                    continue
                with lock:
                    for j, key in enumerate(keys):
                        acked_cpu[key] += (j + 1) * 1000
            channel.close()

        threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        with lock:
            before = len(acked_spans)
        assert before > 0, "no load reached the pipeline"
        rc = spanprof.stop()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert rc == 0, spanprof.logs()[-3000:]
        assert set(errors) <= {"UNAVAILABLE", "CANCELLED"}, errors

        with clickhouse(spanprof.data) as ch:
            stored = {(bytes.fromhex(t), bytes.fromhex(s)) for t, s in ch.query(
                "SELECT TraceId, SpanId FROM spanprof.otel_traces").result_rows}
            missing = [k for k in acked_spans if k not in stored]
            assert not missing, f"{len(missing)} acknowledged spans lost of {len(acked_spans)}"

            raw = {(bytes.fromhex(t), bytes.fromhex(s)): v for t, s, v in ch.query(
                "SELECT trace_id, span_id, sum(value) FROM spanprof.profile_samples "
                "GROUP BY trace_id, span_id").result_rows}
            attributed = {(bytes.fromhex(t), bytes.fromhex(s)): v for t, s, v in ch.query(
                "SELECT trace_id, span_id, cpu_ns FROM spanprof.span_attribution_totals"
            ).result_rows}
            short = [k for k, v in acked_cpu.items() if raw.get(k, 0) < v]
            assert not short, f"{len(short)} spans lost acknowledged samples"
            assert {k: v for k, v in attributed.items() if v} == raw
            assert len(acked_cpu) > 0

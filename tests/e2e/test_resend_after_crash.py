"""A request stored, the process killed before the client heard back, and the client
resending it to the restarted process: stored and attributed once
(pipeline/receivers/idempotency.py: each row carries its request's id)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, clickhouse

pytestmark = pytest.mark.e2e
SERVICE = "resend"
TRACE = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROFILES = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export"


def _requests() -> tuple[bytes, bytes, dict[str, int]]:
    now = time.time_ns()
    req = tps.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = SERVICE
    ss = rs.scope_spans.add()
    b = ProfileBuilder()
    want = {}
    for i in range(20):
        tid, sid = os.urandom(16), os.urandom(8)
        ss.spans.add(trace_id=tid, span_id=sid, name="op", kind=2,
                     start_time_unix_nano=now - 50_000_000, end_time_unix_nano=now)
        b.sample(["fn", "main"], 10_000_000 + i, tid, sid, service=SERVICE)
        want[sid.hex()] = 10_000_000 + i
    return req.SerializeToString(), b.build().SerializeToString(), want


def _send(p: SpanprofProcess, traces: bytes, profiles: bytes) -> None:
    with grpc.insecure_channel(p.grpc_target) as ch:
        for method, body in ((TRACE, traces), (PROFILES, profiles)):
            ch.unary_unary(method, request_serializer=None,
                           response_deserializer=None)(body, timeout=30)


def _stored(data: Path) -> tuple[int, int, dict[str, int]]:
    with clickhouse(data) as ch:
        spans = ch.query("SELECT count() FROM spanprof.otel_traces WHERE ServiceName = "
                         f"'{SERVICE}'").result_rows[0][0]
        samples = ch.query("SELECT count() FROM spanprof.profile_samples WHERE service = "
                           f"'{SERVICE}'").result_rows[0][0]
        cpu = dict(ch.query("SELECT span_id, sum(cpu_ns) FROM spanprof.span_attribution "
                            f"FINAL WHERE service = '{SERVICE}' GROUP BY span_id").result_rows)
    return int(spans), int(samples), {k: int(v) for k, v in cpu.items()}


class TestResendAfterCrash:
    @pytest.mark.parametrize("queue,intake", [(False, False), (True, False), (True, True)],
                             ids=["inserted", "sending_queue", "intake"])
    def test_a_request_resent_to_the_restarted_process_is_stored_once(
            self, tmp_path: Path, queue: bool, intake: bool) -> None:
        """Both requests are stored (acknowledged: the client may not have heard it), the
        process is SIGKILLed, started again, and the client sends both again: the answers
        are successes, and every table holds them once. With the sending queue, killed as
        soon as the client heard back: the log is inserted at the restart, before the
        receiver reads the ids of the requests it has. With the receiver's intake too: the
        requests may not even be decoded when the process dies; the restart delivers
        what its intake log holds and answers the resends as duplicates."""
        p = SpanprofProcess(tmp_path, grace="1s",
                            exporter_extra="sending_queue: {enabled: true}" if queue else "",
                            receiver_extra="intake: {}" if intake else "")
        p.start()
        traces, profiles, want = _requests()
        _send(p, traces, profiles)
        p.stop(signal.SIGKILL)
        p.start()
        _send(p, traces, profiles)  # the client's resend after its timeout
        assert p.stop(signal.SIGTERM) == 0
        spans, samples, cpu = _stored(p.data)
        assert (spans, samples) == (20, 20)
        assert cpu == want
        assert "recent_requests_loaded" in p.logs()

    def test_the_same_request_after_the_window_or_a_different_one_is_stored(
            self, tmp_path: Path) -> None:
        """Only a resend is recognised: a different request with new spans is stored."""
        p = SpanprofProcess(tmp_path, grace="1s")
        p.start()
        for _ in range(2):
            traces, profiles, _ = _requests()
            _send(p, traces, profiles)
        assert p.stop(signal.SIGTERM) == 0
        spans, samples, _ = _stored(p.data)
        assert (spans, samples) == (40, 40)


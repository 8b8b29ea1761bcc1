"""SIGKILL while the correlator holds acknowledged input: a restart attributes it, exactly
once (processors/correlate/recovery.py)."""

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
from tests.e2e.otlp_clients import profiles_stub, traces_stub

pytestmark = pytest.mark.e2e
SERVICE = "crash"
MS = 1_000_000


def _send(p: SpanprofProcess) -> tuple[dict[tuple[str, str], int], int]:
    """Two traces: a child-less span with untimed samples on it (``link``), and a root
    span with two children and timed samples labelled with the root, which go to the
    child open at their instant (``link+time``). A third trace of two spans on threads 7
    and 8, and unlabelled samples: timed ones with a thread go to the span on their thread
    (``thread``), untimed ones to the service's unattributed CPU. The CPU each span must end
    up with, and the unattributed CPU."""
    t0 = time.time_ns() - 2_000 * MS
    a_tid, a_root = os.urandom(16), os.urandom(8)
    b_tid, b_root, c1, c2 = os.urandom(16), os.urandom(8), os.urandom(8), os.urandom(8)
    req = tps.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = SERVICE
    ss = rs.scope_spans.add()
    ss.spans.add(trace_id=a_tid, span_id=a_root, name="single", kind=2,
                 start_time_unix_nano=t0, end_time_unix_nano=t0 + 50 * MS)
    ss.spans.add(trace_id=b_tid, span_id=b_root, name="root", kind=2,
                 start_time_unix_nano=t0, end_time_unix_nano=t0 + 100 * MS)
    for sid, lo, hi in ((c1, 10, 40), (c2, 50, 90)):
        ss.spans.add(trace_id=b_tid, span_id=sid, parent_span_id=b_root, name="child",
                     start_time_unix_nano=t0 + lo * MS, end_time_unix_nano=t0 + hi * MS)
    d_tid, on7, on8 = os.urandom(16), os.urandom(8), os.urandom(8)
    for sid, thread in ((on7, 7), (on8, 8)):
        sp = ss.spans.add(trace_id=d_tid, span_id=sid, name=f"on{thread}", kind=2,
                          start_time_unix_nano=t0, end_time_unix_nano=t0 + 100 * MS)
        sp.attributes.add(key="thread.id").value.int_value = thread
    b = ProfileBuilder()
    for n in range(3):
        b.sample([f"fn{n}", "main"], (n + 1) * 1_000_003, a_tid, a_root, service=SERVICE)
    timed = ((20, 7_000_001), (25, 5_000_011), (60, 3_000_007), (95, 2_000_003))
    for at, value in timed:
        b.sample(["work", "main"], value, b_tid, b_root, timestamps=[t0 + at * MS],
                 service=SERVICE)
    for at, value, thread in ((30, 4_000_037, 7), (35, 1_000_039, 7), (60, 9_000_041, 8)):
        b.sample(["spin", "main"], value, timestamps=[t0 + at * MS],
                 attributes={"thread.id": thread}, service=SERVICE)
    for value in (11_000_027, 13_000_049):
        b.sample(["idle", "main"], value, service=SERVICE)
    with grpc.insecure_channel(p.grpc_target) as ch:
        traces_stub(ch).Export(req, timeout=30)
        profiles_stub(ch).Export(b.build(), timeout=30)
    return {(a_tid.hex(), a_root.hex()): 6_000_018,
            (b_tid.hex(), c1.hex()): 12_000_012,
            (b_tid.hex(), c2.hex()): 3_000_007,
            (b_tid.hex(), b_root.hex()): 2_000_003,
            (d_tid.hex(), on7.hex()): 5_000_076,
            (d_tid.hex(), on8.hex()): 9_000_041}, 24_000_076


def _attributed(data: Path) -> tuple[dict[tuple[str, str], int], int, int]:
    with clickhouse(data) as ch:
        per_span = {(t, s): int(c) for t, s, c in ch.query(
            "SELECT trace_id, span_id, sum(cpu_ns) FROM spanprof.span_attribution FINAL "
            "WHERE service = {s:String} GROUP BY trace_id, span_id",
            parameters={"s": SERVICE}).result_rows}
        rows = int(ch.query("SELECT count() FROM spanprof.span_attribution FINAL")
                   .result_rows[0][0])
        unattributed = int(ch.query(
            "SELECT sum(cpu_ns) FROM spanprof.unattributed_cpu FINAL WHERE service = {s:String}",
            parameters={"s": SERVICE}).result_rows[0][0])
    return per_span, rows, unattributed


def _crash_and_restart(tmp: Path, extra: str
                       ) -> tuple[SpanprofProcess, tuple[dict[tuple[str, str], int], int]]:
    p = SpanprofProcess(tmp, grace="30s", extra_connector=extra)
    p.start()
    sent = _send(p)  # acknowledged: stored, and held by the correlator for 30 s
    time.sleep(1.0)
    p.stop(signal.SIGKILL)
    p.start()
    assert p.stop() == 0, p.logs()[-3000:]
    return p, sent


class TestCrashRecovery:
    def test_restart_attributes_what_sigkill_lost_exactly_once(self, tmp_path: Path) -> None:
        """Spans and samples held within grace are lost to SIGKILL; the restart reconciles
        them from the stored rows: each span gets exactly its CPU (link, link+time and,
        for unlabelled samples, thread), the service exactly its unattributed CPU, and a
        further restart adds nothing."""
        p, (sent, idle) = _crash_and_restart(tmp_path, "orphan_timeout: 120s")
        got, rows, unattributed = _attributed(p.data)
        assert {k: v for k, v in got.items() if v} == sent, p.logs()[-3000:]
        assert unattributed == idle
        assert '"correlator_recovered"' in p.logs()
        p.start()
        assert p.stop() == 0
        assert _attributed(p.data) == (got, rows, unattributed)

    def test_without_recovery_the_held_input_is_lost(self, tmp_path: Path) -> None:
        """``recover: false``: the same crash leaves the held samples unattributed (what
        the test above proves recovery fixes)."""
        p, (sent, _) = _crash_and_restart(tmp_path, "recover: false")
        got, _, _ = _attributed(p.data)
        assert sum(got.values()) < sum(sent.values())

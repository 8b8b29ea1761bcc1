"""Beyond labels, end to end: a profile labelled with the root span only, with timestamps
and threads, is placed in the child spans; a span blocked on a lock shows its waiting as
off-CPU and, from a wall-clock profile, the function it waited in; ``spanprof explain`` and
``spanprof top`` say so."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, wait_until
from tests.e2e.otlp_clients import profiles_stub, traces_stub

pytestmark = pytest.mark.e2e
MS = 1_000_000
TRACE = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
ROOT, STOCK, SERIALIZE = (bytes([i]) * 8 for i in (1, 2, 3))
THREAD = 5


def spans_request(t0: int) -> tps.ExportTraceServiceRequest:
    req = tps.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name",
                                           value=AnyValue(string_value="checkout")))
    ss = rs.scope_spans.add()
    for sid, parent, name, start, end in ((ROOT, b"", "place_order", 0, 900),
                                          (STOCK, ROOT, "reserve_stock", 20, 820),
                                          (SERIALIZE, ROOT, "serialize", 830, 890)):
        s = ss.spans.add(trace_id=TRACE, span_id=sid, parent_span_id=parent, name=name,
                         start_time_unix_nano=t0 + start * MS, end_time_unix_nano=t0 + end * MS)
        s.attributes.append(KeyValue(key="thread.id", value=AnyValue(int_value=THREAD)))
    return req


def profiles_request(t0: int) -> bytes:
    """CPU and wall samples every 10 ms, all labelled with the root span (as Pyroscope's
    span processor does), each with its instant and thread."""
    b = ProfileBuilder()
    where = {"thread.id": THREAD, "thread.name": "worker-5"}

    def at(ms: int) -> list[int]:
        return [t0 + ms * MS + 3 * MS]

    for ms in (20, 30):  # reserve_stock computes a little, then blocks
        b.sample(["compute_price", "reserve_stock", "handler"], None, TRACE, ROOT,
                 timestamps=at(ms), attributes=where, time_unix_nano=t0)
    for ms in range(830, 880, 10):  # serialize is all CPU
        b.sample(["json.dumps", "serialize", "handler"], None, TRACE, ROOT, timestamps=at(ms),
                 attributes=where, time_unix_nano=t0)
    for ms in range(40, 820, 10):  # the wall profile: waiting on the lock
        b.sample(["threading.Lock.acquire", "reserve_stock", "handler"], None, TRACE, ROOT,
                 timestamps=at(ms), attributes=where, sample_type="wall", period_type="wall",
                 time_unix_nano=t0)
    for ms in range(830, 880, 10):
        b.sample(["json.dumps", "serialize", "handler"], None, TRACE, ROOT, timestamps=at(ms),
                 attributes=where, sample_type="wall", period_type="wall", time_unix_nano=t0)
    return b.build()


def cli(sp: SpanprofProcess, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--admin", sp.admin],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


class TestBeyondLabels:
    def test_children_and_waiting_through_the_pipeline(self, spanprof: SpanprofProcess) -> None:
        spanprof.start()
        t0 = time.time_ns() - 5_000 * MS
        channel = grpc.insecure_channel(spanprof.grpc_target)
        traces_stub(channel).Export(spans_request(t0), timeout=30)
        profiles_stub(channel).Export(profiles_request(t0), timeout=30)

        def spans() -> dict[str, dict[str, object]] | None:
            data = spanprof.get(f"/api/v1/traces/{TRACE.hex()}")
            by_name = {str(s["name"]): s for s in data["spans"]}
            ser = by_name.get("serialize", {})
            return by_name if ser.get("cpu_ns") == 50 * MS and \
                by_name["reserve_stock"].get("wall_ns") == 780 * MS else None
        by_name = wait_until(spans, timeout=30)
        stock, ser, root = by_name["reserve_stock"], by_name["serialize"], by_name["place_order"]
        # placed by time into the children, though labelled with the root only
        assert (stock["cpu_ns"], ser["cpu_ns"], root["cpu_ns"]) == (20 * MS, 50 * MS, 0)
        assert root["inclusive_cpu_ns"] == 70 * MS
        assert stock["method"] == "link+time"  # the placed CPU (no row without CPU)
        # waiting: off-CPU is the duration less CPU, and the wall profile says where
        assert stock["off_cpu_ns"] == 780 * MS
        assert stock["top_wall_functions"][0] == {"name": "threading.Lock.acquire",
                                                  "self_ns": 780 * MS}
        assert ser["top_functions"][0] == {"name": "json.dumps", "self_ns": 50 * MS}

        tree = cli(spanprof, "explain", TRACE.hex())
        lines = {ln.split(": ", 1)[1].split("  ")[0]: ln for ln in tree.splitlines()
                 if "checkout: " in ln}
        assert "cpu 0.0ms (with children 70.0ms)" in lines["place_order"]
        assert "off-cpu 780.0ms" in lines["reserve_stock"]
        assert "top json.dumps 50.0ms" in lines["serialize"]
        assert "wall: threading.Lock.acquire 780.0ms" in tree
        top = json.loads(cli(spanprof, "top", "--format", "json", "--service", "checkout"))
        assert [s["name"] for s in top][:2] == ["serialize", "reserve_stock"]
        by_off = json.loads(cli(spanprof, "top", "--by", "off_cpu", "--format", "json"))
        assert by_off[0]["name"] == "place_order"  # 900 ms, 70 ms of it on CPU
        assert spanprof.stop() == 0

"""The request bodies captured from the real Pyroscope Python SDK, pushed to a running
spanprof, joined with their spans (sent over OTLP/HTTP), read back per span from the admin
API and from ClickHouse."""

from __future__ import annotations

import gzip
import random
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.pyroscope.messages import Profile, PushRequest
from tests.conftest import SpanprofProcess, clickhouse, wait_until

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).resolve().parents[1] / "testdata" / "pyroscope-python"
PUSH = "/push.v1.PusherService/Push"


def labelled_cpu() -> tuple[dict[bytes, int], dict[bytes, bytes], int, int, int]:
    """From the captured bodies themselves: CPU ns per span_id label, the trace of each
    span (when the sample says), the unlabelled CPU, the profiles' earliest time and how
    many samples carry a span_name label."""
    cpu: dict[bytes, int] = defaultdict(int)
    trace_of: dict[bytes, bytes] = {}
    unlabelled, t0, named = 0, 1 << 63, 0
    for name in ("req1.bin", "req2.bin", "req3.bin"):
        req = PushRequest.FromString(gzip.decompress((FIXTURES / name).read_bytes()))
        for raw in (s for series in req.series for s in series.samples):
            data = raw.raw_profile
            p = Profile.FromString(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
            t0 = min(t0, p.time_nanos)
            st = p.string_table
            for smp in p.sample:
                labels = {st[lb.key]: st[lb.str] for lb in smp.label}
                if "span_id" not in labels:
                    unlabelled += smp.value[0]
                    continue
                sid = bytes.fromhex(labels["span_id"])
                named += "span_name" in labels
                cpu[sid] += smp.value[0]
                if "trace_id" in labels:
                    trace_of[sid] = bytes.fromhex(labels["trace_id"])
    return cpu, trace_of, unlabelled, t0, named


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(resp.status)


class TestPyroscopePush:
    def test_captured_requests_cpu_per_span(self, tmp_path: Path) -> None:
        """Per span, the CPU spanprof reports equals the sum of the pprof values labelled
        with its span_id, exactly: for spans whose samples carry trace_id, and for the one
        span the SDK labelled with span_id alone (its trace found through the span); the
        unlabelled CPU is kept as unattributed, not lost."""
        sp = SpanprofProcess(tmp_path, grace="500ms",
                             extra_connector="orphan_timeout: 2s")
        sp.start()
        cpu, trace_of, unlabelled, t0, named = labelled_cpu()
        span_only = [sid for sid in cpu if sid not in trace_of]
        assert len(span_only) == 1 and len(cpu) > 50
        rng = random.Random(3)
        trace_of.update({sid: rng.randbytes(16) for sid in span_only})

        # the spans, as the traced program exported them, over OTLP/HTTP (protobuf)
        req = tps.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.append(KeyValue(key="service.name",
                                               value=AnyValue(string_value="checkout")))
        ss = rs.scope_spans.add()
        for sid, tid in trace_of.items():
            ss.spans.add(trace_id=tid, span_id=sid, name="place_order",
                         start_time_unix_nano=t0, end_time_unix_nano=t0 + 10**9)
        assert post(sp.http_url + "/v1/traces", req.SerializeToString(),
                    {"content-type": "application/x-protobuf"}) == 200
        for name in ("req1.bin", "req2.bin", "req3.bin"):
            assert post(sp.pyroscope_url + PUSH, (FIXTURES / name).read_bytes(),
                        {"content-type": "application/proto", "content-encoding": "gzip",
                         "user-agent": "pyroscope-rs/pyspy/1.4.0 reqwest"}) == 200

        def reported() -> dict[bytes, int] | None:
            spans = sp.get("/api/v1/spans?order=cpu&limit=1000&service=checkout")["spans"]
            got = {bytes.fromhex(s["span_id"]): s["cpu_ns"] for s in spans if s["cpu_ns"]}
            return got if got == cpu else None
        got = wait_until(reported, timeout=30)
        assert got == cpu
        one = span_only[0]
        trace = sp.get(f"/api/v1/traces/{trace_of[one].hex()}")
        assert [(s["span_id"], s["cpu_ns"]) for s in trace["spans"]] == [(one.hex(), cpu[one])]

        assert sp.stop() == 0
        with clickhouse(sp.data) as ch:
            rows = ch.query("SELECT span_id, sum(cpu_ns) FROM spanprof.span_attribution_rows "
                            "WHERE service = 'checkout' GROUP BY span_id").result_rows
            assert {bytes.fromhex(s): int(c) for s, c in rows} == cpu
            assert ch.query("SELECT sum(cpu_ns) FROM spanprof.unattributed_cpu FINAL WHERE "
                            "service = 'checkout'").result_rows[0][0] == unlabelled
            assert ch.query("SELECT countIf(span_name != ''), countIf(span_id != '' AND "
                            "span_name = '') FROM spanprof.profile_samples").result_rows \
                == [(named, 1)]


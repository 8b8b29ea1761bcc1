"""The Pyroscope Java agent's uploads (``/ingest?format=jfr``), as captured from the real
agent (io.pyroscope:agent 2.9.2 with the OpenTelemetry Java agent 2.33.1 and
io.pyroscope:otel 1.0.2; tests/testdata/jfr/README.md), posted to a running spanprof with
the spans the traced program exported: every span gets exactly the CPU of the samples
labelled with it, the busy method tops the CPU of the ``checkout`` spans, and wall, lock
and allocation samples are stored."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qsl

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.pyroscope import pprof
from pipeline.pyroscope.ingest import decode_ingest
from tests.conftest import SpanprofProcess, clickhouse, wait_until

# the real clients measure their own CPU and wall time: alone, not beside other tests
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
DATA = Path(__file__).resolve().parent.parent / "testdata" / "jfr"
BOUNDARY = "spanprof-test-boundary"
SERVICE = "capture-app"


def uploads() -> list[tuple[str, bytes]]:
    """(query string, multipart body) of each captured upload."""
    out = []
    for r in json.loads((DATA / "requests.json").read_text()).values():
        body = b""
        for part, meta in r["parts"].items():
            body += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{part}\"; "
                     f"filename=\"{part}\"\r\n\r\n").encode()
            body += (DATA / meta["file"]).read_bytes() + b"\r\n"
        out.append((r["query"], body + f"--{BOUNDARY}--\r\n".encode()))
    return out


def expected_cpu() -> Counter[str]:
    """CPU per span id, from the recordings as spanprof's decoder reads them."""
    cpu: Counter[str] = Counter()
    for query, body in uploads():
        batch = decode_ingest(dict(parse_qsl(query)), f"multipart/form-data; boundary="
                              f"{BOUNDARY}", body, 64 << 20, pprof.Limits()).batch
        for s in batch.samples:
            if s.measure == "cpu" and s.span_id:
                cpu[s.span_id.hex()] += s.value
    return cpu


def post(url: str, body: bytes, ctype: str) -> int:
    req = urllib.request.Request(url, data=body, headers={"content-type": ctype})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(resp.status)


class TestJavaAgentUploads:
    def test_spans_get_the_cpu_of_their_samples(self, tmp_path: Path) -> None:
        sp = SpanprofProcess(tmp_path, grace="500ms", extra_connector="orphan_timeout: 2s")
        sp.start()
        spans = [s for run in json.loads((DATA / "spans.json").read_text()).values()
                 for s in run]
        req = tps.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.append(KeyValue(key="service.name",
                                               value=AnyValue(string_value=SERVICE)))
        ss = rs.scope_spans.add()
        for s in spans:
            ss.spans.add(trace_id=bytes.fromhex(s["trace_id"]),
                         span_id=bytes.fromhex(s["span_id"]), name=s["name"],
                         start_time_unix_nano=s["start"], end_time_unix_nano=s["end"])
        assert post(sp.http_url + "/v1/traces", req.SerializeToString(),
                    "application/x-protobuf") == 200
        for query, body in uploads():
            assert post(f"{sp.pyroscope_url}/ingest?{query}", body,
                        f"multipart/form-data; boundary={BOUNDARY}") == 200

        want = expected_cpu()
        assert len(want) > 20

        def reported() -> dict[str, int] | None:
            got = {s["span_id"]: s["cpu_ns"] for s in sp.get(
                f"/api/v1/spans?order=cpu&limit=1000&service={SERVICE}")["spans"]
                if s["cpu_ns"]}
            return got if got == dict(want) else None

        assert wait_until(reported, timeout=30) == dict(want)
        checkout = [s for s in sp.get(f"/api/v1/spans?order=cpu&limit=1000&service={SERVICE}"
                                      )["spans"] if s["name"] == "checkout" and s["cpu_ns"]]
        top = Counter(s["top_functions"][0]["name"] for s in checkout if s["top_functions"])
        assert top.most_common(1)[0][0] == "spanprof.capture.App.spin"
        assert top["spanprof.capture.App.spin"] >= 0.8 * len(checkout)
        assert sp.stop() == 0
        with clickhouse(sp.data) as ch:
            kinds = dict(ch.query("SELECT sample_type, count() FROM spanprof.profile_samples "
                                  f"WHERE service = '{SERVICE}' GROUP BY sample_type"
                                  ).result_rows)
            # JFR allocation and lock events labelled with a span: every byte and
            # nanosecond of them reaches a span by an exact method (issue #21)
            raw = dict(ch.query(
                "SELECT measure, sum(value) FROM spanprof.profile_samples WHERE service = "
                f"'{SERVICE}' AND span_id != '' AND measure IN ('lock', 'alloc') "
                "GROUP BY measure").result_rows)
            joined = ch.query(
                "SELECT sum(lock_ns), sum(alloc_bytes) FROM spanprof.span_attribution FINAL "
                f"WHERE service = '{SERVICE}' AND method IN ('link', 'link+time')"
                ).result_rows[0]
        assert {"cpu", "wall", "alloc_bytes", "lock_duration"} <= set(kinds)
        assert raw.get("alloc", 0) > 0, raw
        assert joined == (raw.get("lock", 0), raw["alloc"])

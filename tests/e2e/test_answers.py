"""Answers for people, end to end through a running pipeline: ``spanprof hot``, ``spanprof
diff`` across a deploy, and ``spanprof flamegraph`` of a span and of an operation, read
from the aggregates ClickHouse maintains."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.flamegraph import parse_svg_frames
from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, wait_until
from tests.e2e.otlp_clients import profiles_stub, traces_stub

pytestmark = pytest.mark.e2e
MS = 1_000_000
S = 1_000_000_000
# leaf first, as profilers send them
SERIALIZE = ["json.dumps", "serialize", "handle"]
QUERY = ["cursor.execute", "db_query", "handle"]
RENDER = ["render", "handle"]


def send(sp: SpanprofProcess, start_s: int, n: int, dumps_ms: int, first_id: int) -> list[bytes]:
    """``n`` place_order spans starting at ``start_s`` (unix seconds), a second apart, each
    burning ``dumps_ms`` in json.dumps, 10 ms in cursor.execute and 5 ms in render."""
    req = tps.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name",
                                           value=AnyValue(string_value="checkout")))
    ss = rs.scope_spans.add()
    b = ProfileBuilder()
    sids = []
    for i in range(n):
        tid, sid = (first_id + i).to_bytes(16, "big"), (first_id + i).to_bytes(8, "big")
        t0 = (start_s + i) * S
        ss.spans.add(trace_id=tid, span_id=sid, name="place_order", start_time_unix_nano=t0,
                     end_time_unix_nano=t0 + 200 * MS)
        for frames, ms in ((SERIALIZE, dumps_ms), (QUERY, 10), (RENDER, 5)):
            b.sample(frames, ms * MS, tid, sid, service="checkout", time_unix_nano=t0)
        sids.append(sid)
    channel = grpc.insecure_channel(sp.grpc_target)
    traces_stub(channel).Export(req, timeout=30)
    profiles_stub(channel).Export(b.build(), timeout=30)
    return sids


def cli(sp: SpanprofProcess, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--admin", sp.admin],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


class TestAnswers:
    def test_hot_diff_and_flame_graphs(self, spanprof: SpanprofProcess, tmp_path: Path) -> None:
        spanprof.start()
        now = int(time.time())
        send(spanprof, now - 100 * 60, 10, dumps_ms=20, first_id=1)  # before the deploy
        after = send(spanprof, now - 20 * 60, 10, dumps_ms=60, first_id=101)

        def hot() -> dict[str, object] | None:
            got = json.loads(cli(spanprof, "hot", "--service", "checkout", "--operation",
                                 "place_order", "--since", "1h", "--format", "json"))
            # the tables of one write become visible one after another: wait for all
            done = got["calls"] == 10 and got["cpu_ns"] == 10 * 75 * MS and \
                sum(f["self_cpu_ns"] for f in got["functions"]) == 10 * 75 * MS
            return got if done else None
        got = wait_until(hot, timeout=30)
        assert [(f["name"], f["self_cpu_ns"]) for f in got["functions"]] == [  # type: ignore[index]
            ("json.dumps", 600 * MS), ("cursor.execute", 100 * MS), ("render", 50 * MS)]
        assert got["functions"][0]["per_call_ns"] == 60 * MS  # type: ignore[index]
        table = cli(spanprof, "hot", "--service", "checkout", "--since", "1h")
        assert table.splitlines()[2].split()[-1] == "json.dumps"

        wait_until(lambda: sum(
            f["self_cpu_ns"] for f in json.loads(cli(
                spanprof, "hot", "--service", "checkout", "--since", "2h..1h",
                "--format", "json"))["functions"]) == 10 * 35 * MS, timeout=30)
        d = json.loads(cli(spanprof, "diff", "--service", "checkout", "--operation",
                           "place_order", "--before", "2h..1h", "--after", "1h",
                           "--format", "json"))
        assert d["unit"] == "per_call" and d["before"]["calls"] == d["after"]["calls"] == 10
        first = d["functions"][0]
        assert (first["name"], first["before_ns"], first["after_ns"], first["ratio"]) == \
            ("json.dumps", 20 * MS, 60 * MS, 3.0)
        assert {f["name"]: f["delta_ns"] for f in d["functions"][1:]} == \
            {"cursor.execute": 0.0, "render": 0.0}

        # one span's flame graph: the hot function is the widest frame under the root
        tid101 = (101).to_bytes(16, "big").hex()
        wait_until(lambda: spanprof.get(f"/api/v1/stacks?trace_id={tid101}&span_id="
                                        f"{after[0].hex()}")["cpu_ns"] == 75 * MS, timeout=30)
        svg = tmp_path / "span.svg"
        cli(spanprof, "flamegraph", "--trace", (101).to_bytes(16, "big").hex(), "--span",
            after[0].hex(), "-o", str(svg))
        frames = parse_svg_frames(svg.read_text())
        (root,) = [f for f in frames if f[1] == 0]
        (handle,) = [f for f in frames if f[1] == 1]
        assert handle[0] == "handle" and abs(handle[3] - root[3]) < 1
        under = sorted((f for f in frames if f[1] == 2), key=lambda f: -f[3])
        assert [f[0] for f in under] == ["serialize", "db_query", "render"]
        assert abs(under[0][3] / root[3] - 60 / 75) < 0.01
        (dumps,) = [f for f in frames if f[0] == "json.dumps"]
        assert abs(dumps[3] - under[0][3]) < 1
        # the operation's flame graph over the last hour: 10 spans' worth
        svg2 = tmp_path / "op.svg"
        out = cli(spanprof, "flamegraph", "--service", "checkout", "--operation",
                  "place_order", "--since", "1h", "-o", str(svg2))
        assert "750.0ms of CPU" in out
        assert {f[0] for f in parse_svg_frames(svg2.read_text())} >= {"json.dumps", "render"}
        assert spanprof.stop() == 0

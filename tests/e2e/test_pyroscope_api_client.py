"""Pyroscope's query API as Grafana's Pyroscope data source calls it: the generated Connect
client of Pyroscope's public ``api`` Go module (``querierv1connect.NewQuerierServiceClient``,
github.com/grafana/pyroscope/api v1.6.0, what Grafana's backend builds on) against a
running ``spanprof run`` fed over OTLP/gRPC, each RPC Grafana makes, in protobuf (the Go
client's default) and JSON, plain and gzipped; answers compared whole, to exact values.

The client is tests/clients/go_querier (its go.mod pins the modules), built from the Go
module proxy once into a cache that outlives the session (``~/.cache/spanprof/go``, or
``SPANPROF_GO_CACHE``; the binary under ``go-querier/<hash of its sources>``), one
builder at a time (``tests/cachelock.py``). Go is on every machine of this project: no
Go, or a build that fails, is a failure, never a skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.otlp.builder import ProfileBuilder
from tests.cachelock import cache_lock
from tests.conftest import ROOT, SpanprofProcess, wait_until
from tests.e2e.otlp_clients import profiles_stub, traces_stub
from tests.e2e.test_go_sdk import go_cache

pytestmark = pytest.mark.e2e
APP = ROOT / "tests" / "clients" / "go_querier"
MS = 1_000_000
S = 1_000_000_000
CPU = "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
WALL = "wall:wall:nanoseconds:wall:nanoseconds"
TID = bytes(range(1, 17))
R, C, D = (bytes(7) + bytes([i]) for i in (1, 2, 3))  # place_order > db_query > SELECT


@pytest.fixture(scope="session")
def querier_client() -> Path:
    """tests/clients/go_querier built with its go.mod's versions (``-mod=readonly``:
    go.sum must already hold them) and the local toolchain, once per version of its
    sources."""
    go = shutil.which("go")
    if go is None:
        pytest.fail("go is not on PATH: the Pyroscope API client test needs the Go toolchain",
                    pytrace=False)
    digest = hashlib.sha256(b"".join((APP / f).read_bytes()
                                     for f in ("go.mod", "go.sum", "main.go"))).hexdigest()
    cache = go_cache()
    out = cache / "go-querier" / digest[:16] / "go-querier"
    with cache_lock("go-querier"):
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, GOMODCACHE=str(cache / "mod"), GOCACHE=str(cache / "build"),
                   GOTOOLCHAIN="local", CGO_ENABLED="0",
                   GOFLAGS="-mod=readonly -modcacherw -buildvcs=false")
        tmp = out.with_suffix(".tmp")
        try:
            proc = subprocess.run([go, "build", "-o", str(tmp), "."], cwd=APP, env=env,
                                  capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"go build of {APP} took over 900 s:\n{err.stderr!r}", pytrace=False)
        if proc.returncode != 0:
            pytest.fail(f"go build of {APP} failed ({proc.returncode}):\n{proc.stderr[-4000:]}",
                        pytrace=False)
        tmp.rename(out)  # whole or not at all: a build cut short leaves no binary
    return out


def send(sp: SpanprofProcess, t0: int, tenant: str = "") -> None:
    """checkout's place_order (R) with its child db_query (C), which calls postgres
    (D); CPU (ms): R json.dumps 30 + render 10, C cursor.execute 20 (threads "main"),
    D exec_simple_query 15 (host db1), 70 s later an unlinked gc_collect 5 (thread
    "gc"); wall: R sleep 200. Tenant ``other``: R burning 1000 ms in handle only."""
    md = (("x-scope-orgid", tenant),) if tenant else ()
    req = tps.ExportTraceServiceRequest()
    for service, spans in (("checkout", [(R, b"", "place_order", 900), (C, R, "db_query", 400)]),
                           ("postgres", [(D, C, "SELECT", 300)])):
        rs = req.resource_spans.add()
        rs.resource.attributes.append(KeyValue(key="service.name",
                                               value=AnyValue(string_value=service)))
        ss = rs.scope_spans.add()
        for sid, parent, name, ms in spans:
            ss.spans.add(trace_id=TID, span_id=sid, parent_span_id=parent, name=name,
                         start_time_unix_nano=t0, end_time_unix_nano=t0 + ms * MS)
    b = ProfileBuilder()
    main = {"thread.name": "main"}
    if tenant == "other":
        b.sample(["handle"], 1000 * MS, TID, R, service="checkout", time_unix_nano=t0)
    else:
        b.sample(["json.dumps", "serialize", "handle"], 30 * MS, TID, R, attributes=main,
                 service="checkout", time_unix_nano=t0)
        b.sample(["render", "handle"], 10 * MS, TID, R, attributes=main, service="checkout",
                 time_unix_nano=t0)
        b.sample(["cursor.execute", "db_query", "handle"], 20 * MS, TID, C, attributes=main,
                 service="checkout", time_unix_nano=t0)
        b.sample(["exec_simple_query", "postgres_main"], 15 * MS, TID, D, service="postgres",
                 resource={"host.name": "db1"}, time_unix_nano=t0)
        b.sample(["gc_collect"], 5 * MS, attributes={"thread.name": "gc"}, service="checkout",
                 time_unix_nano=t0 + 70 * S)
        b.sample(["sleep", "handle"], 200 * MS, TID, R, service="checkout", sample_type="wall",
                 period_type="wall", time_unix_nano=t0)
    with grpc.insecure_channel(sp.grpc_target) as channel:
        traces_stub(channel).Export(req, timeout=30, metadata=md)
        profiles_stub(channel).Export(b.build(), timeout=30, metadata=md)


def run_client(client: Path, sp: SpanprofProcess, calls: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    proc = subprocess.run([str(client)], input=json.dumps({"base": sp.admin, "calls": calls}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [x["rpc"] for x in lines] == [c["rpc"] for c in calls], proc.stdout
    return lines


def flame(names: list[str], levels: list[list[int]], total: int, max_self: int
          ) -> dict[str, Any]:
    """A FlameGraph as the Go client prints it (protojson, every field), values in ms."""
    return {"names": names, "levels": [{"values": [str(v * MS if i % 4 != 3 else v)
                                                   for i, v in enumerate(lv)]}
                                       for lv in levels],
            "total": str(total * MS), "maxSelf": str(max_self * MS)}


CHECKOUT = flame(
    ["total", "gc_collect", "handle", "db_query", "render", "serialize", "cursor.execute",
     "json.dumps"],
    [[0, 65, 0, 0], [0, 5, 5, 1, 0, 60, 0, 2], [5, 20, 0, 3, 0, 10, 10, 4, 0, 30, 0, 5],
     [5, 20, 20, 6, 10, 30, 30, 7]], 65, 30)
SPAN_R = flame(
    ["total", "handle", "db_query", "render", "serialize", "cursor.execute", "json.dumps"],
    [[0, 60, 0, 0], [0, 60, 0, 1], [0, 20, 0, 2, 0, 10, 10, 3, 0, 30, 0, 4],
     [0, 20, 20, 5, 10, 30, 30, 6]], 60, 30)


class TestGrafanaClient:
    def test_every_rpc_grafana_makes(self, spanprof: SpanprofProcess,
                                     querier_client: Path) -> None:
        spanprof.start()
        t0_s = int(time.time()) // 60 * 60 - 600
        t0 = t0_s * S
        send(spanprof, t0)
        send(spanprof, t0, tenant="other")
        rng = {"start": str(t0_s * 1000), "end": str((t0_s + 180) * 1000)}
        stack_req = {"profileTypeID": CPU, "labelSelector": '{service_name="checkout"}',
                     **rng}

        def call(rpc: str, request: dict[str, Any], **kw: Any) -> dict[str, Any]:
            return {"rpc": rpc, "request": request, **kw}

        # every Export was answered once stored: the first question finds everything
        def stored() -> bool:
            got = run_client(querier_client, spanprof, [call("SelectMergeStacktraces",
                                                             stack_req)])
            return got[0].get("response", {}).get("flamegraph") == CHECKOUT
        wait_until(stored, timeout=30)

        calls = [
            call("ProfileTypes", rng),  # Grafana's "Save & test" and its type picker
            call("ProfileTypes", {}),  # no range: the last hour
            call("LabelNames", {"matchers": [f'{{__profile_type__="{CPU}"}}'], **rng}),
            call("LabelValues", {"name": "service_name", "matchers": [
                f'{{__profile_type__="{CPU}"}}'], **rng}),
            call("LabelValues", {"name": "thread_name", "matchers": [
                f'{{__profile_type__="{CPU}",service_name="checkout"}}'], **rng}),
            call("Series", {"matchers": ['{service_name="checkout"}'],
                            "labelNames": ["__profile_type__", "thread_name"], **rng}),
            call("SelectMergeStacktraces", {**stack_req, "maxNodes": "16384"}),
            call("SelectMergeStacktraces", stack_req, json=True, gzip=True),
            call("SelectMergeSpanProfile", {"profileTypeID": CPU, "labelSelector": "{}",
                                            "spanSelector": [R.hex()], **rng}),
            call("SelectMergeSpanProfile", {"profileTypeID": CPU, "labelSelector": "{}",
                                            "spanSelector": [R.hex()], **rng},
                 tenant="other"),
            call("SelectMergeStacktraces", {"profileTypeID": CPU, "labelSelector": "{}",
                                            "spanSelector": [D.hex()], **rng}, json=True),
            call("SelectSeries", {"profileTypeID": CPU, "step": 60,
                                  "labelSelector": '{service_name="checkout"}',
                                  "groupBy": ["thread_name"], "exemplarType":
                                  "EXEMPLAR_TYPE_NONE", **rng}),
            call("SelectMergeStacktraces", {"profileTypeID": WALL, "labelSelector": "{}",
                                            **rng}),
            call("SelectMergeStacktraces", {"profileTypeID": "memory:inuse_space:bytes:"
                                            "space:bytes", "labelSelector": "{}", **rng}),
            call("SelectSeries", {"profileTypeID": CPU, "labelSelector": '{pod="a"}',
                                  "step": 15, **rng}, json=True),
            call("SelectHeatmap", {"profileTypeID": CPU, **rng}),
        ]
        got = run_client(querier_client, spanprof, calls)
        answers = [x.get("response", x.get("error")) for x in got]
        types, no_range, names, services, threads, series = answers[:6]
        assert types == {"profileTypes": [
            {"ID": CPU, "name": "process_cpu", "sampleType": "cpu",
             "sampleUnit": "nanoseconds", "periodType": "cpu", "periodUnit": "nanoseconds"},
            {"ID": WALL, "name": "wall", "sampleType": "wall", "sampleUnit": "nanoseconds",
             "periodType": "wall", "periodUnit": "nanoseconds"}]}
        assert no_range == types  # ten minutes ago is within the last hour
        assert names == {"names": ["__name__", "__profile_type__", "host_name",
                                   "service_name", "thread_name"]}
        assert services == {"names": ["checkout", "postgres"]}
        assert threads == {"names": ["gc", "main"]}
        assert series == {"labelsSet": [  # each CPU sample of checkout names its thread
            {"labels": [{"name": "__profile_type__", "value": CPU},
                        {"name": "thread_name", "value": "gc"}]},
            {"labels": [{"name": "__profile_type__", "value": CPU},
                        {"name": "thread_name", "value": "main"}]},
            {"labels": [{"name": "__profile_type__", "value": WALL}]}]}
        flames = [a["flamegraph"] for a in answers[6:11]]
        assert flames[0] == CHECKOUT  # protobuf, as Grafana asks
        assert flames[1] == CHECKOUT  # JSON, gzipped request
        # the traces-to-profiles link: the span and its children in its service
        assert flames[2] == SPAN_R
        assert flames[3] == flame(["total", "handle"], [[0, 1000, 0, 0], [0, 1000, 1000, 1]],
                                  1000, 1000)  # tenant other's own
        assert flames[4]["total"] == str(15 * MS)  # postgres' span
        assert answers[11] == {"series": [
            {"labels": [{"name": "thread_name", "value": "gc"}], "points": [
                {"value": 5.0 * MS, "timestamp": str((t0_s + 60) * 1000),
                 "annotations": [], "exemplars": []}]},
            {"labels": [{"name": "thread_name", "value": "main"}], "points": [
                {"value": 60.0 * MS, "timestamp": str(t0_s * 1000), "annotations": [],
                 "exemplars": []}]}]}
        assert answers[12]["flamegraph"]["total"] == str(200 * MS)
        assert answers[13]["code"] == "invalid_argument"
        assert answers[13]["message"].startswith("profile_typeID: 'memory:inuse_space")
        assert answers[14]["code"] == "invalid_argument"
        assert answers[14]["message"].startswith("label_selector: label 'pod'")
        assert answers[15]["code"] == "unimplemented"

"""A real Go program, traced by the OpenTelemetry Go SDK and profiled by ``pyroscope-go``
v1.5.0 with ``otel-profiling-go`` v0.7.0 (issue #14: the most used Pyroscope SDK got a 400
on every upload), against a running spanprof.

The program is tests/clients/go (its go.mod pins the SDKs), built once per session from
the Go module proxy into a cache that outlives the session, ``~/.cache/spanprof/go``
(``SPANPROF_GO_CACHE``): the first build downloads and compiles the modules (about a
minute), later ones take seconds. Go is on every machine of this project: no Go, or a
build that fails, is a failure, never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SpanprofProcess, clickhouse
from tests.e2e.test_real_sdks import (
    app_output,
    app_spans,
    check_busy_spans,
    check_trace_view,
    refused_requests,
)

# the real clients measure their own CPU and wall time: alone, not beside other tests
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
APP = ROOT / "tests" / "clients" / "go"
HEAVY = "main.burnCPUInHashLoop"  # the busy function, as Go names it in the profile
ITERATIONS = 6
CRUNCH_MS = 300
IDLE_MS = 200


def go_cache() -> Path:
    return Path(os.environ.get("SPANPROF_GO_CACHE") or Path.home() / ".cache/spanprof/go")


@pytest.fixture(scope="session")
def go_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/clients/go built with the go.mod's versions (``-mod=readonly``: go.sum must
    already hold them) and the local toolchain, modules and build cache kept across runs."""
    go = shutil.which("go")
    if go is None:
        pytest.fail("go is not on PATH: the Go SDK test needs the Go toolchain", pytrace=False)
    out = tmp_path_factory.mktemp("go-app") / "spanprof-go-app"
    cache = go_cache()
    env = dict(os.environ, GOMODCACHE=str(cache / "mod"), GOCACHE=str(cache / "build"),
               GOTOOLCHAIN="local", CGO_ENABLED="0",
               GOFLAGS="-mod=readonly -modcacherw -buildvcs=false")
    try:
        proc = subprocess.run([go, "build", "-o", str(out), "."], cwd=APP, env=env,
                              capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"go build of {APP} took over 900 s:\n{err.stderr!r}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"go build of {APP} failed ({proc.returncode}):\n{proc.stderr[-4000:]}",
                    pytrace=False)
    return out


def run_app(app: Path, sp: SpanprofProcess, service: str) -> dict[str, list[Any]]:
    """The Go program against ``sp``; the hex (trace_id, span_id) of its spans and the CPU
    time it measured in each."""
    env = dict(os.environ, SERVICE=service, SPANPROF_OTLP_HTTP=sp.http_url,
               SPANPROF_PYROSCOPE=sp.pyroscope_url, ITERATIONS=str(ITERATIONS),
               CRUNCH_MS=str(CRUNCH_MS), IDLE_MS=str(IDLE_MS), UPLOAD_MS="1000")
    proc = subprocess.run([str(app)], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"go app exited {proc.returncode}:\n{proc.stderr}"
    # the SDK logs each refused upload: "upload profile: failed to upload. server
    # responded with statusCode: '400' ..."
    assert "upload profile" not in proc.stderr, proc.stderr
    return app_output(proc.stdout, ITERATIONS)


class TestGoSdk:
    def test_go_sdk_uploads_accepted_and_busy_function_tops_its_spans(
            self, tmp_path: Path, go_app: Path) -> None:
        """Every upload of the Go SDK (CPU, heap, goroutines, mutex, block: multipart
        /ingest with no ``format``) is accepted; its CPU samples, labelled with the local
        root span by otel-profiling-go, are joined to the spans the program exported over
        OTLP/HTTP: ``main.burnCPUInHashLoop`` is the top self-CPU function of the
        ``crunch`` spans, which have, summed, the CPU time the program measured in them
        (within 10%); the sleeping ``idle`` spans have none to speak of."""
        sp = SpanprofProcess(tmp_path)
        sp.start()
        try:
            service = "go-sdk-app"
            ids = run_app(go_app, sp, service)
            # root spans of the service, in their traces
            crunch, idle, by_id, report = app_spans(sp, service, ids)
            refused = refused_requests(sp)  # no request refused
            assert refused == [], refused[:5]

            # each crunch span burns CRUNCH_MS of its thread's CPU time (however long that
            # takes on a busy machine); the runtime's profiler samples each thread every
            # 10 ms of that thread's CPU time
            check_busy_spans("go", crunch, ids["crunch_cpu_ns"], HEAVY, report, top_share=0.7)

            idle_cpu = sum(s["cpu_ns"] for s in idle)
            assert idle_cpu < 0.1 * sum(s["duration_ns"] for s in idle), report

            # root "handle" spans burning CRUNCH_MS / 3 themselves around a child "hash"
            # burning CRUNCH_MS, all samples labelled with the root: the root's inclusive
            # CPU is exact, the child gets its share by self time (link+share, approximate:
            # right as far as the CPU is spread evenly over the root's time)
            incl = child_cpu = 0
            for tid, root_id, child_id in ids["nested"]:
                nested = {s["span_id"]: s for s in
                          sp.get(f"/api/v1/traces/{tid}?method=all")["spans"]}
                incl += nested[root_id]["inclusive_cpu_ns"]
                child_cpu += nested[child_id]["cpu_ns"]
                assert nested[child_id]["name"] == "hash", nested
                assert "link+share" in nested[child_id]["method"].split(","), nested
            measured, measured_child = sum(ids["nested_cpu_ns"]), sum(
                ids["nested_child_cpu_ns"])
            print(f"go nested: root inclusive {incl / 1e6:.0f} ms (measured "
                  f"{measured / 1e6:.0f}), child share {child_cpu / 1e6:.0f} ms (measured "
                  f"{measured_child / 1e6:.0f})")
            assert abs(incl - measured) <= 0.10 * measured
            assert abs(child_cpu - measured_child) <= 0.20 * measured_child

            check_trace_view(sp, ids, by_id)
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)

        with clickhouse(sp.data) as ch:  # the samples themselves, every kind the SDK sent
            rows = ch.query("SELECT measure, sample_type, countIf(span_id != ''), count() "
                            "FROM spanprof.profile_samples WHERE service = {s:String} "
                            "GROUP BY measure, sample_type",
                            parameters={"s": service}).result_rows
        kinds = {(m, t): (linked, n) for m, t, linked, n in rows}
        assert kinds[("cpu", "cpu")][0] > 0, kinds
        assert {"alloc_space", "inuse_space", "goroutine"} <= {t for _, t in kinds}, kinds

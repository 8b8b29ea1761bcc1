"""A real Python program, traced by the OpenTelemetry SDK and profiled by the Pyroscope SDK
with ``pyroscope-otel``, against a running spanprof: its CPU-heavy spans come back with the
heavy function on top and most of their duration as CPU, its sleeping spans as off-CPU; with
the spans exported over OTLP/HTTP and over OTLP/gRPC.

The program is tests/e2e/sdk_app.py, run in its own process as a user would run it: nothing
in it knows about spanprof but the two addresses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SpanprofProcess, wait_until

pytestmark = pytest.mark.e2e
APP = Path(__file__).resolve().parent / "sdk_app.py"
HEAVY = "burn_cpu_in_hash_loop"  # sdk_app.HEAVY_FUNCTION
ITERATIONS = 6
CRUNCH_MS = 300
IDLE_MS = 200

def run_app(sp: SpanprofProcess, protocol: str, service: str) -> dict[str, list[list[str]]]:
    """sdk_app.py against ``sp``; returns the hex (trace_id, span_id) of its spans."""
    endpoint = sp.http_url if protocol == "http" else sp.grpc_target
    proc = subprocess.run(
        [sys.executable, str(APP), protocol, endpoint, sp.pyroscope_url, service,
         str(ITERATIONS), "--crunch-ms", str(CRUNCH_MS), "--idle-ms", str(IDLE_MS),
         "--upload-interval", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"sdk_app exited {proc.returncode}:\n{proc.stderr}"
    ids: dict[str, list[list[str]]] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(ids["crunch"]) == len(ids["idle"]) == ITERATIONS
    return ids


def settled_spans(sp: SpanprofProcess, service: str, want: set[str],
                  quiet: float = 2.5, timeout: float = 40.0) -> dict[str, dict[str, Any]]:
    """The service's spans from the admin API, by span id, once every span in ``want`` is
    there and nothing has changed for ``quiet`` seconds (the last profile is pushed at the
    program's exit, and late samples add to spans already written)."""
    last: list[Any] = [None, 0.0]

    def poll() -> dict[str, dict[str, Any]] | None:
        spans = sp.get(f"/api/v1/spans?order=cpu&limit=1000&service={service}")["spans"]
        by_id = {s["span_id"]: s for s in spans}
        if not want <= set(by_id):
            return None
        snapshot = sorted((s["span_id"], s["cpu_ns"], s["sample_count"]) for s in spans)
        now = time.monotonic()
        if snapshot != last[0]:
            last[0], last[1] = snapshot, now
            return None
        return by_id if now - last[1] >= quiet else None

    got: dict[str, dict[str, Any]] = wait_until(poll, timeout=timeout, interval=0.5)
    return got


def fmt(spans: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"  {s['name']} {s['span_id']} duration {s['duration_ns'] / 1e6:.0f}ms cpu "
        f"{s['cpu_ns'] / 1e6:.0f}ms samples {s['sample_count']} method {s['method']!r} top "
        f"{[(f['name'], f['self_ns'] // 1_000_000) for f in s['top_functions']]}"
        for s in spans)


class TestRealSdks:
    @pytest.mark.parametrize("protocol", ["http", "grpc"])
    def test_heavy_function_tops_its_spans(self, tmp_path: Path, protocol: str) -> None:
        """Root spans that burn CPU in ``burn_cpu_in_hash_loop`` get that function as their
        top function and most of their duration as CPU (joined by the span_id/trace_id
        labels ``pyroscope-otel`` puts on the samples); root spans that sleep get almost
        none. Spans exported over OTLP/``protocol``, profiles pushed by the Pyroscope SDK."""
        sp = SpanprofProcess(tmp_path)  # OTLP gRPC + HTTP and Pyroscope, as config/local.yaml
        sp.start()
        try:
            service = f"sdk-app-{protocol}"
            ids = run_app(sp, protocol, service)
            crunch_ids = {sid for _, sid in ids["crunch"]}
            idle_ids = {sid for _, sid in ids["idle"]}
            by_id = settled_spans(sp, service, crunch_ids | idle_ids)
            crunch = [by_id[sid] for sid in sorted(crunch_ids)]
            idle = [by_id[sid] for sid in sorted(idle_ids)]
            report = f"crunch:\n{fmt(crunch)}\nidle:\n{fmt(idle)}"

            for (tid, sid) in ids["crunch"] + ids["idle"]:
                s = by_id[sid]
                assert s["trace_id"] == tid and s["service"] == service, report
                assert s["parent_span_id"] == "", report
            assert {s["name"] for s in crunch} == {"crunch"}, report
            assert {s["name"] for s in idle} == {"idle"}, report

            # in aggregate: most of the crunch spans' duration is CPU, and it is the heavy
            # function's (the exact method: samples joined by their span labels)
            cpu = sum(s["cpu_ns"] for s in crunch)
            duration = sum(s["duration_ns"] for s in crunch)
            ratio = cpu / duration
            print(f"{protocol}: crunch cpu/duration = {ratio:.3f} "
                  f"({cpu / 1e6:.0f} / {duration / 1e6:.0f} ms)\n{report}")
            assert ratio > 0.5, report
            assert all(s["duration_ns"] >= CRUNCH_MS * 1_000_000 for s in crunch), report
            by_function: Counter[str] = Counter()
            for s in crunch:
                for f in s["top_functions"]:
                    by_function[f["name"]] += f["self_ns"]
            assert by_function.most_common(1)[0][0] == HEAVY, report
            assert by_function[HEAVY] > 0.8 * cpu, report
            assert sum(s["off_cpu_ns"] for s in crunch) < 0.5 * duration, report

            # one by one, for most of them (a sampler at 100 Hz on a busy machine can
            # miss some samples of one span; it cannot move them to another function)
            sampled = [s for s in crunch if s["sample_count"] > 0]
            assert len(sampled) >= ITERATIONS - 1, report
            assert all(s["top_functions"][0]["name"] == HEAVY for s in sampled), report
            assert all("link" in s["method"].split(",") for s in sampled), report
            mostly_cpu = [s for s in crunch if s["cpu_ns"] > 0.5 * s["duration_ns"]]
            assert len(mostly_cpu) > len(crunch) / 2, report

            # the sleeping spans: their duration is off-CPU
            idle_cpu = sum(s["cpu_ns"] for s in idle)
            idle_duration = sum(s["duration_ns"] for s in idle)
            print(f"{protocol}: idle cpu/duration = {idle_cpu / idle_duration:.3f}")
            assert idle_cpu < 0.1 * idle_duration, report
            assert all(s["off_cpu_ns"] >= 0.8 * s["duration_ns"] for s in idle), report
            assert all(f["name"] != HEAVY or f["self_ns"] <= 20_000_000
                       for s in idle for f in s["top_functions"]), report

            # the trace view says the same for a crunch span
            tid, sid = ids["crunch"][-1]
            trace = sp.get(f"/api/v1/traces/{tid}")
            assert [s["span_id"] for s in trace["spans"]] == [sid], trace
            assert trace["spans"][0]["cpu_ns"] == by_id[sid]["cpu_ns"], trace
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)

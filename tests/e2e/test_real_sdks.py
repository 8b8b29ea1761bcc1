"""Real programs, traced by the OpenTelemetry SDK of their language and profiled by the
Pyroscope SDK, against a running spanprof (issue #14's client matrix): each runs root spans
that burn CPU in a named busy function and spans that sleep, measures the CPU time it used in
each span itself, and the test asserts what spanprof made of it (``check_busy_spans``): the
busy function is the top self-CPU function of the spans that burnt it, and the CPU attributed
to those spans, summed, is within 10% of the CPU time the program measured in them (for
Python, plus the time it waited for a core or had its CPU taken by the hypervisor, which the
Python SDK's sampler counts as CPU: see ``run_app``).

Here: Python (``pyroscope-io`` + ``pyroscope-otel``, spans over OTLP/HTTP and OTLP/gRPC,
tests/e2e/sdk_app.py) and Node.js (``@pyroscope/nodejs`` + the OpenTelemetry JS SDK,
tests/clients/node). Go, Java and Rust have their own modules (test_go_sdk.py,
test_java_agent.py, test_rust_sdk.py). Each program runs in its own process as a user would
run it: nothing in it knows about spanprof but the two addresses.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cachelock import cache_lock
from tests.conftest import ROOT, SpanprofProcess, wait_until

# the real clients measure their own CPU and wall time: alone, not beside other tests
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
APP = Path(__file__).resolve().parent / "sdk_app.py"
HEAVY = "burn_cpu_in_hash_loop"  # sdk_app.HEAVY_FUNCTION
ITERATIONS = 6
# The Python SDK's sampler (py-spy) spaces its samples randomly (exponential intervals, so
# that it never runs in step with the program): the number of samples in T seconds is
# Poisson, sd sqrt(100 T) at 100 Hz. 1.8 s of CPU in the busy spans gives 180 +- 13 samples
# (seen 180-206: one run in five outside 10%); 9 s gives 900 +- 30, 10% being 3 sd.
CRUNCH_MS = 1500
IDLE_MS = 200
# issue #14: the CPU attributed to the busy spans, summed, within 10% of what the app measured
TOLERANCE = 0.10


def run_app(sp: SpanprofProcess, protocol: str, service: str) -> dict[str, list[Any]]:
    """sdk_app.py against ``sp``; its JSON line: the hex (trace_id, span_id) of its spans
    and the CPU time it measured in each."""
    endpoint = sp.http_url if protocol == "http" else sp.grpc_target
    # The Python SDK's sampler (py-spy) takes a thread that is running *or runnable* as on
    # CPU: on a machine whose cores are busy with other work, the time the program waits
    # for a core shows up as CPU in its profile (seen: 2190 ms for 1800 ms of CPU, the spans'
    # whole duration; 1.06-1.14 with the rest of the machine at nice 10 below the program).
    # Where the test may (root, as here and in CI), the program runs at a real-time priority
    # (SCHED_FIFO 1, any other work on the machine waits for it), which leaves it waiting for
    # a core only while the kernel throttles real-time work (5% of each second by default):
    # 100-200 ms in 9 s, measured (``crunch_wait_ns``). On a virtual machine the time the
    # hypervisor takes the program's CPU away (steal) is CPU time to that sampler too (seen:
    # 9920 ms of samples for 9002 ms of CPU, the spans lasting 9462 ms, 102 ms of it waiting
    # for a core): the spans run on one CPU, whose steal the program measures in each
    # (``crunch_steal_ns``). What the SDK can report for a busy span is the sum of the three.
    rt = ["chrt", "--fifo", "1"] if os.geteuid() == 0 and shutil.which("chrt") else []
    pin = ["--pin-cpu", str(max(os.sched_getaffinity(0)))] if rt else []
    proc = subprocess.run(
        [*rt, sys.executable, str(APP), protocol, endpoint, sp.pyroscope_url, service,
         str(ITERATIONS), "--crunch-ms", str(CRUNCH_MS), "--idle-ms", str(IDLE_MS),
         "--upload-interval", "1", *pin],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"sdk_app exited {proc.returncode}:\n{proc.stderr}"
    return app_output(proc.stdout)


def app_output(stdout: str, iterations: int = ITERATIONS) -> dict[str, list[Any]]:
    """The last line of a client program's output: ``crunch``/``idle`` ids and the CPU time
    it measured in each (``crunch_cpu_ns``/``idle_cpu_ns``), one per span."""
    out: dict[str, list[Any]] = json.loads(stdout.strip().splitlines()[-1])
    assert len(out["crunch"]) == len(out["idle"]) == iterations, out
    assert len(out["crunch_cpu_ns"]) == len(out["idle_cpu_ns"]) == iterations, out
    return out


def settled_spans(sp: SpanprofProcess, service: str, want: set[str],
                  quiet: float = 2.5, timeout: float = 40.0, order: str = "cpu",
                  method: str | None = None) -> dict[str, dict[str, Any]]:
    """The service's spans from the admin API, by span id, once every span in ``want`` is
    there and nothing has changed for ``quiet`` seconds (the last profile is pushed at the
    program's exit, and late samples add to spans already written): neither CPU, lock
    wait, bytes allocated nor the sample count. ``order`` is the API's (the first 1000 in
    that order), ``method`` its placement methods (``all``; the API's default, the exact
    ones, when None)."""
    last: list[Any] = [None, 0.0]
    query = f"/api/v1/spans?order={order}&limit=1000&service={service}"
    if method is not None:
        query += f"&method={method}"

    def poll() -> dict[str, dict[str, Any]] | None:
        spans = sp.get(query)["spans"]
        by_id = {s["span_id"]: s for s in spans}
        if not want <= set(by_id):
            return None
        snapshot = sorted((s["span_id"], s["cpu_ns"], s["lock_ns"], s["alloc_bytes"],
                           s["sample_count"]) for s in spans)
        now = time.monotonic()
        if snapshot != last[0]:
            last[0], last[1] = snapshot, now
            return None
        return by_id if now - last[1] >= quiet else None

    got: dict[str, dict[str, Any]] = wait_until(poll, timeout=timeout, interval=0.5)
    return got


def app_spans(sp: SpanprofProcess, service: str, out: dict[str, list[Any]]
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, dict[str, Any]],
                         str]:
    """A client program's ``crunch`` and ``idle`` spans (``app_output``) as the admin API
    has them once settled, in the program's order, each checked to be a root span of
    ``service`` under the trace the program exported it in; with every span by id and a
    report for failed assertions."""
    by_id = settled_spans(sp, service, {sid for _, sid in out["crunch"] + out["idle"]})
    crunch = [by_id[sid] for _, sid in out["crunch"]]
    idle = [by_id[sid] for _, sid in out["idle"]]
    report = f"crunch:\n{fmt(crunch)}\nidle:\n{fmt(idle)}\napp: {out}"
    for tid, sid in out["crunch"] + out["idle"]:
        s = by_id[sid]
        assert s["trace_id"] == tid and s["service"] == service, report
        assert s["parent_span_id"] == "", report
    return crunch, idle, by_id, report


def refused_requests(sp: SpanprofProcess) -> list[str]:
    """spanprof's log lines about refused requests (the receivers log each:
    ``pyroscope_request_refused``, ...)."""
    return [line for line in sp.logs().splitlines() if "_refused" in line]


def check_trace_view(sp: SpanprofProcess, out: dict[str, list[Any]],
                     by_id: dict[str, dict[str, Any]]) -> None:
    """The trace view of the last crunch span: that span alone, with the CPU the span list
    gives it."""
    tid, sid = out["crunch"][-1]
    trace = sp.get(f"/api/v1/traces/{tid}")
    assert [s["span_id"] for s in trace["spans"]] == [sid], trace
    assert trace["spans"][0]["cpu_ns"] == by_id[sid]["cpu_ns"], trace


def fmt(spans: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"  {s['name']} {s['span_id']} duration {s['duration_ns'] / 1e6:.0f}ms cpu "
        f"{s['cpu_ns'] / 1e6:.0f}ms samples {s['sample_count']} method {s['method']!r} top "
        f"{[(f['name'], f['self_ns'] // 1_000_000) for f in s['top_functions']]}"
        for s in spans)


def check_busy_spans(client: str, busy: list[dict[str, Any]], measured_ns: list[int],
                     heavy: str, report: str, top_share: float = 0.8,
                     function: Callable[[str], str] = lambda name: name,
                     ) -> tuple[float, float]:
    """Issue #14's acceptance for one client's busy spans: ``heavy`` is the top self-CPU
    function of each of them and of all together (at least ``top_share`` of their CPU),
    every one has samples, and the CPU attributed to them (exact methods), summed, is within
    ``TOLERANCE`` of the CPU time the program measured in them. ``function`` maps a name in
    the profile to the function it is (the Node SDK names one per line). Prints and returns
    (attributed / measured, ``heavy``'s share of the attributed CPU)."""
    attributed = sum(s["cpu_ns"] for s in busy)
    measured = sum(measured_ns)
    by_function: Counter[str] = Counter()
    tops: list[str] = []
    for s in busy:
        mine: Counter[str] = Counter()
        for f in s["top_functions"]:
            mine[function(f["name"])] += f["self_ns"]
        by_function.update(mine)
        tops.append(mine.most_common(1)[0][0] if mine else "")
    ratio = attributed / measured if measured else float("inf")
    share = by_function[heavy] / attributed if attributed else 0.0
    print(f"{client}: busy spans' attributed/measured CPU = {ratio:.3f} "
          f"({attributed / 1e6:.0f} / {measured / 1e6:.0f} ms), {heavy} {share:.1%} of it, "
          f"{len(busy)} spans, {sum(s['sample_count'] for s in busy)} samples, "
          f"{sum(s['duration_ns'] for s in busy) / 1e6:.0f} ms of duration\n{report}")
    assert measured > 0, report
    assert abs(attributed - measured) <= TOLERANCE * measured, (
        f"{client}: attributed {attributed / 1e6:.0f} ms, measured by the app "
        f"{measured / 1e6:.0f} ms\n{report}")
    assert by_function.most_common(1)[0][0] == heavy, report
    assert share > top_share, report
    assert all(s["sample_count"] > 0 for s in busy), report
    assert tops == [heavy] * len(busy), (tops, report)
    assert all("link" in s["method"].split(",") for s in busy), report
    return ratio, share


class TestRealSdks:
    @pytest.mark.parametrize("protocol", ["http", "grpc"])
    def test_heavy_function_tops_its_spans(self, tmp_path: Path, protocol: str) -> None:
        """Python: root spans that burn CPU in ``burn_cpu_in_hash_loop`` get that function
        as their top function and, summed, the CPU the program measured in them (within
        10%; joined by the span_id/trace_id labels ``pyroscope-otel`` puts on the samples);
        root spans that sleep get almost none. Spans exported over OTLP/``protocol``,
        profiles pushed by the Pyroscope SDK."""
        sp = SpanprofProcess(tmp_path)  # OTLP gRPC + HTTP and Pyroscope, as config/local.yaml
        sp.start()
        try:
            service = f"sdk-app-{protocol}"
            out = run_app(sp, protocol, service)
            crunch, idle, by_id, report = app_spans(sp, service, out)
            assert {s["name"] for s in crunch} == {"crunch"}, report
            assert {s["name"] for s in idle} == {"idle"}, report

            print(f"python/{protocol}: waited for a core in the busy spans "
                  f"{sum(out['crunch_wait_ns']) / 1e6:.0f} ms, the hypervisor took their CPU "
                  f"{sum(out['crunch_steal_ns']) / 1e6:.0f} ms")
            # the time the program was on its CPU as its sampler sees it (see run_app)
            check_busy_spans(f"python/{protocol}", crunch,
                             [sum(t) for t in zip(out["crunch_cpu_ns"], out["crunch_wait_ns"],
                                                  out["crunch_steal_ns"], strict=True)],
                             HEAVY, report)
            assert sum(s["off_cpu_ns"] for s in crunch) < 0.5 * sum(
                s["duration_ns"] for s in crunch), report

            # the sleeping spans: their duration is off-CPU
            idle_cpu = sum(s["cpu_ns"] for s in idle)
            idle_duration = sum(s["duration_ns"] for s in idle)
            print(f"{protocol}: idle cpu/duration = {idle_cpu / idle_duration:.3f}")
            assert idle_cpu < 0.1 * idle_duration, report
            assert all(s["off_cpu_ns"] >= 0.8 * s["duration_ns"] for s in idle), report
            assert all(f["name"] != HEAVY or f["self_ns"] <= 20_000_000
                       for s in idle for f in s["top_functions"]), report

            check_trace_view(sp, out, by_id)  # the trace view says the same
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)


NODE_APP = ROOT / "tests" / "clients" / "node"
# the busy function of tests/clients/node/app.js as the SDK names it, without the line
# (``./app.js:burnCpuInHashLoop:LINE``: file relative to the working directory, name, line)
NODE_HEAVY = "./app.js:burnCpuInHashLoop"


def node_function(name: str) -> str:
    """A function name from the Node SDK's profile without its line number."""
    head, _, line = name.rpartition(":")
    return head if head and line.isdigit() else name


def node_cache() -> Path:
    return Path(os.environ.get("SPANPROF_NODE_CACHE") or Path.home() / ".cache/spanprof/node")


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """tests/clients/node's packages, installed once with ``npm ci`` from its
    package-lock.json (every version pinned) into a cache that outlives the session,
    ``~/.cache/spanprof/node/<lock hash>`` (``SPANPROF_NODE_CACHE``): the first install
    downloads them (seconds), later runs reuse them. Node and npm are on every machine of
    this project: no Node, or an install that fails, is a failure, never a skip."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node/npm are not on PATH: the Node SDK test needs them", pytrace=False)
    lock = (NODE_APP / "package-lock.json").read_bytes()
    manifest = (NODE_APP / "package.json").read_bytes()
    where = node_cache() / hashlib.sha256(manifest + lock).hexdigest()[:16]
    done = where / "installed"
    with cache_lock("node"):
        install_node_modules(npm, where, done, manifest, lock)
    return where / "node_modules"


def install_node_modules(npm: str, where: Path, done: Path, manifest: bytes,
                         lock: bytes) -> None:
    if not done.exists():
        where.mkdir(parents=True, exist_ok=True)
        (where / "package.json").write_bytes(manifest)
        (where / "package-lock.json").write_bytes(lock)
        proc = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--cache", str(node_cache() / "npm-cache")],
            cwd=where, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"npm ci of {NODE_APP} failed ({proc.returncode}):\n"
                        f"{proc.stderr[-4000:]}", pytrace=False)
        done.write_text("ok\n")


def run_node_app(modules: Path, sp: SpanprofProcess, service: str) -> dict[str, list[Any]]:
    """tests/clients/node/app.js against ``sp``; its JSON line (``app_output``)."""
    env = dict(os.environ, SERVICE=service, SPANPROF_OTLP_HTTP=sp.http_url,
               SPANPROF_PYROSCOPE=sp.pyroscope_url, ITERATIONS=str(ITERATIONS),
               CRUNCH_MS=str(NODE_CRUNCH_MS), IDLE_MS=str(IDLE_MS), UPLOAD_MS="1000",
               NODE_PATH=str(modules), DEBUG="pyroscope")
    proc = subprocess.run(["node", "app.js"], cwd=NODE_APP, env=env, capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0, f"node app exited {proc.returncode}:\n{proc.stderr}"
    # with DEBUG=pyroscope the SDK logs each refused or failed upload
    assert "rejected" not in proc.stderr and "Error sending" not in proc.stderr, proc.stderr
    return app_output(proc.stdout)


# V8's profiler takes a sample about every 10 ms of wall time and gives each the CPU time
# the thread used since the one before: a span's first sample carries CPU from before it
# and the CPU after its last sample goes to the next (up to 10 ms at each end)
NODE_CRUNCH_MS = 500


class TestNodeSdk:
    def test_node_sdk_busy_function_tops_its_spans(self, tmp_path: Path,
                                                   node_modules: Path) -> None:
        """Node.js: ``@pyroscope/nodejs`` 0.6.4 (wall profiler with CPU time, uploads to
        /ingest as pprof), its samples labelled ``span_id``/``trace_id`` by the program
        with ``wrapWithLabels``; spans from the OpenTelemetry JS SDK over OTLP/HTTP
        protobuf. ``burnCpuInHashLoop`` is the top self-CPU function of the ``crunch``
        spans, which have, summed, the CPU time the program measured in them (within
        10%); the sleeping ``idle`` spans have almost none."""
        sp = SpanprofProcess(tmp_path)
        sp.start()
        try:
            service = "node-sdk-app"
            out = run_node_app(node_modules, sp, service)
            crunch, idle, _, report = app_spans(sp, service, out)
            refused = refused_requests(sp)
            assert refused == [], refused[:5]

            check_busy_spans("node", crunch, out["crunch_cpu_ns"], NODE_HEAVY, report,
                             function=node_function)

            idle_cpu = sum(s["cpu_ns"] for s in idle)
            idle_duration = sum(s["duration_ns"] for s in idle)
            print(f"node: idle cpu/duration = {idle_cpu / idle_duration:.3f}")
            assert idle_cpu < 0.1 * idle_duration, report
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)

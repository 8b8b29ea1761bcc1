"""A real Java program under the real agents against a running spanprof (issue #14, the
client matrix's Java entry): the OpenTelemetry Java agent 2.33.1 exports its spans over
OTLP/HTTP (http/protobuf), the Pyroscope Java agent 2.9.2 uploads JFR recordings to
``/ingest?format=jfr`` every 2 s (``itimer`` CPU sampling, 100 Hz), and the
``io.pyroscope:otel`` 1.0.2 extension labels each sample with the local root span (its
span id only: spanprof finds the trace through the span).

The program is tests/clients/java/src/main/java/spanprof/capture/MeasuredApp.java, built
once per session with Maven (tests/clients/java/javaapp.py; the agents come from Maven
Central, pinned in pom.xml, into a local repository that outlives the session,
``~/.cache/spanprof/m2``: a few seconds once it is warm). Its requests are a root span
"handle" doing a little work of its own (``prepare``) around a child span "crunch" that
burns CPU in ``MeasuredApp.crunch``; the program reads its thread's CPU time around that
work and prints it. The samples of a request are labelled with the root span, so the
ones taken in ``crunch`` reach the child only if spanprof places them by thread
(``thread.id`` on the spans, the Java thread id in the recording) and instant. Java and
Maven are on every machine of this project: a build that fails is a failure, never a
skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.clients.java import javaapp
from tests.conftest import SpanprofProcess
from tests.e2e.test_real_sdks import fmt, settled_spans

# the real clients measure their own CPU and wall time: alone, not beside other tests
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
SERVICE = "java-agent-app"
BUSY = "spanprof.capture.MeasuredApp.crunch"  # the busy method, as spanprof names it
PREPARE = "spanprof.capture.MeasuredApp.prepare"
REQUESTS = 5  # per worker thread
WORKERS = 2
CRUNCH_MS = 400  # CPU time per crunch span: 2 x 5 x 400 ms = 4 s, some 400 samples
PREPARE_MS = 40
UPLOAD_S = 2
# the agent uploads every UPLOAD_S and not at exit: the last requests' samples need the
# next upload after the work, and that upload's answer
LINGER_MS = 2 * UPLOAD_S * 1000 + 1000
UPLOAD_ERRORS = ("Error uploading snapshot", "Gave up uploading")  # the agent's own words


@pytest.fixture(scope="session")
def java_app() -> Path:
    """tests/clients/java built (``mvn package``) once per session."""
    try:
        javaapp.build()
    except javaapp.BuildFailed as err:
        pytest.fail(str(err), pytrace=False)
    return javaapp.JAR


def agents_env(sp: SpanprofProcess) -> dict[str, str]:
    """The environment the agents read: only these settings (none inherited)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "PYROSCOPE_", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS"))}
    return env | {
        "OTEL_SERVICE_NAME": SERVICE,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": sp.http_url,  # the agent posts to .../v1/traces
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "PYROSCOPE_APPLICATION_NAME": SERVICE,
        "PYROSCOPE_SERVER_ADDRESS": sp.pyroscope_url,
        "PYROSCOPE_FORMAT": "jfr",
        "PYROSCOPE_PROFILER_EVENT": "itimer",
        "PYROSCOPE_UPLOAD_INTERVAL": f"{UPLOAD_S}s",
        "PYROSCOPE_LOG_LEVEL": "debug",  # each upload attempt is logged
        # the agent unpacks async-profiler into a directory of java.io.tmpdir it leaves
        # behind: the test's own, not /tmp (600 KiB a run)
        "JAVA_TOOL_OPTIONS": f"-Djava.io.tmpdir={sp.tmp}",
    }


def run_app(sp: SpanprofProcess) -> tuple[list[dict[str, Any]], str]:
    """MeasuredApp under the agents against ``sp``: its requests and the agents' log."""
    cmd = javaapp.command(str(REQUESTS), str(WORKERS), str(CRUNCH_MS), str(PREPARE_MS),
                          str(LINGER_MS), main="spanprof.capture.MeasuredApp")
    proc = subprocess.run(cmd, env=agents_env(sp), capture_output=True, text=True,
                          timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the Java app exited {proc.returncode}:\n{log[-6000:]}"
    line = next((x for x in proc.stdout.splitlines() if x.startswith('{"requests"')), None)
    assert line is not None, f"the Java app printed no requests:\n{log[-6000:]}"
    requests: list[dict[str, Any]] = json.loads(line)["requests"]
    assert len(requests) == REQUESTS * WORKERS, line
    return requests, log


def metrics(sp: SpanprofProcess) -> dict[str, int]:
    """spanprof's counters (``/metrics``), by series; a counter still at 0 is absent."""
    with urllib.request.urlopen(sp.admin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {name: int(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line)
            if "_total" in name}


@dataclass
class Outcome:
    """One run of the program against spanprof, as the tests look at it."""

    requests: list[dict[str, Any]]  # what the program measured, per request
    crunch: list[dict[str, Any]]  # the admin API's spans, in the order of ``requests``
    roots: list[dict[str, Any]]
    trace: dict[str, Any]  # /api/v1/traces/{id} of the last request
    agent_log: str
    refused: list[str]  # spanprof's log lines about refused requests
    counters: dict[str, int]
    stopped: int  # spanprof's exit code

    @property
    def measured(self) -> int:
        """CPU time the program measured around the work of its crunch spans."""
        return sum(r["crunch_cpu_ns"] for r in self.requests)

    def self_ns(self, spans: list[dict[str, Any]]) -> Counter[str]:
        """Self CPU per function over ``spans`` (their top functions)."""
        out: Counter[str] = Counter()
        for s in spans:
            for f in s["top_functions"]:
                out[f["name"]] += f["self_ns"]
        return out

    def report(self) -> str:
        cpu = sum(s["cpu_ns"] for s in self.crunch)
        mine = sum(r["root_cpu_ns"] - r["crunch_cpu_ns"] for r in self.requests)
        return (f"crunch cpu attributed/measured {cpu / 1e6:.0f}/{self.measured / 1e6:.0f}"
                f" ms = {cpu / self.measured:.3f}, {BUSY} "
                f"{self.self_ns(self.crunch)[BUSY] / max(cpu, 1):.3f} of it; handle self "
                f"cpu {sum(s['cpu_ns'] for s in self.roots) / 1e6:.0f} ms (measured "
                f"{mine / 1e6:.0f} ms), {BUSY} in it "
                f"{self.self_ns(self.roots)[BUSY] / 1e6:.0f} ms\n"
                f"crunch:\n{fmt(self.crunch)}\nhandle:\n{fmt(self.roots)}\n"
                f"uploads {self.agent_log.count('Upload attempt')}; "
                + ", ".join(f"{k} {v}" for k, v in self.counters.items()
                            if "connector" in k or "pyroscope" in k))


@pytest.fixture(scope="module")
def outcome(java_app: Path, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The program run once against a fresh spanprof, then spanprof stopped."""
    sp = SpanprofProcess(tmp_path_factory.mktemp("java-agent"))
    sp.start()
    try:
        requests, agent_log = run_app(sp)
        by_id = settled_spans(sp, SERVICE, {r["span_id"] for r in requests}
                              | {r["root_span_id"] for r in requests})
        out = Outcome(
            requests, [by_id[r["span_id"]] for r in requests],
            [by_id[r["root_span_id"]] for r in requests],
            sp.get(f"/api/v1/traces/{requests[-1]['trace_id']}"), agent_log,
            [x for x in sp.logs().splitlines() if "_refused" in x], metrics(sp), 0)
        out.stopped = sp.stop()
        print(f"java agent: {out.report()}")
        return out
    finally:
        if sp.proc is not None and sp.proc.poll() is None:
            sp.stop(signal.SIGKILL)


class TestJavaAgent:
    def test_uploads_accepted_and_busy_method_cpu_matches_the_apps_own_measure(
            self, outcome: Outcome) -> None:
        """Every upload of the Pyroscope Java agent is accepted; the samples, labelled
        with the root span "handle", that were taken in ``crunch`` go to the child span
        "crunch" running on their thread: ``MeasuredApp.crunch`` is the top self-CPU
        function of each of those spans, and the CPU they get, summed, is within 10% of
        the CPU time the program measured itself around that work (4 s of it, some 400
        samples at 100 Hz)."""
        o = outcome
        report = o.report()
        errors = [x for x in o.agent_log.splitlines() if any(e in x for e in UPLOAD_ERRORS)]
        assert errors == [], errors[:5]
        # every upload after the work, and the one after it, were sent
        assert o.agent_log.count("Upload attempt") >= 3, o.agent_log[-4000:]
        # no request refused: the receivers log each (pyroscope_request_refused, ...)
        assert o.refused == [], o.refused[:5]
        assert o.counters.get(
            'spanprof_receiver_refused_requests_total{receiver="pyroscope"}', 0) == 0, report
        assert o.counters.get(
            'spanprof_receiver_accepted_samples_total{receiver="pyroscope"}', 0) > 0, report
        assert o.stopped == 0

        for r, c, root in zip(o.requests, o.crunch, o.roots, strict=True):
            assert (c["trace_id"], c["service"], c["name"]) == (
                r["trace_id"], SERVICE, "crunch"), report
            assert (root["trace_id"], root["name"]) == (r["trace_id"], "handle"), report
        assert {s["span_id"] for s in o.trace["spans"]} == {
            o.requests[-1]["span_id"], o.requests[-1]["root_span_id"]}, o.trace

        cpu = sum(s["cpu_ns"] for s in o.crunch)
        assert abs(cpu - o.measured) <= 0.10 * o.measured, report
        by_function = o.self_ns(o.crunch)
        assert by_function.most_common(1)[0][0] == BUSY, report
        assert by_function[BUSY] > 0.9 * cpu, report
        assert all(s["top_functions"] and s["top_functions"][0]["name"] == BUSY
                   for s in o.crunch), report
        # placed from the root's label by thread and instant
        assert all(s["method"] == "link+time" for s in o.crunch), report
        assert all(s["inclusive_cpu_ns"] >= s["cpu_ns"] + c["cpu_ns"]
                   for s, c in zip(o.roots, o.crunch, strict=True)), report

    def test_samples_stay_in_the_span_running_at_their_instant(
            self, outcome: Outcome) -> None:
        """On the two agents' own clocks every sample taken in ``prepare`` falls before
        its request's child span and every one taken in ``crunch`` within it (the JFR
        recording's instants and the OpenTelemetry agent's span times agree to the
        millisecond), so each span gets its own method's samples: ``prepare`` has almost
        nothing in the crunch spans, ``crunch`` almost nothing in the handle spans. (The
        handle spans wait 30 ms after their child: no skew may be learnt from that.)"""
        o = outcome
        report = o.report()
        assert o.self_ns(o.crunch)[PREPARE] <= 0.01 * o.measured, report
        assert o.self_ns(o.roots)[BUSY] <= 0.01 * o.measured, report
        assert o.self_ns(o.roots).most_common(1)[0][0] == PREPARE, report

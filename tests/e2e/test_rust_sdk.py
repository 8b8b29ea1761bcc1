"""A real Rust program, traced by the OpenTelemetry Rust SDK (OTLP/HTTP protobuf) and
profiled by the Pyroscope Rust SDK (``pyroscope`` 2.1.5 with its pprof-rs backend, pushing
to ``/push.v1.PusherService/Push``), against a running spanprof (issue #14's client matrix).

Rust has no OpenTelemetry integration that labels profiles with spans: the program labels
its root spans itself with the SDK's thread tags (``tag_wrapper``: ``span_id`` on the thread
for the span's duration; each tag change makes the backend build its report so far, so it
is a tool for root spans, not for every span).

The program is tests/clients/rust (Cargo.lock pins every crate), built once per session with
``cargo build --release --locked`` into a cache that outlives the session,
``~/.cache/spanprof/cargo`` (``SPANPROF_CARGO_CACHE``: the crates under ``home``, the build
under ``target``): the first build downloads and compiles 167 crates (about 80 s on this
2-core machine), later ones take a second. Rust is on every machine of this project: no
cargo, or a build that fails, is a failure, never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SpanprofProcess
from tests.e2e.test_real_sdks import (
    app_output,
    app_spans,
    check_busy_spans,
    check_trace_view,
    refused_requests,
)

# the real clients measure their own CPU and wall time: alone, not beside other tests
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
APP = ROOT / "tests" / "clients" / "rust"
# the busy function, as the SDK names it in the profile (demangled, with its crate's path)
HEAVY = "spanprof_rust_app::burn_cpu_in_hash_loop"
ITERATIONS = 6
CRUNCH_MS = 300
IDLE_MS = 200


def cargo_cache() -> Path:
    return Path(os.environ.get("SPANPROF_CARGO_CACHE")
                or Path.home() / ".cache/spanprof/cargo")


@pytest.fixture(scope="session")
def rust_app() -> Path:
    """tests/clients/rust built with its Cargo.lock (``--locked``) by the local toolchain,
    crates and build kept across runs."""
    cargo = shutil.which("cargo") or shutil.which("cargo", path=str(Path.home() / ".cargo/bin"))
    if cargo is None:
        pytest.fail("cargo is not on PATH: the Rust SDK test needs the Rust toolchain",
                    pytrace=False)
    cache = cargo_cache()
    env = dict(os.environ, CARGO_HOME=str(cache / "home"),
               CARGO_TARGET_DIR=str(cache / "target"), CARGO_TERM_COLOR="never")
    try:
        proc = subprocess.run([cargo, "build", "--release", "--locked"], cwd=APP, env=env,
                              capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"cargo build of {APP} took over 900 s:\n{err.stderr!r}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"cargo build of {APP} failed ({proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    return cache / "target" / "release" / "spanprof-rust-app"


def run_app(app: Path, sp: SpanprofProcess, service: str) -> dict[str, list[Any]]:
    """The Rust program against ``sp``; the hex (trace_id, span_id) of its spans and the
    CPU time it measured in each."""
    env = dict(os.environ, SERVICE=service, SPANPROF_OTLP_HTTP=sp.http_url,
               SPANPROF_PYROSCOPE=sp.pyroscope_url, ITERATIONS=str(ITERATIONS),
               CRUNCH_MS=str(CRUNCH_MS), IDLE_MS=str(IDLE_MS), UPLOAD_MS="1000")
    proc = subprocess.run([str(app)], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"rust app exited {proc.returncode}:\n{proc.stderr}"
    return app_output(proc.stdout, ITERATIONS)


class TestRustSdk:
    def test_rust_sdk_busy_function_tops_its_spans(self, tmp_path: Path,
                                                   rust_app: Path) -> None:
        """The Rust SDK's pushes are accepted; its CPU samples, tagged ``span_id`` by the
        program, are joined to the spans it exported over OTLP/HTTP:
        ``burn_cpu_in_hash_loop`` is the top self-CPU function of the ``crunch`` spans,
        which have, summed, the CPU time the program measured in them (within 10%); the
        sleeping ``idle`` spans have none to speak of."""
        sp = SpanprofProcess(tmp_path)
        sp.start()
        try:
            service = "rust-sdk-app"
            out = run_app(rust_app, sp, service)
            crunch, idle, by_id, report = app_spans(sp, service, out)
            refused = refused_requests(sp)
            assert refused == [], refused[:5]

            # the backend's timer is the process's CPU clock (ITIMER_PROF, 100 Hz): a
            # sample every 10 ms of CPU the process used, in whichever thread used it
            check_busy_spans("rust", crunch, out["crunch_cpu_ns"], HEAVY, report)

            idle_cpu = sum(s["cpu_ns"] for s in idle)
            assert idle_cpu < 0.1 * sum(s["duration_ns"] for s in idle), report

            check_trace_view(sp, out, by_id)
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)

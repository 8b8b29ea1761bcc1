"""A small traced and profiled Python program, run by tests/e2e/test_real_sdks.py as a
subprocess: the real OpenTelemetry SDK exports its spans over OTLP (HTTP or gRPC) and the
real Pyroscope SDK, with ``pyroscope-otel``'s span processor, pushes its CPU profile.

    python sdk_app.py {http|grpc} OTLP_ENDPOINT PYROSCOPE_URL SERVICE ITERATIONS

Each iteration runs two root spans: ``crunch``, which spends ``--crunch-ms`` of its
thread's CPU time in the pure Python function ``burn_cpu_in_hash_loop``, and ``idle``, which
sleeps ``--idle-ms``. (``pyroscope-otel`` labels samples with the *local root* span only, so
the work is done in root spans.) The CPU time the thread used in each span is measured
around its work (``time.thread_time_ns()``), and so is the time it was runnable but waited
for a core (``crunch_wait_ns``, from ``/proc/thread-self/schedstat``): the Pyroscope Python
SDK's sampler counts a thread that is running *or runnable* as on CPU, so that wait shows up
as CPU in its profile. On a virtual machine so does the time the hypervisor takes the
thread's CPU away (steal): with ``--pin-cpu N`` the thread runs on CPU N only and that time
is measured too (``crunch_steal_ns``, from /proc/stat). At the end the spans are flushed,
then the profiler is shut down, which pushes its last profile; one JSON object goes to
stdout: ``{"crunch": [[trace_id, span_id], ...], "idle": [...], "crunch_cpu_ns": [...],
"idle_cpu_ns": [...], "crunch_wait_ns": [...], "crunch_steal_ns": [...]}``, ids in hex.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import pyroscope
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from pyroscope.otel import PyroscopeSpanProcessor

HEAVY_FUNCTION = "burn_cpu_in_hash_loop"


def burn_cpu_in_hash_loop(ms: float) -> int:
    """FNV-1a over integers, in pure Python, until this thread has used ``ms`` of CPU time
    (not wall time: on a busy machine the span is longer, its CPU the same), or ten times
    that of wall time. The profiler's samples land in this frame (no C function below it to
    take them)."""
    budget = int(ms * 1_000_000)
    start, deadline = time.thread_time_ns(), time.perf_counter() + 10 * ms / 1000
    h = 0x811C9DC5
    while time.thread_time_ns() - start < budget and time.perf_counter() < deadline:
        for i in range(2000):
            h = ((h ^ (i & 0xFF)) * 0x01000193) & 0xFFFFFFFF
    return h


def run_delay_ns() -> int:
    """How long this thread has been runnable but waiting for a core (Linux schedstat's
    second field; 0 where it is not available)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def steal_ns(cpu: int | None) -> int:
    """The time the hypervisor has taken CPU ``cpu`` away from this virtual machine (Linux
    /proc/stat's steal column, in clock ticks): while it does, the thread on that CPU uses no
    CPU time but, to a sampler that samples on the wall clock, is running. 0 where not known."""
    if cpu is None:
        return 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith(f"cpu{cpu} "):
                    return int(line.split()[8]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    return 0


def exporter(protocol: str, endpoint: str, token: str = "") -> SpanExporter:
    headers = {"authorization": f"Bearer {token}"} if token else None
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )
        return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", timeout=30,
                            headers=headers)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    return GrpcExporter(endpoint=endpoint, insecure=True, timeout=30, headers=headers)


class SeededIds(IdGenerator):
    """Trace and span ids drawn from a seeded generator: two runs with the same seed give
    their spans the same ids (two tenants sending the same trace ids, issue #17)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self.rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self.rng.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def ids(span: Any) -> list[str]:
    ctx = span.get_span_context()
    return [format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("protocol", choices=["http", "grpc"])
    ap.add_argument("otlp_endpoint", help="http://127.0.0.1:4318 or 127.0.0.1:4317")
    ap.add_argument("pyroscope", help="the Pyroscope server address, http://127.0.0.1:4040")
    ap.add_argument("service")
    ap.add_argument("iterations", type=int)
    ap.add_argument("--crunch-ms", type=float, default=300)
    ap.add_argument("--idle-ms", type=float, default=200)
    ap.add_argument("--upload-interval", type=int, default=1, help="seconds")
    ap.add_argument("--pin-cpu", type=int, default=None,
                    help="run the spans' thread on this CPU only, and measure the time the "
                    "hypervisor took that CPU away in each busy span (crunch_steal_ns)")
    ap.add_argument("--token", default="", help="sent as a bearer token (OTLP) and as the "
                    "basic-auth password (Pyroscope)")
    ap.add_argument("--id-seed", type=int, default=None,
                    help="draw trace and span ids from this seed (default: at random)")
    args = ap.parse_args(argv)

    pyroscope.configure(
        application_name=args.service,
        server_address=args.pyroscope,
        sample_rate=100,
        oncpu=True,          # only a running or runnable thread is sampled, not a sleeping one
        gil_only=True,
        report_thread_id=True,
        upload_interval=args.upload_interval,
        tags={"sdk_app": "1"},
        basic_auth_username="sdk-app" if args.token else "",
        basic_auth_password=args.token,
    )
    provider = TracerProvider(resource=Resource.create({"service.name": args.service}),
                              id_generator=SeededIds(args.id_seed)
                              if args.id_seed is not None else None)
    provider.add_span_processor(PyroscopeSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(
        exporter(args.protocol, args.otlp_endpoint, args.token), schedule_delay_millis=500))
    tracer = provider.get_tracer("spanprof-sdk-app")

    # the sampler thread starts in configure(): burn a little outside any span first, so
    # that the first span is sampled like the others, then sleep, so that the warm-up's
    # samples are behind the sampler before the first span's label is set
    burn_cpu_in_hash_loop(200)
    time.sleep(0.5)
    out: dict[str, list[Any]] = {"crunch": [], "idle": [], "crunch_cpu_ns": [],
                                 "idle_cpu_ns": [], "crunch_wait_ns": [],
                                 "crunch_steal_ns": []}
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})  # this thread only (Linux: 0 is the caller)
    for _ in range(args.iterations):
        with tracer.start_as_current_span("crunch") as span:
            steal0 = steal_ns(args.pin_cpu)
            cpu0, wait0 = time.thread_time_ns(), run_delay_ns()
            burn_cpu_in_hash_loop(args.crunch_ms)
            out["crunch_cpu_ns"].append(time.thread_time_ns() - cpu0)
            out["crunch_wait_ns"].append(run_delay_ns() - wait0)
            out["crunch_steal_ns"].append(steal_ns(args.pin_cpu) - steal0)
        out["crunch"].append(ids(span))
        with tracer.start_as_current_span("idle") as span:
            cpu0 = time.thread_time_ns()
            time.sleep(args.idle_ms / 1000)
            out["idle_cpu_ns"].append(time.thread_time_ns() - cpu0)
        out["idle"].append(ids(span))

    provider.shutdown()        # exports every span still queued, waits for the answer
    if not pyroscope.shutdown():  # stops the sampler and pushes the last profile
        print("pyroscope.shutdown() failed", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

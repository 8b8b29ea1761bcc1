"""Acknowledgement latency and memory of the embedded pipeline under a steady load.

`spanprof run` with the shipped config (config/local.yaml: memory_limiter, batch, grace
from SPANPROF_GRACE) in its own process; a paced client sends OTLP/gRPC trace requests
(1 000 spans each) and profile requests (samples labelled with those spans) at fixed
rates, and times each acknowledgement (durable in ClickHouse). Reports p50/p99/max per
signal, the process's peak RSS, and what the correlator holds (entries, estimated bytes)
with the RSS per held span.

    make bench   # or: python bench/bench_latency.py --spans-per-s 10000 --seconds 30
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_pipeline import (  # noqa: E402
    PROFILES,
    TRACE,
    insert_stats,
    profile_requests,
    trace_requests,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def metric(admin: str, name: str) -> int:
    with urllib.request.urlopen(admin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{name}\{{[^}}]*\}} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def queued_rows(admin: str) -> int:
    """Rows the ClickHouse exporter's sending queue holds, logged and not inserted."""
    return (metric(admin, "spanprof_exporter_queued_rows_total")
            - metric(admin, "spanprof_exporter_queue_inserted_rows_total"))


def loop_lag(admin: str) -> tuple[int, int, float]:
    """The pipeline's event-loop lag: rounds measured, rounds late by over 50 ms, worst."""
    with urllib.request.urlopen(admin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    got = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                    if line.startswith("spanprof_event_loop_lag"))}
    name = "spanprof_event_loop_lag_seconds"
    count = int(got.get(f"{name}_count", 0))
    return (count, count - int(got.get(f'{name}_bucket{{le="0.05"}}', 0)),
            got.get("spanprof_event_loop_lag_max_seconds", 0.0))


def paced(target: str, method: str, reqs: list[bytes], per_s: float, out: list[float],
          failures: list[str]) -> None:
    """Send ``reqs`` at ``per_s`` requests per second (each in its own thread, as
    independent clients would), recording each acknowledgement's latency."""
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    lock = threading.Lock()

    def one(body: bytes) -> None:
        t0 = time.perf_counter()
        try:
            call(body, timeout=60)
        except grpc.RpcError as err:
            with lock:
                failures.append(err.code().name)
            return
        with lock:
            out.append(time.perf_counter() - t0)

    threads = []
    start = time.perf_counter()
    for i, body in enumerate(reqs):
        delay = start + i / per_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(body,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    channel.close()


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans-per-s", type=int, default=10_000)
    ap.add_argument("--samples-per-s", type=int, default=20_000)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--grace", default="60s")
    ap.add_argument("--config", default=str(ROOT / "config" / "local.yaml"))
    # the OpenTelemetry SDKs' batch span processor sends at most 512 spans a request
    ap.add_argument("--spans-per-request", type=int, default=1000)
    ap.add_argument("--samples-per-request", type=int, default=2000)
    args = ap.parse_args()

    per_req_spans, per_req_samples = args.spans_per_request, args.samples_per_request
    n_spans = args.spans_per_s * args.seconds
    n_samples = args.samples_per_s * args.seconds
    treqs, keys = trace_requests(n_spans, per_req_spans)
    preqs = profile_requests(keys, n_samples, per_req_samples)
    with tempfile.TemporaryDirectory(prefix="spanprof-latency-") as tmp:
        ports = {k: free_port() for k in ("grpc", "http", "pyroscope", "admin")}
        env = dict(os.environ, SPANPROF_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{ports['grpc']}",
                   SPANPROF_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{ports['http']}",
                   SPANPROF_PYROSCOPE_ENDPOINT=f"127.0.0.1:{ports['pyroscope']}",
                   SPANPROF_ADMIN_ENDPOINT=f"127.0.0.1:{ports['admin']}",
                   SPANPROF_CLICKHOUSE_ENDPOINT=f"chdb://{tmp}/data",
                   SPANPROF_GRACE=args.grace, SPANPROF_LOG_ENCODING="json",
                   MALLOC_TRIM_THRESHOLD_="268435456")
        admin = f"http://127.0.0.1:{ports['admin']}"
        log = open(Path(tmp) / "spanprof.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "-c",
                                 args.config], cwd=tmp, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(admin + "/health", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.1)
            rss0 = rss_kib(proc.pid)
            lat: dict[str, list[float]] = {"traces": [], "profiles": []}
            failures: list[str] = []
            peak = [rss0]
            stop_peak = [0]  # the peak from SIGTERM to exit (the correlator's final report)
            queue_peak = [0]  # rows in the sending queue, not inserted yet
            done, stopping = threading.Event(), threading.Event()

            def watch() -> None:
                ticks = 0
                while proc.poll() is None:
                    time.sleep(0.5)
                    try:
                        rss = rss_kib(proc.pid)
                    except OSError:
                        return
                    if stopping.is_set():
                        stop_peak[0] = max(stop_peak[0], rss)
                    elif not done.is_set():
                        peak[0] = max(peak[0], rss)
                        ticks += 1
                        if ticks % 4 == 0:  # every 2 s: /metrics costs the pipeline CPU
                            with contextlib.suppress(OSError):
                                queue_peak[0] = max(queue_peak[0], queued_rows(admin))

            threading.Thread(target=watch, daemon=True).start()
            target = f"127.0.0.1:{ports['grpc']}"
            senders = [
                threading.Thread(target=paced, args=(target, TRACE, treqs,
                                                     args.spans_per_s / per_req_spans,
                                                     lat["traces"], failures)),
                threading.Thread(target=paced, args=(target, PROFILES, preqs,
                                                     args.samples_per_s / per_req_samples,
                                                     lat["profiles"], failures))]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            entries = metric(admin, "spanprof_connector_state_entries")
            state_bytes = metric(admin, "spanprof_connector_state_bytes")
            lag_rounds, lag_late, lag_max = loop_lag(admin)
            rss_end = rss_kib(proc.pid)
            done.set()
        finally:
            stopping.set()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        inserts = insert_stats((Path(tmp) / "spanprof.log").read_text(errors="replace"))
    print(f"\nacknowledgement latency, config {Path(args.config).name}, grace {args.grace}, "
          f"{args.spans_per_s:,} spans/s + {args.samples_per_s:,} samples/s for "
          f"{args.seconds}s, {os.cpu_count()} cores")
    for sig, xs in lat.items():
        print(f"  {sig:<9} {len(xs):>5} requests  p50 {pct(xs, 50) * 1000:7.1f} ms  "
              f"p99 {pct(xs, 99) * 1000:7.1f} ms  max {max(xs, default=0) * 1000:7.1f} ms")
    if failures:
        print(f"  refused or failed: {len(failures)} ({sorted(set(failures))})")
    print(f"  event loop: {lag_late} of {lag_rounds} rounds late by over 50 ms, "
          f"worst {lag_max * 1000:.0f} ms")
    print(f"  RSS: start {rss0 / 1024:.0f} MiB, peak {peak[0] / 1024:.0f} MiB, "
          f"end {rss_end / 1024:.0f} MiB; peak while stopping (SIGTERM: everything held "
          f"reported) {stop_peak[0] / 1024:.0f} MiB")
    print(f"  sending queue: at most {queue_peak[0]:,} rows waiting (sampled every 2 s)")
    print("  ClickHouse inserts, per table: inserts, rows, ms, ms/insert")
    for table, (n, rows, ms) in sorted(inserts.items(), key=lambda x: -x[1][2]):
        print(f"    {table:<18} {n:>6} {rows:>9} {ms:>8} {ms / max(n, 1):>8.1f}")
    if entries:
        print(f"  correlator holds {entries:,} entries, estimated {state_bytes / 2**20:.0f} MiB "
              f"({state_bytes / entries:.0f} B each); RSS growth per held entry "
              f"{(rss_end - rss0) * 1024 / entries:.0f} B")


if __name__ == "__main__":
    main()

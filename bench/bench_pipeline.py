"""Throughput of the embedded pipeline: OTLP/gRPC -> correlator -> ClickHouse (chdb).

`spanprof run` runs in its own process, as in production; this driver sends prebuilt,
serialised requests from threads and counts a request only when it is acknowledged, i.e.
durable in ClickHouse. Reports spans/s and samples/s, then checks the stored counts.

    make bench            # or: python bench/bench_pipeline.py --spans 200000 --samples 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.otlp.builder import ProfileBuilder  # noqa: E402
from tests.conftest import SpanprofProcess, clickhouse  # noqa: E402

TRACE = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROFILES = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export"


def trace_requests(n_spans: int, per_req: int
                   ) -> tuple[list[bytes], list[tuple[bytes, bytes, str]]]:
    """Requests of ``per_req`` spans, each request one service of five; the keys (trace,
    span, service) of every span, in order."""
    reqs, keys = [], []
    now = time.time_ns()
    for r in range(0, n_spans, per_req):
        req = tps.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        kv = rs.resource.attributes.add(key="service.name")
        service = kv.value.string_value = f"svc{r // per_req % 5}"
        ss = rs.scope_spans.add()
        for i in range(r, min(r + per_req, n_spans)):
            tid, sid = os.urandom(16), os.urandom(8)
            s = ss.spans.add(trace_id=tid, span_id=sid, name=f"op{i % 20}", kind=2,
                             start_time_unix_nano=now, end_time_unix_nano=now + 20_000_000)
            a = s.attributes.add(key="http.route")
            a.value.string_value = f"/api/v1/items/{i % 50}"
            keys.append((tid, sid, service))
        reqs.append(req.SerializeToString())
    return reqs, keys


def profile_requests(keys: list[tuple[bytes, bytes, str]], n_samples: int, per_req: int
                     ) -> list[bytes]:
    reqs = []
    frames = [[f"fn{j}", f"mid{j % 10}", "handler", "main"] for j in range(200)]
    for r in range(0, n_samples, per_req):
        b = ProfileBuilder()
        for i in range(r, min(r + per_req, n_samples)):
            # a span's samples come together (a profiler's upload covers the span's
            # whole duration), every span has some, from the span's service
            tid, sid, service = keys[i * len(keys) // n_samples]
            b.sample(frames[i % len(frames)], 10_000_000, tid, sid, service=service)
        reqs.append(b.build().SerializeToString())
    return reqs


def blast(target: str, method: str, reqs: list[bytes], concurrency: int) -> float:
    """Send all requests with `concurrency` threads; return seconds until all acked."""
    it = iter(range(len(reqs)))
    lock = threading.Lock()
    failures: list[str] = []

    def worker() -> None:
        channel = grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", 64 << 20)])
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                break
            for _ in range(20):
                try:
                    call(reqs[i], timeout=60)
                    break
                except grpc.RpcError as err:  # retryable: back off like an SDK would
                    failures.append(err.code().name)
                    time.sleep(0.2)
        channel.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        print(f"  (retried {len(failures)} times: {sorted(set(failures))})")
    return time.perf_counter() - t0


def insert_stats(logs: str) -> dict[str, tuple[int, int, int]]:
    """Per table: (inserts, rows, ms) from the exporter's last words (clickhouse_stopped)."""
    line = next((ln for ln in reversed(logs.splitlines()) if "clickhouse_stopped" in ln), "{}")
    try:
        fields = json.loads(line)
    except ValueError:
        fields = {}
    out = {}
    for key, value in fields.items():
        if key.startswith("inserts_"):
            table = key[len("inserts_"):]
            out[table] = (int(value), int(fields.get(f"sent_rows_{table}", 0)),
                          int(fields.get(f"insert_ms_{table}", 0)))
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far, all its threads (the
    embedded engine's included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=500_000)
    ap.add_argument("--spans-per-request", type=int, default=1000)
    ap.add_argument("--samples-per-request", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--no-queue", action="store_true",
                    help="acknowledge once inserted (no sending queue, as before)")
    ap.add_argument("--intake", action="store_true",
                    help="the otlp receiver's intake: answered once the request is logged")
    args = ap.parse_args()

    print(f"building {args.spans} spans and {args.samples} samples ...")
    treqs, keys = trace_requests(args.spans, args.spans_per_request)
    preqs = profile_requests(keys, args.samples, args.samples_per_request)
    with tempfile.TemporaryDirectory(prefix="spanprof-bench-") as tmp:
        # as make run's config: acknowledged once logged, inserted in groups of 50 000 rows
        extra = "max_pending_rows: 2000000" + (
            "" if args.no_queue else
            "\n    batch_rows: 50000\n    sending_queue: {enabled: true, max_mib: 4096}")
        p = SpanprofProcess(Path(tmp), grace="1s", exporter_extra=extra,
                            receiver_extra="intake: {max_mib: 256}" if args.intake else "")
        p.start()
        try:
            assert p.proc is not None
            c0 = cpu_seconds(p.proc.pid)
            t_spans = blast(p.grpc_target, TRACE, treqs, args.concurrency)
            c1 = cpu_seconds(p.proc.pid)
            t_samples = blast(p.grpc_target, PROFILES, preqs, args.concurrency)
            c2 = cpu_seconds(p.proc.pid)
            t0 = time.perf_counter()
            rc = p.stop(signal.SIGTERM, timeout=600)
            t_stop = time.perf_counter() - t0
        finally:
            if p.proc and p.proc.poll() is None:
                p.proc.kill()
        assert rc == 0, p.logs()[-2000:]
        inserts = insert_stats(p.logs())
        with clickhouse(p.data) as ch:
            n_spans = ch.query("SELECT count() FROM spanprof.otel_traces").result_rows[0][0]
            n_samples = ch.query("SELECT count() FROM spanprof.profile_samples"
                                 ).result_rows[0][0]
            n_attr = ch.query("SELECT count() FROM spanprof.span_attribution_totals"
                              ).result_rows[0][0]
            cpu = ch.query("SELECT sum(cpu_ns) FROM spanprof.span_attribution FINAL"
                           ).result_rows[0][0]
    print(f"\nembedded pipeline, OTLP/gRPC -> batch -> clickhouse + spancorrelator (chdb), "
          f"{'no sending queue' if args.no_queue else 'sending queue'}"
          f"{', intake (acknowledged = logged, decoded behind)' if args.intake else ''}, "
          f"{os.cpu_count()} cores, concurrency {args.concurrency}")
    rate = args.spans / t_spans
    print(f"  spans    {args.spans:>9} in {t_spans:6.2f}s  -> {rate:>10,.0f} spans/s"
          f"   ({args.spans_per_request}/request, acknowledged)")
    print(f"  samples  {args.samples:>9} in {t_samples:6.2f}s  -> "
          f"{args.samples / t_samples:>10,.0f} samples/s ({args.samples_per_request}/request)")
    # CPU per item is steadier than a rate on a shared machine: what the process spent
    # (every thread, the engine's included) while each load was sent and acknowledged
    print(f"  process CPU: {1e6 * (c1 - c0) / args.spans:.1f} us per span "
          f"({(c1 - c0) / t_spans:.2f} cores busy), {1e6 * (c2 - c1) / args.samples:.1f} us "
          f"per sample ({(c2 - c1) / t_samples:.2f} cores busy)")
    print(f"  drain on SIGTERM (correlator flush + final inserts): {t_stop:.2f}s")
    total = t_spans + t_samples + t_stop
    print(f"  end to end, drain included: {args.spans / total:,.0f} spans/s with "
          f"{args.samples / total:,.0f} samples/s ({total:.2f}s)")
    print("  ClickHouse inserts, per table: inserts, rows, ms, us/row")
    for table, (n, rows, ms) in sorted(inserts.items(), key=lambda x: -x[1][2]):
        print(f"    {table:<18} {n:>6} {rows:>9} {ms:>8} {1000 * ms / max(rows, 1):>7.2f}")
    print(f"  stored: {n_spans} spans, {n_samples} samples, {n_attr} span attributions, "
          f"cpu {cpu / 1e9:.1f}s (expected {args.samples * 0.01:.1f}s)")
    ok = n_spans == args.spans and n_samples == args.samples and \
        n_attr == args.spans and cpu == args.samples * 10_000_000
    print("  check:", "ok" if ok else "MISMATCH")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

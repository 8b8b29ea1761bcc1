"""Throughput of the Kafka tier on this machine, with a real broker.

1. gateway: OTLP/gRPC -> Kafka (acks=all); a request counts once Kafka acknowledged it.
2. correlator: Kafka -> ClickHouse (embedded) + attribution, from the topics the gateway
   filled, timed until the group's committed offsets reach the end of both topics.

    make bench      # or: python bench/bench_kafka.py --spans 100000 --samples 500000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_latency import paced, pct, rss_kib  # noqa: E402
from bench.bench_pipeline import (  # noqa: E402
    PROFILES,
    TRACE,
    blast,
    cpu_seconds,
    profile_requests,
    trace_requests,
)
from tests.conftest import SpanprofProcess, clickhouse  # noqa: E402
from tests.e2e.test_kafka_crash import _lag  # noqa: E402
from tests.e2e.test_kafka_tier import CORRELATOR, GATEWAY  # noqa: E402
from tests.kafka_broker import KafkaBroker, create_topics  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=500_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--latency-seconds", type=int, default=10,
                    help="the paced phase at half the measured rates (0: skip it)")
    args = ap.parse_args()
    print(f"building {args.spans} spans and {args.samples} samples ...")
    treqs, keys = trace_requests(args.spans, 1000)
    preqs = profile_requests(keys, args.samples, 10_000)
    with tempfile.TemporaryDirectory(prefix="spanprof-bench-kafka-") as tmp:
        broker = KafkaBroker(Path(tmp) / "kafka")
        broker.start()
        names = {"brokers": broker.bootstrap, "group": "bench", "spans": "otlp_spans",
                 "profiles": "otlp_profiles"}
        asyncio.run(create_topics(broker.bootstrap, names["spans"], names["profiles"]))
        gateway = SpanprofProcess(Path(tmp) / "gw", config_text=GATEWAY % names)
        correlator = SpanprofProcess(Path(tmp) / "co", config_text=CORRELATOR % names)
        try:
            gateway.start()
            assert gateway.proc is not None
            c0 = cpu_seconds(gateway.proc.pid)
            t_spans = blast(gateway.grpc_target, TRACE, treqs, args.concurrency)
            c1 = cpu_seconds(gateway.proc.pid)
            t_samples = blast(gateway.grpc_target, PROFILES, preqs, args.concurrency)
            c2 = cpu_seconds(gateway.proc.pid)
            assert gateway.stop() == 0
            t0 = time.perf_counter()
            correlator.start()
            topics = [names["spans"], names["profiles"]]
            while asyncio.run(_lag(broker.bootstrap, "bench", topics)) > 0:
                time.sleep(0.5)
            t_corr = time.perf_counter() - t0
            assert correlator.stop() == 0
            if args.latency_seconds:
                latency = _half_load(broker.bootstrap, Path(tmp) / "lat",
                                     args.spans / t_spans, args.samples / t_samples,
                                     args.latency_seconds)
        finally:
            for p in (gateway, correlator):
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.kill()
            broker.stop()
        with clickhouse(correlator.data) as ch:
            n_spans = ch.query("SELECT count() FROM spanprof.otel_traces").result_rows[0][0]
            cpu = ch.query("SELECT sum(cpu_ns) FROM spanprof.span_attribution_totals"
                           ).result_rows[0][0]
            # the aggregates against the deduplicated raw rows: a block delivered twice
            # (the receiver re-reads after a refusal) must reach them once
            agg = ch.query("SELECT sum(cpu_ns) FROM spanprof.op_minute").result_rows[0][0]
            raw = ch.query("SELECT sum(cpu_ns) FROM spanprof.span_attribution FINAL "
                           "WHERE span_known = 1").result_rows[0][0]
            # CPU rows written before their span was read (no operation: not in op_minute)
            early = ch.query(
                "SELECT sum(a.cpu_ns), countIf(t.SpanId != '') FROM "
                "(SELECT trace_id, span_id, cpu_ns FROM spanprof.span_attribution FINAL "
                " WHERE span_known = 0) AS a LEFT JOIN spanprof.otel_traces AS t "
                "ON t.TraceId = a.trace_id AND t.SpanId = a.span_id").result_rows[0]
            written, kept = ch.query(
                "SELECT (SELECT count() FROM spanprof.span_attribution), "
                "(SELECT count() FROM spanprof.span_attribution FINAL)").result_rows[0]
    print(f"\nKafka tier (broker, gateway and correlator on {os.cpu_count()} cores)")
    print(f"  gateway     OTLP/gRPC -> Kafka: {args.spans / t_spans:>10,.0f} spans/s, "
          f"{args.samples / t_samples:>10,.0f} samples/s")
    # the gateway's own CPU (its process, all threads): what a span and a sample cost it,
    # whatever the broker and the load generator took of the machine
    print(f"  gateway CPU: {1e6 * (c1 - c0) / args.spans:.2f} us per span "
          f"({args.spans / max(c1 - c0, 1e-9):,.0f} spans per CPU-second), "
          f"{1e6 * (c2 - c1) / args.samples:.2f} us per sample "
          f"({args.samples / max(c2 - c1, 1e-9):,.0f} samples per CPU-second)")
    print(f"  correlator  Kafka -> ClickHouse: {(args.spans + args.samples) / t_corr:>10,.0f} "
          f"items/s ({args.spans} spans + {args.samples} samples in {t_corr:.1f}s, incl. "
          "start-up)")
    ok = n_spans == args.spans and cpu == args.samples * 10_000_000 and agg == raw
    print(f"  attribution rows {written} written, {kept} kept; op_minute cpu {agg / 1e9:.1f}s, "
          f"raw rows of known spans {raw / 1e9:.1f}s")
    print(f"  CPU of samples read before their span: {(early[0] or 0) / max(cpu, 1):.1%} "
          f"({early[1]} such rows whose span is stored)")
    print(f"  stored {n_spans} spans, cpu {cpu / 1e9:.1f}s -> check:", "ok" if ok else "MISMATCH")
    if args.latency_seconds:
        for line in latency:
            print(line)
    if not ok:
        sys.exit(1)


def _half_load(bootstrap: str, where: Path, spans_per_s: float, samples_per_s: float,
               seconds: int) -> list[str]:
    """A new gateway on topics of its own, paced at half the rates the blasts reached
    (spans for ``seconds``, then samples; fresh requests: resent ones would be answered
    as duplicates), each acknowledgement timed: what a client waits at half load."""
    per_t, per_p = 1000, 10_000
    treqs, keys = trace_requests(int(spans_per_s / 2 * seconds) // per_t * per_t or per_t,
                                 per_t)
    preqs = profile_requests(keys, int(samples_per_s / 2 * seconds) // per_p * per_p or per_p,
                             per_p)
    names = {"brokers": bootstrap, "group": "bench-latency", "spans": "latency_spans",
             "profiles": "latency_profiles"}
    asyncio.run(create_topics(bootstrap, names["spans"], names["profiles"]))
    gateway = SpanprofProcess(where, config_text=GATEWAY % names)
    lat: dict[str, list[float]] = {"traces": [], "profiles": []}
    failures: list[str] = []
    try:
        gateway.start()
        assert gateway.proc is not None
        rss0 = rss_kib(gateway.proc.pid)
        # one signal after the other: each at half of what it alone reached
        paced(gateway.grpc_target, TRACE, treqs, spans_per_s / 2 / per_t, lat["traces"],
              failures)
        paced(gateway.grpc_target, PROFILES, preqs, samples_per_s / 2 / per_p,
              lat["profiles"], failures)
        rss = rss_kib(gateway.proc.pid)
        assert gateway.stop() == 0
    finally:
        if gateway.proc is not None and gateway.proc.poll() is None:
            gateway.proc.kill()
    out = [f"  gateway at half those rates, {seconds}s each ({spans_per_s / 2:,.0f} spans/s in "
           f"{per_t}-span requests, then {samples_per_s / 2:,.0f} samples/s in {per_p}-sample "
           "requests), acknowledged once Kafka has the data:"]
    for sig, xs in lat.items():
        out.append(f"    {sig:<9} {len(xs):>5} requests  p50 {pct(xs, 50) * 1000:7.1f} ms  "
                   f"p99 {pct(xs, 99) * 1000:7.1f} ms  max {max(xs, default=0) * 1000:7.1f} ms")
    if failures:
        out.append(f"    refused or failed: {len(failures)} ({sorted(set(failures))})")
    out.append(f"    gateway RSS {rss0 / 1024:.0f} MiB at start, {rss / 1024:.0f} MiB at the end")
    return out


if __name__ == "__main__":
    main()

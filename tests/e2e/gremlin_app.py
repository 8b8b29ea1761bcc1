"""A traced and profiled Python service with a gremlin in about 2% of its calls, run by
tests/e2e/test_why_real_sdk.py as a subprocess (issue #21): the real OpenTelemetry SDK
exports its spans over OTLP/HTTP, the real Pyroscope SDK, with ``pyroscope-otel``'s span
processor, pushes its CPU profile; nothing in it knows about spanprof but the two
addresses.

    python -m tests.e2e.gremlin_app {burn|lock} OTLP_HTTP_ENDPOINT PYROSCOPE_URL SERVICE

Every call is a root span ``place order`` (``pyroscope-otel`` labels samples with the local
root span only) with the attributes ``region`` (drawn from the same distribution for
every call), ``request.id`` (unique) and ``cart.size``. Which calls are slow is drawn by a
seeded generator (``--seed``): ``round(calls * 2%)`` of them, anywhere in the run.

* ``burn``: every call spends ``--typical-ms`` of its thread's CPU time in ``price_items``;
  the slow ones then ``--gremlin-ms`` more in ``recompute_discounts``, and carry a large
  cart (``cart.size`` 200-400, against 1-5).
* ``lock``: every call spends ``--typical-ms`` in ``price_items`` and takes the stock lock
  in ``reserve_stock``; before a slow one, a background thread takes that lock and sleeps
  ``--gremlin-ms`` holding it (``refresh_stock_cache``), so the call waits for it, burning
  no more CPU than the others.

By default the profiler samples as a service would run it (``oncpu=True``, ``gil_only=True``:
a running or runnable thread holding the GIL). ``--sample-waiting`` samples every thread,
waiting or not (``oncpu=False``, ``gil_only=False``), to see what a waiting thread's
samples look like once received. At the end the spans are flushed and the profiler shut
down (its last profile pushed); one JSON object goes to stdout: ``{"mode": ..., "calls":
[[trace_id, span_id], ...], "slow": [[trace_id, span_id], ...], "duration_ns": [...],
"cpu_ns": [...]}``, ids in hex, durations and thread CPU times as the program measured
them, in call order.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

import pyroscope
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from pyroscope.otel import PyroscopeSpanProcessor

from tests.e2e.sdk_app import exporter, ids

OPERATION = "place order"
GREMLIN_FUNCTION = "recompute_discounts"
REGIONS = ("eu-west", "us-east", "ap-south")
SLOW_SHARE = 0.02


# The two busy functions burn in their own frame (not in a shared helper): the profile's
# leaf, which ``why`` ranks functions by, is then the function itself. FNV-1a over
# integers in pure Python, until the thread has used ``ms`` of CPU time (not wall time: on a
# busy machine the call is longer, its CPU the same), or ten times that of wall time.

def price_items(ms: float) -> int:
    """Every call's work."""
    budget = int(ms * 1_000_000)
    start, deadline = time.thread_time_ns(), time.perf_counter() + 10 * ms / 1000
    h = 0x811C9DC5
    while time.thread_time_ns() - start < budget and time.perf_counter() < deadline:
        for i in range(2000):
            h = ((h ^ (i & 0xFF)) * 0x01000193) & 0xFFFFFFFF
    return h


def recompute_discounts(ms: float) -> int:
    """The gremlin of ``burn``: only the slow calls run it."""
    budget = int(ms * 1_000_000)
    start, deadline = time.thread_time_ns(), time.perf_counter() + 10 * ms / 1000
    h = 0x811C9DC5
    while time.thread_time_ns() - start < budget and time.perf_counter() < deadline:
        for i in range(2000):
            h = ((h ^ (i & 0xFF)) * 0x01000193) & 0xFFFFFFFF
    return h


class StockRefresher:
    """The gremlin of ``lock``: a background thread that, when asked, takes the stock lock
    and sleeps holding it (as a cache refresh doing I/O under its lock would)."""

    def __init__(self, lock: threading.Lock, hold_s: float) -> None:
        self.lock, self.hold_s = lock, hold_s
        self.asked, self.holding = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.run, name="stock-refresher", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            self.refresh_stock_cache()

    def refresh_stock_cache(self) -> None:
        with self.lock:
            self.holding.set()
            time.sleep(self.hold_s)

    def refresh_now(self) -> None:
        """Returns once the refresher holds the lock."""
        self.holding.clear()
        self.asked.set()
        self.holding.wait()


def reserve_stock(lock: threading.Lock) -> None:
    """Every call of ``lock`` takes the stock lock (free but for the slow calls)."""
    with lock:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("mode", choices=["burn", "lock"])
    ap.add_argument("otlp_endpoint", help="OTLP/HTTP, http://127.0.0.1:4318")
    ap.add_argument("pyroscope", help="the Pyroscope server address, http://127.0.0.1:4040")
    ap.add_argument("service")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--typical-ms", type=float, default=15)
    ap.add_argument("--gremlin-ms", type=float, default=300)
    ap.add_argument("--upload-interval", type=int, default=1, help="seconds")
    ap.add_argument("--sample-waiting", action="store_true",
                    help="sample waiting threads too (oncpu=False, gil_only=False)")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    slow = set(rng.sample(range(args.calls), round(args.calls * SLOW_SHARE)))
    pyroscope.configure(
        application_name=args.service,
        server_address=args.pyroscope,
        sample_rate=100,
        oncpu=not args.sample_waiting,
        gil_only=not args.sample_waiting,
        report_thread_id=True,
        upload_interval=args.upload_interval,
    )
    provider = TracerProvider(resource=Resource.create({"service.name": args.service}))
    provider.add_span_processor(PyroscopeSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(exporter("http", args.otlp_endpoint),
                                                   schedule_delay_millis=500))
    tracer = provider.get_tracer("spanprof-gremlin-app")
    lock = threading.Lock()
    refresher = StockRefresher(lock, args.gremlin_ms / 1000) if args.mode == "lock" else None

    # as sdk_app.py: burn a little outside any span so that the sampler is running, then
    # sleep so that the warm-up's samples are behind it before the first span's label is set
    price_items(200)
    time.sleep(0.5)
    out: dict[str, Any] = {"mode": args.mode, "calls": [], "slow": [], "duration_ns": [],
                           "cpu_ns": []}
    for i in range(args.calls):
        gremlin = i in slow
        attributes: dict[str, str | int] = {
            "region": rng.choice(REGIONS),
            "request.id": f"{rng.getrandbits(64):016x}",
            "cart.size": rng.randint(200, 400)
            if gremlin and args.mode == "burn" else rng.randint(1, 5)}
        t0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
        with tracer.start_as_current_span(OPERATION, attributes=attributes) as span:
            price_items(args.typical_ms)
            if args.mode == "burn" and gremlin:
                recompute_discounts(args.gremlin_ms)
            if refresher is not None:
                if gremlin:
                    refresher.refresh_now()
                reserve_stock(lock)
        out["duration_ns"].append(time.perf_counter_ns() - t0)
        out["cpu_ns"].append(time.thread_time_ns() - cpu0)
        out["calls"].append(ids(span))
        if gremlin:
            out["slow"].append(ids(span))

    provider.shutdown()        # exports every span still queued, waits for the answer
    if not pyroscope.shutdown():  # stops the sampler and pushes the last profile
        print("pyroscope.shutdown() failed", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

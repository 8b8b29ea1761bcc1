"""What the browser tests show: traces and profiles sent to a running ``spanprof run`` over
OTLP/gRPC, as a profiler and a tracer send them.

``checkout`` / ``place_order``: ``TYPICAL`` calls over the last minutes (80-200 ms, a few
ms of CPU each), and one slow call (``SLOW_TRACE``, 2.4 s) whose ``price`` child burns
900 ms in ``compute_discount`` and waits 500 ms in ``threading.Lock.acquire`` (a wall-clock
profile). CPU and wall samples are labelled with the root span and carry their instant
and thread, so the correlator places them in the child running then (``link+time``,
"child"); samples at instants no child covers stay on the root (``link``, "exact"); the
slow call's ``serialize`` child gets unlabelled samples of its process and thread
(``thread``). An hour and a half earlier, ``BEFORE`` calls burn less in
``compute_discount``: the operation's differential flame graph has something to show.

``cart`` / ``update_cart`` (another service, so that checkout's figures stay as they are):
``CART_CALLS`` calls over the last ten minutes, of which ``CART_SLOW`` (2%) take over a
second, burning about 1 s in ``CART_HOT`` (10 ms in the typical calls) with a large
``cart.size`` attribute (300-480 items against 1-6): what the why view names.
"""

from __future__ import annotations

import random
import time
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.otlp.builder import ProfileBuilder
from tests.e2e.otlp_clients import profiles_stub, traces_stub

MS = 1_000_000
TYPICAL, BEFORE = 40, 20
SLOW_TRACE = bytes.fromhex("5eed0000000000000000000000000001")
THREAD, PID, HOST = 7, 4242, "ui-test-host"
RESOURCE = {"process.pid": PID, "host.name": HOST}
HOT = "compute_discount"
CART_CALLS, CART_SLOW = 250, 5
CART_HOT = "recompute_promotions"


def _kv(key: str, value: str | int) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(int_value=value) if isinstance(value, int)
                    else AnyValue(string_value=value))


class Feed:
    """Builds one request of spans and one of profiles, then sends both."""

    def __init__(self, service: str = "checkout") -> None:
        self.service = service
        self.spans = tps.ExportTraceServiceRequest()
        rs = self.spans.resource_spans.add()
        rs.resource.attributes.extend([_kv("service.name", service),
                                       *(_kv(k, v) for k, v in RESOURCE.items())])
        self.scope = rs.scope_spans.add()
        self.profiles = ProfileBuilder()

    def span(self, tid: bytes, sid: bytes, parent: bytes, name: str, start: int,
             end: int, attributes: dict[str, str | int] | None = None) -> None:
        s = self.scope.spans.add(trace_id=tid, span_id=sid, parent_span_id=parent, name=name,
                                 start_time_unix_nano=start, end_time_unix_nano=end)
        s.attributes.append(_kv("thread.id", THREAD))
        s.attributes.extend(_kv(k, v) for k, v in (attributes or {}).items())

    def cpu(self, frames: list[str], tid: bytes, sid: bytes, at: int, t0: int,
            measure: str = "cpu") -> None:
        """One 10 ms sample at instant ``at`` on THREAD, labelled with ``sid`` (none: b"")."""
        self.profiles.sample(frames, None, tid, sid, timestamps=[at],
                             attributes={"thread.id": THREAD, "thread.name": "worker-7"},
                             service=self.service, resource=RESOURCE, time_unix_nano=t0,
                             sample_type=measure, period_type=measure)

    def call(self, tid: bytes, t0: int, dur_ms: int, rnd: random.Random, hot_ms: int,
             slow: bool = False) -> None:
        """place_order with reserve_stock, price and serialize children."""
        root, stock, price, ser = (tid[:4] + bytes([0, 0, 0, i]) for i in (1, 2, 3, 4))
        at = lambda ms: t0 + ms * MS + 3 * MS  # noqa: E731 - a sample's instant
        stock_end = int(dur_ms * 0.25)
        price_end = int(dur_ms * (0.9 if slow else 0.8))
        self.span(tid, root, b"", "place_order", t0, t0 + dur_ms * MS)
        self.span(tid, stock, root, "reserve_stock", t0 + 10 * MS, t0 + stock_end * MS)
        self.span(tid, price, root, "price", t0 + (stock_end + 5) * MS, t0 + price_end * MS)
        self.span(tid, ser, root, "serialize", t0 + (price_end + 5) * MS,
                  t0 + (dur_ms - 5) * MS)
        self.cpu(["parse_request", "place_order", "handler"], tid, root, at(0), t0)  # root
        for ms in range(10, min(stock_end - 5, 40), 10):
            self.cpu(["query_stock", "reserve_stock", "handler"], tid, root, at(ms), t0)
        for i in range(hot_ms // 10):
            self.cpu([HOT, "price", "handler"], tid, root, at(stock_end + 5 + 10 * i), t0)
        if slow:  # then it waits on a lock for 500 ms (wall profile)
            base = stock_end + 5 + hot_ms
            for i in range(50):
                self.cpu(["threading.Lock.acquire", "price", "handler"], tid, root,
                         at(base + 10 * i), t0, measure="wall")
                # and a contention profile of the same wait (Go's delay/nanoseconds)
                self.cpu(["threading.Lock.acquire", "price", "handler"], tid, root,
                         at(base + 10 * i), t0, measure="delay")
            for i in range(8):  # no label: the profiler of the process, by thread
                self.cpu(["json.dumps", "serialize", "handler"], b"", b"",
                         at(price_end + 5 + 10 * i), t0)
        else:
            self.cpu(["json.dumps", "serialize", "handler"], tid, root, at(price_end + 5), t0)

    def cart_call(self, tid: bytes, t0: int, dur_ms: int, hot_ms: int, size: int) -> None:
        """update_cart, no children: its CPU is the span's own (``link``), ``hot_ms`` of
        it in CART_HOT."""
        sid = tid[:4] + bytes([0, 0, 0, 1])
        self.span(tid, sid, b"", "update_cart", t0, t0 + dur_ms * MS, {"cart.size": size})
        at = lambda ms: t0 + ms * MS + 3 * MS  # noqa: E731 - a sample's instant
        self.cpu(["load_cart", "update_cart", "handler"], tid, sid, at(0), t0)
        for i in range(hot_ms // 10):
            self.cpu([CART_HOT, "apply_rules", "update_cart", "handler"], tid, sid,
                     at(10 + 10 * i), t0)
        self.cpu(["save_cart", "update_cart", "handler"], tid, sid, at(dur_ms - 20), t0)

    def send(self, target: str) -> None:
        with grpc.insecure_channel(target) as channel:
            traces_stub(channel).Export(self.spans, timeout=30)
            profiles_stub(channel).Export(self.profiles.build(), timeout=30)


def feed(target: str, now_s: float | None = None) -> dict[str, Any]:
    """Send everything; returns what the tests look for."""
    now = int(now_s if now_s is not None else time.time())
    rnd = random.Random(18)
    f = Feed()
    for i in range(TYPICAL):
        tid = bytes([0xA0, 0, 0, i + 1]) + bytes(12)
        f.call(tid, (now - 600 + i * 12) * 1_000_000_000, rnd.randint(80, 200), rnd,
               hot_ms=10 * rnd.randint(1, 3))
    f.call(SLOW_TRACE, (now - 300) * 1_000_000_000 + 123 * MS, 2400, rnd, hot_ms=900,
           slow=True)
    for i in range(BEFORE):  # an hour and a half earlier: less in compute_discount
        tid = bytes([0xB0, 0, 0, i + 1]) + bytes(12)
        f.call(tid, (now - 5400 + i * 12) * 1_000_000_000, rnd.randint(80, 200), rnd,
               hot_ms=10)
    f.send(target)
    cart = Feed("cart")
    slow = set(rnd.sample(range(CART_CALLS), CART_SLOW))
    for i in range(CART_CALLS):
        tid = bytes([0xCA, 0, 0, i + 1]) + bytes(12)
        t0 = (now - 600) * 1_000_000_000 + i * 2300 * MS
        if i in slow:
            cart.cart_call(tid, t0, rnd.randint(1150, 1300), 1000, rnd.randint(300, 480))
        else:
            cart.cart_call(tid, t0, rnd.randint(60, 160), 10, rnd.randint(1, 6))
    cart.send(target)
    return {"slow_trace": SLOW_TRACE.hex(), "calls": TYPICAL + 1}

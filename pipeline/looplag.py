"""How long the event loop was kept from running: every acknowledgement waits behind it.

A task sleeps ``interval`` seconds over and over; how much later than asked it wakes is
time the loop spent in something synchronous (decoding a request, building rows, a
collection pause). Kept as a Prometheus histogram on ``/metrics``
(``spanprof_event_loop_lag_seconds``) beside the largest lag seen, so a latency tail can
be told apart from slow storage; a stall of ``warn_after`` seconds or more is logged.
"""

from __future__ import annotations

import asyncio
import bisect
import time

import structlog

from pipeline.background import stop_task

# upper bounds, seconds: the acknowledgement target is 50 ms at p99
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    def __init__(self, interval: float = 0.05, warn_after: float = 1.0) -> None:
        self.interval = interval
        self.warn_after = warn_after
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0
        self.max = 0.0
        self._task: asyncio.Task[None] | None = None
        self.log = structlog.get_logger().bind(component="service")

    def observe(self, lag: float) -> None:
        lag = max(lag, 0.0)
        self.counts[bisect.bisect_left(BUCKETS, lag)] += 1
        self.total += lag
        if lag > self.max:
            self.max = lag
        if lag >= self.warn_after:
            self.log.warning("event_loop_stalled", seconds=round(lag, 3))

    async def run(self) -> None:
        clock = time.perf_counter
        while True:
            t0 = clock()
            await asyncio.sleep(self.interval)
            self.observe(clock() - t0 - self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="event-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    def prometheus(self) -> list[str]:
        name = "spanprof_event_loop_lag_seconds"
        lines, cumulative = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum {self.total:.6f}")
        lines.append(f"{name}_count {cumulative}")
        lines.append(f"spanprof_event_loop_lag_max_seconds {self.max:.6f}")
        return lines

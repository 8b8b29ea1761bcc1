"""The event-loop lag histogram: a synchronous stall shows up in the right bucket."""

from __future__ import annotations

import asyncio
import time

from structlog.testing import capture_logs

from pipeline.looplag import LoopLag


def parse(lines: list[str]) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines)}


async def test_a_stall_is_measured_and_logged() -> None:
    with capture_logs() as logs:
        lag = LoopLag(interval=0.01, warn_after=0.1)
        lag.start()
        await asyncio.sleep(0.05)  # a few quiet rounds
        time.sleep(0.15)  # noqa: ASYNC251 - the stall under test: the task wakes >= 0.14 s late
        await asyncio.sleep(0.05)
        await lag.stop()
    stalls = [e for e in logs if e["event"] == "event_loop_stalled"]
    assert stalls and max(e["seconds"] for e in stalls) >= 0.13
    got = parse(lag.prometheus())
    name = "spanprof_event_loop_lag_seconds"
    # the stall is counted above 0.1 s (a loaded machine may add others, never remove it)
    assert got[f'{name}_bucket{{le="0.1"}}'] <= got[f"{name}_count"] - 1
    assert got[f"{name}_count"] >= 3
    assert got["spanprof_event_loop_lag_max_seconds"] >= 0.13
    assert got[f"{name}_sum"] >= 0.13


def test_buckets_are_cumulative_and_bounded() -> None:
    lag = LoopLag()
    for v in (0.0, 0.002, 0.002, 0.07, 30.0, -1.0):
        lag.observe(v)
    got = parse(lag.prometheus())
    name = "spanprof_event_loop_lag_seconds"
    assert got[f'{name}_bucket{{le="0.001"}}'] == 2  # 0 and the clamped -1
    assert got[f'{name}_bucket{{le="0.005"}}'] == 4
    assert got[f'{name}_bucket{{le="0.1"}}'] == 5
    assert got[f'{name}_bucket{{le="2.5"}}'] == 5
    assert got[f'{name}_bucket{{le="+Inf"}}'] == 6 == got[f"{name}_count"]
    assert got["spanprof_event_loop_lag_max_seconds"] == 30.0

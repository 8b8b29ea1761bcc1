"""``memory_limiter``: refuses data, with a retryable error, while the process uses too much
memory, so that a burst ends in clients retrying later rather than in the OOM killer
(and everything not yet durable lost with the process).

It behaves as the OpenTelemetry Collector's ``memorylimiterprocessor``. Every
``check_interval`` it measures the process's memory. The *hard* limit is ``limit_mib`` (or
``limit_percentage`` of the memory available: the cgroup's limit in a container, else the
machine's); the *soft* limit is the hard limit minus ``spike_limit_mib`` (default 20% of the
limit), the growth expected between two checks. At or above the soft limit every batch is
refused with ``Retryable`` (receivers answer ``UNAVAILABLE`` / 503 with a retry delay) and
counted in ``refused_spans`` / ``refused_samples``; at or above the hard limit a garbage
collection is forced too. Below the soft limit data flows again. State changes are logged.

As in the Collector, put it *first* in every pipeline, so that data is refused before any
other processor holds on to it::

    processors:
      memory_limiter:
        check_interval: 1s
        limit_mib: 1500            # or limit_percentage: 80 (of the container's memory)
        spike_limit_mib: 300       # default: 20% of the limit; soft limit = 1200 MiB
      batch:
    service:
      pipelines:
        traces:
          receivers: [otlp]
          processors: [memory_limiter, batch]
          exporters: [clickhouse]

Differences from the Collector: with neither ``limit_mib`` nor ``limit_percentage``
(the Collector refuses that), the limit is 80% of the available memory, so that ``{}`` is
a working config like every spanprof component's. And the measure is the resident set size
(RSS, ``/proc/self/statm``), not the Go runtime's heap size: Python has no cheap count of
live heap bytes (``tracemalloc`` slows every allocation), and much of this process's memory
is not Python objects at all (the embedded ClickHouse engine, protobuf and gRPC buffers),
yet all of it is what the kernel counts against the container's limit. RSS lags behind
frees (allocators keep freed pages), so after a forced collection the C heap's free pages
are returned to the kernel (glibc ``malloc_trim``) before measuring again.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import math
import os
import time
from collections import Counter
from collections.abc import Callable

import msgspec

from pipeline.component import Consumer
from pipeline.config import Duration, NonNegDuration, NonNegInt, Percentage
from pipeline.errors import ConfigError, Retryable
from pipeline.records import Batch
from pipeline.registry import Context, Factory

MIB = 1 << 20
DEFAULT_LIMIT_PERCENTAGE = 80
ITEMS = {"traces": "spans", "profiles": "samples", "attributions": "attributions"}


class Config(msgspec.Struct, forbid_unknown_fields=True):
    check_interval: Duration = Duration(1.0)
    # the hard limit: one of these two (neither: limit_percentage 80)
    limit_mib: NonNegInt = 0
    limit_percentage: Percentage = 0
    # limit - spike = the soft limit, where refusing starts (0: 20% of the limit)
    spike_limit_mib: NonNegInt = 0
    spike_limit_percentage: Percentage = 0
    # forced collections are not repeated more often than this
    min_gc_interval_when_soft_limited: NonNegDuration = NonNegDuration(10.0)
    min_gc_interval_when_hard_limited: NonNegDuration = NonNegDuration(0.0)

    def validate(self) -> None:
        problems = []
        if self.limit_mib and self.limit_percentage:
            problems.append("limit_mib: set limit_mib or limit_percentage, not both")
        if self.limit_mib and self.spike_limit_percentage:
            problems.append("spike_limit_percentage: goes with limit_percentage; "
                            "with limit_mib, set spike_limit_mib")
        if self.limit_percentage and self.spike_limit_mib:
            problems.append("spike_limit_mib: goes with limit_mib; "
                            "with limit_percentage, set spike_limit_percentage")
        if self.limit_mib and self.spike_limit_mib >= self.limit_mib:
            problems.append("spike_limit_mib: must be smaller than limit_mib")
        percentage = self.limit_percentage or (0 if self.limit_mib else DEFAULT_LIMIT_PERCENTAGE)
        if percentage and self.spike_limit_percentage >= percentage:
            problems.append("spike_limit_percentage: must be smaller than limit_percentage "
                            f"({percentage})")
        if self.min_gc_interval_when_soft_limited < self.min_gc_interval_when_hard_limited:
            problems.append("min_gc_interval_when_soft_limited: must be at least "
                            "min_gc_interval_when_hard_limited")
        if problems:
            raise ConfigError(problems)

    def limits(self, total_memory: Callable[[], int]) -> tuple[int, int]:
        """(hard, soft) limits in bytes."""
        if self.limit_mib:
            hard = self.limit_mib * MIB
            spike = self.spike_limit_mib * MIB
        else:
            total = total_memory()
            hard = total * (self.limit_percentage or DEFAULT_LIMIT_PERCENTAGE) // 100
            spike = total * self.spike_limit_percentage // 100
        return hard, hard - (spike or hard // 5)


def rss_bytes() -> int:
    """Resident set size of this process (Linux: the second field of /proc/self/statm)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, which is what getrusage has
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def total_memory_bytes() -> int:
    """What this process may use: the cgroup's limit (v2, then v1) if lower than RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a huge number (v1): no limit
            return min(ram, int(text))
    return ram


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, which gives the C heap's free pages back to the kernel (so
    that RSS drops after a collection); None elsewhere (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


_MALLOC_TRIM = _find_malloc_trim()


def force_gc() -> None:
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class MemoryLimiter:
    """``check()`` runs every ``check_interval`` and sets ``refusing``; ``consume`` only
    reads it, so a batch costs no measurement."""

    def __init__(self, cfg: Config, ctx: Context, signal: str,
                 read_memory: Callable[[], int] = rss_bytes,
                 total_memory: Callable[[], int] = total_memory_bytes,
                 collect: Callable[[], None] = force_gc,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.next: Consumer = ctx.next[signal]
        self.item = ITEMS[signal]
        self.read_memory = read_memory
        self.collect = collect
        self.clock = clock
        self.hard, self.soft = cfg.limits(total_memory)
        self.used = 0
        self.refusing = False
        self.metrics: Counter[str] = Counter()
        self._last_gc = -math.inf
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (f"<MemoryLimiter {self.ctx.id} used={self.used // MIB}MiB "
                f"soft={self.soft // MIB}MiB hard={self.hard // MIB}MiB "
                f"refusing={self.refusing}>")

    async def start(self) -> None:
        self.check()
        if self._task is None:
            self._task = asyncio.create_task(self._every_interval())

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(float(self.cfg.check_interval))
            try:
                self.check()
            except Exception:  # a failed reading must not stop the checks for good
                self.log.exception("memory_check_failed")

    def check(self) -> None:
        """Measure; collect garbage above the limits (not more often than allowed); refuse
        data from the soft limit up, and let it through again below."""
        used = self.read_memory()
        if used >= self.hard:
            used = self._collect(used, self.cfg.min_gc_interval_when_hard_limited, "hard")
        elif used >= self.soft:
            used = self._collect(used, self.cfg.min_gc_interval_when_soft_limited, "soft")
        self.used = used
        refusing = used >= self.soft
        if refusing and not self.refusing:
            self.log.warning("memory_limit_exceeded", used_mib=used // MIB,
                             soft_limit_mib=self.soft // MIB, hard_limit_mib=self.hard // MIB)
        elif self.refusing and not refusing:
            self.log.info("memory_usage_normal", used_mib=used // MIB,
                          soft_limit_mib=self.soft // MIB)
        self.refusing = refusing

    def _collect(self, used: int, min_interval: float, limit: str) -> int:
        now = self.clock()
        if now - self._last_gc < float(min_interval):
            return used
        self.collect()
        self._last_gc = self.clock()
        after = self.read_memory()
        self.log.info("memory_gc_forced", limit=limit, before_mib=used // MIB,
                      after_mib=after // MIB, took_ms=round((self._last_gc - now) * 1000, 1))
        return after

    async def consume(self, batch: Batch) -> None:
        if self.refusing:
            self.metrics[f"refused_{self.item}"] += len(batch)
            raise Retryable(
                f"{self.ctx.id}: memory usage {self.used // MIB} MiB is over the soft limit "
                f"({self.soft // MIB} MiB); data refused, retry later",
                retry_after=max(1.0, float(self.cfg.check_interval)))
        self.metrics[f"accepted_{self.item}"] += len(batch)
        await self.next.consume(batch)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def create(cfg: Config, ctx: Context) -> MemoryLimiter:
    (signal,) = ctx.next
    return MemoryLimiter(cfg, ctx, signal)


FACTORY = Factory(type="memory_limiter", kind="processor", config=Config, create=create,
                  signals=("traces", "profiles", "attributions"), records=False)

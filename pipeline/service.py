"""Run a configured pipeline until SIGTERM/SIGINT, then drain it.

Shutdown order is what makes "nothing acknowledged is lost" hold: receivers stop taking
requests and finish the ones in flight (those wait for durability), processors and the
correlator flush into exporters that are still running, and exporters flush last.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import signal
from typing import Any

import structlog

from pipeline.admin.server import AdminServer
from pipeline.component import Factories
from pipeline.config import Config
from pipeline.graph import Graph, build, create_extensions
from pipeline.looplag import LoopLag
from pipeline.receivers.http import ServerLimits


class Service:
    def __init__(self, cfg: Config, factories: Factories) -> None:
        """``factories``: the ones ``cfg`` was loaded with."""
        self.cfg = cfg
        # extensions (the Collector's): built here, started before and stopped after the
        # graph, handed to the receivers that name them (``auth: {authenticator: ID}``)
        self.extensions: dict[str, Any] = create_extensions(cfg, factories)
        self.graph: Graph = build(cfg, factories, authenticators=self.extensions)
        admin = cfg.service.admin
        self.loop_lag = LoopLag()
        self.admin = AdminServer(admin.endpoint, self.graph, admin.query_exporter,
                                 limits=ServerLimits.of(admin),
                                 loop_lag=self.loop_lag, tls=admin.tls,
                                 auth=self.extensions[admin.auth.authenticator]
                                 if admin.auth is not None else None) \
            if admin.enabled else None
        self.log = structlog.get_logger().bind(component="service")
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        """Extensions, then the graph, then the admin API; what started is stopped again,
        in reverse, when a later step fails (a port taken, a store unreachable)."""
        started: list[Any] = []
        try:
            for ext in self.extensions.values():
                await ext.start()
                started.append(ext)
            await self.graph.start()
            self.loop_lag.start()
            if self.admin is not None:
                try:
                    await self.admin.start()
                except BaseException:
                    await self.loop_lag.stop()
                    await self.graph.shutdown()
                    raise
        except BaseException:
            for ext in reversed(started):
                try:
                    await ext.shutdown()
                except Exception:
                    self.log.exception("extension_shutdown_failed")
            raise

    async def stop(self) -> None:
        if self.admin is not None:
            self.admin.stopping = True
            # a backfill job writes through the graph's exporter: it stops first (a job
            # resumes where it was when submitted again)
            await self.admin.stop_jobs()
        self.log.info("service_stopping")
        await self.loop_lag.stop()
        await self.graph.shutdown()
        if self.admin is not None:
            await self.admin.shutdown()
        for ext in self.extensions.values():
            await ext.shutdown()
        self.log.info("service_stopped")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        tune_malloc()
        await self.start()
        tune_gc()
        self.log.info("service_started", pipelines=sorted(self.cfg.service.pipelines))
        await self._stop.wait()
        await self.stop()


def tune_gc() -> None:
    """After start-up: what was built to start (modules, config, clients) is moved out of
    the collector's reach (``gc.freeze``), and the youngest generation is collected every
    100 000 allocations rather than 700. Records are built in bulk per request and most are
    not tracked (``gc=False`` structs), so the default threshold only rescanned long-lived
    state: ../shared/PERFORMANCE.md measured the full path at 33-38 us/span before, 21 after.
    ``SPANPROF_GC_TUNING=0`` keeps Python's defaults (to compare, or to rule it out).
    """
    if os.environ.get("SPANPROF_GC_TUNING", "1") == "0":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


# glibc's mallopt() parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MALLOC_TRIM_THRESHOLD = 256 << 20
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's adaptive threshold's ceiling on 64-bit


def tune_malloc() -> None:
    """Keep freed memory for reuse instead of returning it to the OS and faulting it back.

    Requests, their copies and the messages made of them are 0.1-16 MiB, over glibc's
    128 KiB ``mmap`` threshold: each one was a fresh ``mmap`` whose pages the kernel
    zeroed and faulted in one by one, then ``munmap``-ed (and ``MALLOC_TRIM_THRESHOLD_``,
    which the Makefile sets, also turns off glibc's adaptive mmap threshold). With
    blocks up to 32 MiB served from the heap and the heap trimmed only past 256 MiB free,
    the gateway (OTLP/gRPC -> Kafka) went from about 13 to 10.5 us of CPU per span
    (``../shared/bench/collector``; page faults were a quarter of its kernel time).
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment win;
    ``SPANPROF_GC_TUNING=0`` keeps the allocator's defaults as well. Not glibc (musl): no-op.
    """
    if os.environ.get("SPANPROF_GC_TUNING", "1") == "0":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)

"""processors/memory_limiter.py: limits, refusing over the soft limit, recovering below it,
forced collections over the hard limit, and the processor first in a real pipeline.

Memory readings, the total memory, the collector and the clock are injected, so the unit
tests decide what the process "uses".
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from structlog.testing import capture_logs

from pipeline.config import dec_hook, load_text
from pipeline.errors import ConfigError, Retryable
from pipeline.graph import build
from pipeline.records import Batch, Span, SpanBatch
from pipeline.registry import Context, default_factories
from processors.memory_limiter import MIB, Config, MemoryLimiter

FACTORIES = default_factories()
TRACE = bytes(range(1, 17))


class Sink:
    def __init__(self) -> None:
        self.batches: list[Batch] = []

    async def consume(self, batch: Batch) -> None:
        self.batches.append(batch)


class Memory:
    """What the limiter reads: set ``used`` (MiB); ``freed_by_gc`` is what a collection
    gives back."""

    def __init__(self, used: int) -> None:
        self.used = used
        self.freed_by_gc = 0
        self.collections = 0
        self.now = 0.0

    def read(self) -> int:
        return self.used * MIB

    def collect(self) -> None:
        self.collections += 1
        self.used -= self.freed_by_gc


def spans(n: int) -> SpanBatch:
    return SpanBatch([Span(TRACE, i.to_bytes(8, "big"), b"", "op", 1, "api", 0, 10)
                      for i in range(n)])


def limiter(mem: Memory, **cfg: Any) -> tuple[MemoryLimiter, Sink]:
    sink = Sink()
    c = msgspec.convert(cfg, Config, dec_hook=dec_hook)
    c.validate()
    ml = MemoryLimiter(c, Context("memory_limiter", ["traces"], next={"traces": sink}),
                       "traces", read_memory=mem.read, total_memory=lambda: 1000 * MIB,
                       collect=mem.collect, clock=lambda: mem.now)
    return ml, sink


class TestConfig:
    @pytest.mark.parametrize("cfg,expected", [
        ({"limit_mib": 100, "limit_percentage": 50},
         "limit_mib: set limit_mib or limit_percentage, not both"),
        ({"limit_mib": 100, "spike_limit_mib": 100},
         "spike_limit_mib: must be smaller than limit_mib"),
        ({"limit_percentage": 50, "spike_limit_percentage": 60},
         "spike_limit_percentage: must be smaller than limit_percentage (50)"),
        ({"spike_limit_percentage": 90},
         "spike_limit_percentage: must be smaller than limit_percentage (80)"),
        ({"limit_mib": 100, "spike_limit_percentage": 10},
         "spike_limit_percentage: goes with limit_percentage; with limit_mib, set "
         "spike_limit_mib"),
        ({"min_gc_interval_when_soft_limited": "1s", "min_gc_interval_when_hard_limited": "2s"},
         "min_gc_interval_when_soft_limited: must be at least min_gc_interval_when_hard_limited"),
    ])
    def test_invalid(self, cfg: dict[str, Any], expected: str) -> None:
        """The Collector's rules: one kind of limit, a spike smaller than the limit."""
        with pytest.raises(ConfigError) as err:
            msgspec.convert(cfg, Config, dec_hook=dec_hook).validate()
        assert expected in err.value.problems

    def test_ranges_and_key_paths_through_the_loader(self) -> None:
        """Types refuse what validate() need not check: percentages over 100, negative
        sizes, a zero check_interval; every problem is reported with its key path."""
        text = ("receivers: {otlp: }\nexporters: {debug: }\nprocessors:\n  memory_limiter:\n"
                "    check_interval: 0\n    limit_percentage: 101\n    spike_limit_mib: -1\n"
                "service: {pipelines: {traces: {receivers: [otlp], "
                "processors: [memory_limiter], exporters: [debug]}}}\n")
        with pytest.raises(ConfigError) as err:
            load_text(text, FACTORIES, env={})
        assert err.value.problems == [
            "processors.memory_limiter.check_interval: must be greater than 0 (e.g. 500ms, 10s)",
            "processors.memory_limiter.limit_percentage: expected int <= 100",
            "processors.memory_limiter.spike_limit_mib: expected int >= 0",
        ]

    @pytest.mark.parametrize("cfg,hard,soft", [
        ({"limit_mib": 100}, 100, 80),                      # spike: 20% of the limit
        ({"limit_mib": 100, "spike_limit_mib": 30}, 100, 70),
        ({"limit_percentage": 50}, 500, 400),               # of 1000 MiB
        ({"limit_percentage": 50, "spike_limit_percentage": 30}, 500, 200),
        ({}, 800, 640),                                     # neither: 80% of the memory
    ])
    def test_limits(self, cfg: dict[str, Any], hard: int, soft: int) -> None:
        """Hard limit, and soft = hard - spike, in MiB."""
        c = msgspec.convert(cfg, Config, dec_hook=dec_hook)
        c.validate()
        assert c.limits(lambda: 1000 * MIB) == (hard * MIB, soft * MIB)


class TestRefusing:
    async def test_over_the_soft_limit_refuses_then_recovers(self) -> None:
        """Under the soft limit data flows; over it the batch is refused with a retryable
        error carrying a delay and counted; back under, data flows again."""
        mem = Memory(used=50)
        ml, sink = limiter(mem, limit_mib=100, check_interval="2s")
        ml.check()
        await ml.consume(spans(2))
        mem.used = 85  # soft limit: 80
        ml.check()
        with pytest.raises(Retryable) as err:
            await ml.consume(spans(3))
        assert err.value.retry_after == 2.0
        assert "memory usage 85 MiB is over the soft limit (80 MiB)" in str(err.value)
        mem.used = 79
        ml.check()
        await ml.consume(spans(1))
        assert [len(b) for b in sink.batches] == [2, 1]
        assert ml.metrics == {"accepted_spans": 3, "refused_spans": 3}
        assert repr(ml) == ("<MemoryLimiter memory_limiter used=79MiB soft=80MiB hard=100MiB "
                            "refusing=False>")

    async def test_hard_limit_forces_a_collection(self) -> None:
        """Over the hard limit a collection is forced at every check (no minimum interval by
        default); if it frees enough, nothing is refused."""
        mem = Memory(used=120)
        mem.freed_by_gc = 60
        ml, sink = limiter(mem, limit_mib=100)
        ml.check()
        assert mem.collections == 1 and not ml.refusing
        await ml.consume(spans(1))
        assert len(sink.batches) == 1

    async def test_soft_limit_collections_are_spaced(self) -> None:
        """Between the limits, collections are at most one per
        min_gc_interval_when_soft_limited, and data stays refused while usage is high."""
        mem = Memory(used=90)
        ml, _ = limiter(mem, limit_mib=100, min_gc_interval_when_soft_limited="10s")
        ml.check()
        mem.now = 5.0
        ml.check()
        assert mem.collections == 1 and ml.refusing
        mem.now = 10.5
        ml.check()
        assert mem.collections == 2

    async def test_state_changes_are_logged(self) -> None:
        """One warning when refusing starts, one info when it stops, not one per check."""
        mem = Memory(used=90)
        with capture_logs() as logs:
            ml, _ = limiter(mem, limit_mib=100, min_gc_interval_when_soft_limited="1h")
            ml.check()  # collects once; later checks are within the interval
            mem.now = 1.0
            ml.check()
            mem.used = 10
            ml.check()
        events = [e["event"] for e in logs]
        assert events == ["memory_gc_forced", "memory_limit_exceeded", "memory_usage_normal"]
        exceeded = logs[1]
        assert (exceeded["used_mib"], exceeded["soft_limit_mib"], exceeded["hard_limit_mib"]) \
            == (90, 80, 100)

    async def test_checks_run_every_interval(self) -> None:
        """start() measures at once and then every check_interval; shutdown stops it and
        is idempotent."""
        mem = Memory(used=10)
        ml, _ = limiter(mem, limit_mib=100, check_interval="10ms")
        await ml.start()
        assert not ml.refusing
        mem.used = 95
        for _ in range(100):
            await asyncio.sleep(0.01)
            if ml.refusing:
                break
        assert ml.refusing
        await ml.shutdown()
        await ml.shutdown()


PIPELINE = """
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:0"}}
processors:
  memory_limiter:
    check_interval: 1s
    limit_mib: {limit}
  batch:
    timeout: 10ms
exporters:
  debug:
service:
  admin: {{enabled: false}}
  pipelines:
    traces:
      receivers: [otlp]
      processors: [memory_limiter, batch]
      exporters: [debug]
"""


class TestInAPipeline:
    @pytest.mark.parametrize("limit,accepted", [(1 << 20, True), (1, False)])
    async def test_first_in_the_traces_pipeline(self, limit: int, accepted: bool) -> None:
        """A real config with memory_limiter first: under the limit an OTLP export is
        accepted; over it (1 MiB: the process is bigger) the client gets UNAVAILABLE, the
        status it retries, and the refused spans are counted."""
        graph = build(load_text(PIPELINE.format(limit=limit), FACTORIES, env={}), FACTORIES)
        await graph.start()
        try:
            port = graph.component("receiver", "otlp").grpc.port
            limiter = graph.component("processor", "memory_limiter@traces")
            req = tps.ExportTraceServiceRequest()
            ss = req.resource_spans.add().scope_spans.add()
            ss.spans.add(trace_id=TRACE, span_id=b"\x01" * 8, name="op",
                         start_time_unix_nano=1, end_time_unix_nano=2)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = trace_service_pb2_grpc.TraceServiceStub(channel)
                if accepted:
                    await stub.Export(req, timeout=10)
                    assert limiter.metrics == {"accepted_spans": 1}
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Export(req, timeout=10)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "over the soft limit" in (err.value.details() or "")
                    assert limiter.metrics == {"refused_spans": 1}
        finally:
            await graph.shutdown()

"""Generated traces and profiles for the backfill tests: every way a sample reaches a
span (labelled with trace and span, timed so that it lands on a child; labelled with a
span id alone; unlabelled with a thread; unlabelled with time only; labelled for a span
never stored), across bucket boundaries, for more than one tenant."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.otlp.builder import encode_profiles
from pipeline.records import ProfileBatch, Sample, Span, SpanBatch, Stack
from tests.backfill import collector_files

MS = 1_000_000
# 2 s before a 10-minute boundary, two hours ago: within any store's ttl
_NOW = time.time_ns() - 7200 * 10**9
T0 = _NOW - _NOW % (600 * 10**9) + 598 * 10**9
HOST, PID = "host-1", 4242


class Data(NamedTuple):
    spans: list[Span]
    samples: list[Sample]
    stacks: dict[int, Stack]

    def batches(self, tenant: str = "default", size: int = 5_000
                ) -> list[SpanBatch | ProfileBatch]:
        out: list[SpanBatch | ProfileBatch] = [
            SpanBatch(self.spans[i:i + size], tenant=tenant)
            for i in range(0, len(self.spans), size)]
        out += [ProfileBatch(self.samples[i:i + size], self.stacks, tenant=tenant)
                for i in range(0, len(self.samples), size)]
        return out


def generate(traces: int, seed: int = 1, t0: int = T0, gap_ms: int = 7) -> Data:
    """``traces`` requests, one every ``gap_ms`` from ``t0`` (2 s before a 10-minute
    boundary, so that some cross it): api root (thread 1..4) with a child on the same
    thread and a db span; samples of each kind."""
    rnd = random.Random(seed)
    stacks = {i: Stack(i, [f"fn{i}", "handler", "main"], ["a.py"] * 3, [i, 2, 1])
              for i in range(1, 9)}
    spans: list[Span] = []
    samples: list[Sample] = []
    for n in range(traces):
        tid = rnd.randbytes(16)
        root, child, db = rnd.randbytes(8), rnd.randbytes(8), rnd.randbytes(8)
        start = t0 + n * gap_ms * MS
        thread = 1 + n % 4
        res = {"process.pid": str(PID), "host.name": HOST}
        spans += [
            Span(tid, root, b"", "GET /item", 2, "api", start, start + 100 * MS,
                 resource_attributes=res, attributes={"thread.id": str(thread)}),
            Span(tid, child, root, "render", 1, "api", start + 20 * MS, start + 60 * MS,
                 resource_attributes=res, attributes={"thread.id": str(thread)}),
            Span(tid, db, root, "SELECT", 3, "db", start + 60 * MS, start + 90 * MS)]

        def smp(trace: bytes, span: bytes, svc: str, at: int, cpu: int, start: int = start,
                **kw: object) -> Sample:
            return Sample(trace, span, svc, start + at * MS, rnd.randint(1, 8), "cpu", cpu, 1,
                          "cpu", "nanoseconds", pid=PID, host=HOST, **kw)  # type: ignore[arg-type]

        samples += [
            smp(tid, root, "api", 5, 10 * MS, thread_id=thread, timed=True),
            smp(tid, root, "api", 30, 10 * MS, thread_id=thread, timed=True),  # on render
            smp(b"", db, "db", 70, 10 * MS, timed=True),  # span id alone
            smp(b"", b"", "api", 40, 10 * MS, thread_id=thread, timed=True),  # thread
            smp(b"", b"", "db", 80, 10 * MS, timed=True)]  # time only: window
        if n % 50 == 0:  # a span never stored
            samples.append(smp(tid, rnd.randbytes(8), "api", 50, 10 * MS, timed=True))
    end = t0 + traces * gap_ms * MS + 5_000 * MS
    for i in range(max(1, traces // 40)):  # a service without spans: unattributed
        samples.append(Sample(b"", b"", "cron", end + i * 500 * MS, 1, "cpu", 10 * MS, 1, "cpu",
                              "nanoseconds", pid=PID, host=HOST, timed=True))
    return Data(spans, samples, stacks)


def traces_request(spans: list[Span]) -> ExportTraceServiceRequest:
    """Spans as the Collector's file exporter holds them: one ResourceSpans per service
    and resource."""
    req = ExportTraceServiceRequest()
    by: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
    for s in spans:
        key = (s.service, tuple(sorted(s.resource_attributes.items())))
        scope = by.get(key)
        if scope is None:
            rs = req.resource_spans.add()
            for k, v in (("service.name", s.service), *key[1]):
                rs.resource.attributes.add(key=k).value.string_value = v
            scope = by[key] = rs.scope_spans.add()
        sp = scope.spans.add(trace_id=s.trace_id, span_id=s.span_id,
                             parent_span_id=s.parent_span_id, name=s.name, kind=s.kind,
                             start_time_unix_nano=s.start_ns, end_time_unix_nano=s.end_ns)
        for k, v in s.attributes.items():
            sp.attributes.add(key=k).value.string_value = v
    return req


def write_files(data: Data, root: Path, per_message: int = 2_000) -> list[Path]:
    """The data as a Collector's ``file`` exporter leaves it: traces as JSON lines,
    profiles as length-prefixed protobuf, each message a zstd frame (its default)."""
    root.mkdir(parents=True, exist_ok=True)
    spans = [traces_request(data.spans[i:i + per_message])
             for i in range(0, len(data.spans), per_message)]
    profs = [encode_profiles(ProfileBatch(data.samples[i:i + per_message], data.stacks))
             for i in range(0, len(data.samples), per_message)]
    half = len(spans) // 2
    out = {"traces-1.json": collector_files.json_lines(spans[:half]),
           "traces-2.json": collector_files.json_lines(spans[half:]),
           "profiles.pb.zst": collector_files.legacy_zstd(profs)}
    for name, content in out.items():
        (root / name).write_bytes(content)
    return [root / n for n in out]

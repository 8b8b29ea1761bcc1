"""Records -> OTLP (for profiles that arrived as pprof and leave through Kafka)."""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec

from pipeline.otlp.builder import encode_profiles
from pipeline.otlp.profiles import decode_profiles
from pipeline.pyroscope.messages import PushRequest
from pipeline.pyroscope.pprof import decode_pprof
from pipeline.records import ProfileBatch, Sample, Stack

FIXTURES = Path(__file__).resolve().parents[2] / "testdata" / "pyroscope-python"


class TestEncodeProfiles:
    def test_round_trip_keeps_every_sample(self) -> None:
        """pprof from the real SDK -> records -> OTLP -> records: same links (span-only ones
        included), stacks (same stack ids), measures, values, times and services."""
        for name in ("req1.bin", "req2.bin", "req3.bin"):
            req = PushRequest.FromString(gzip.decompress((FIXTURES / name).read_bytes()))
            batch = decode_pprof(req.series[0].samples[0].raw_profile, "checkout")
            back = decode_profiles(encode_profiles(batch))
            assert back.rejected == 0, back.message

            def key(s: object) -> tuple[object, ...]:
                return (s.trace_id, s.span_id, s.stack_id, s.measure, s.value,  # type: ignore[attr-defined]
                        s.service, s.time_ns)  # type: ignore[attr-defined]
            assert sorted(map(key, back.batch.samples)) == sorted(map(key, batch.samples))
            assert back.batch.stacks == batch.stacks

    def test_round_trip_keeps_where_a_sample_was_taken(self) -> None:
        """Thread, span name, pid and host survive records -> OTLP -> records (Kafka)."""
        smp = Sample(b"\x01" * 16, b"\x02" * 8, "svc", 1_700_000_000_000_000_000, 5, "cpu",
                     10_000_000, 1, "cpu", "nanoseconds", thread_id=12, thread_name="main",
                     span_name="GET /", pid=4242, host="node-7")
        bare = msgspec.structs.replace(smp, thread_id=0, thread_name="", span_name="", pid=0,
                                       host="", value=20_000_000, count=2)
        stack = Stack(5, ["f"], ["a.py"], [1])
        back = decode_profiles(encode_profiles(ProfileBatch([smp, bare], {5: stack})))
        assert back.rejected == 0, back.message
        got = [msgspec.structs.replace(s, stack_id=5) for s in back.batch.samples]
        assert sorted(got, key=lambda s: s.value) == [smp, bare]

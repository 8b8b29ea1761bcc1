"""The Kafka exporter's message layout, loaded and checked the same way against the
in-memory broker (test_kafka_memory.py) and the real one (test_kafka.py): eight traces of
two spans in one request, their samples plus one unlinked sample in another; one message
per partition per request, keyed by one of its traces, on the partitioner's partition; a
trace's samples where its spans went; the unlinked samples unkeyed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.exporters.kafka import KafkaExporter
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from tests.pipeline.receivers.test_otlp_grpc import span_request

TIDS = [bytes([i + 1]) * 16 for i in range(8)]


async def send_load(ex: KafkaExporter) -> None:
    """The load, through a started exporter, which is then shut down."""
    req = tps.ExportTraceServiceRequest()
    for t in TIDS:
        req.MergeFrom(span_request([bytes([7]) * 8, bytes([8]) * 8], trace_id=t))
    await ex.consume(decode_traces(req).batch)
    b = ProfileBuilder()
    for t in TIDS:
        b.sample(["f"], 10, t, bytes([7]) * 8, service="svc")
    b.sample(["unlinked"], 10, service="svc")
    await ex.consume(decode_profiles(b.build()).batch)
    await ex.shutdown()


def message_counts(part: Callable[[bytes, int], int], partitions: int) -> tuple[int, int]:
    """(span messages, sample messages) the load makes: one per partition its traces hash
    to, and one more for the unlinked sample."""
    n_parts = len({part(t.hex().encode(), partitions) for t in TIDS})
    assert 1 < n_parts < len(TIDS)  # the load spreads, and shares partitions
    return n_parts, n_parts + 1


def check(part: Callable[[bytes, int], int], partitions: int, ex: KafkaExporter,
          spans: Sequence[Any], samples: Sequence[Any]) -> None:
    """Every check on the records (``key``, ``value``, ``partition``) the load left."""
    n_span_msgs, n_sample_msgs = message_counts(part, partitions)
    assert ex.metrics["sent_messages"] == n_span_msgs + n_sample_msgs
    assert len(spans) == n_span_msgs and len(samples) == n_sample_msgs
    span_part: dict[bytes, int] = {}
    for rec in spans:
        msg = tps.ExportTraceServiceRequest.FromString(rec.value)
        got = [bytes(s.trace_id).hex() for rs in msg.resource_spans for ss in rs.scope_spans
               for s in ss.spans]
        assert rec.key is not None and rec.key.decode() in got
        assert rec.partition == part(rec.key, partitions)
        assert {part(t.encode(), partitions) for t in got} == {rec.partition}
        assert len(got) == 2 * len(set(got))  # both spans of each trace
        span_part.update((bytes.fromhex(t), rec.partition) for t in got)
    assert len(span_part) == len(TIDS)
    total = 0
    for rec in samples:
        assert rec.value is not None
        d = decode_profiles(pps.ExportProfilesServiceRequest.FromString(rec.value))
        assert d.rejected == 0
        total += len(d.batch.samples)
        if rec.key is None:
            assert [s.trace_id for s in d.batch.samples] == [b""]
            continue
        assert rec.key.decode() in {s.trace_id.hex() for s in d.batch.samples}
        assert {span_part[s.trace_id] for s in d.batch.samples} == {rec.partition}
    assert total == len(TIDS) + 1

"""pipeline/native: the library takes the requests clients send (the OpenTelemetry SDK's
own encoding, events, links, every attribute kind) and hands back, for the Python path to
name, every request it is not sure of. tests/fuzz/test_native.py compares the two paths on
generated and mutated bytes."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import native
from pipeline.errors import InvalidData
from pipeline.kafka.buckets import Buckets
from pipeline.otlp.bounds import FRAME_FANOUT, FRAME_SLACK, TIME_MAX_NS
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import check_trace_bytes, decode_traces
from pipeline.otlp.wire import split_limit, split_trace_bytes


def test_the_library_is_built() -> None:
    """`make venv` builds it (cargo): without it the gateway still works, slower, and
    every other test here would pass by handing everything back."""
    assert native.AVAILABLE


def _sdk_request() -> bytes:
    """Spans made by the OpenTelemetry SDK, encoded by its OTLP exporters' encoder."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "checkout",
                                                        "host.cpus": 8, "ratio": 0.5}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for lib in ("web", "db"):
        tracer = provider.get_tracer(lib, "1.2.3")
        for i in range(20):
            with tracer.start_as_current_span(f"request {i}", kind=trace.SpanKind.SERVER,
                                              attributes={"http.route": "/pay/é",
                                                          "retries": i, "ok": i % 2 == 0,
                                                          "weights": [1.5, 2.5],
                                                          "tags": ["a", "b"]}) as root:
                root.add_event("cache miss", {"key": "u:1"})
                with tracer.start_as_current_span(
                        "query", links=[trace.Link(root.get_span_context(), {"why": "x"})]
                ) as child:
                    child.set_status(trace.Status(trace.StatusCode.ERROR, "timeout ⏱"))
                    try:
                        raise ValueError("boom")
                    except ValueError as err:
                        child.record_exception(err)
    provider.shutdown()
    return bytes(encode_spans(memory.get_finished_spans()).SerializeToString())


def test_sdk_requests_are_taken_and_split_as_in_python() -> None:
    data = _sdk_request()
    req = ExportTraceServiceRequest.FromString(data)
    py = decode_traces(req, records=False, wire=data)
    got = check_trace_bytes(data)
    assert got is not None, "the library handed back an SDK's request"
    assert (len(got.batch), got.rejected, got.batch.sources) == (len(py.batch), 0,
                                                                   [(data, [])])
    assert len(got.batch) == 80
    for name, parts in [(None, 0), ("sarama_compat", 12), ("murmur2", 5)]:
        split = native.traces_split(data, name, parts)
        want = split_trace_bytes(data, (), Buckets(name, parts) if name else None)  # type: ignore[arg-type]
        assert split is not None and list(split.items()) == list(want.items())
    assert len(native.traces_split(data) or {}) == 40  # a message per trace


def _one_span(**fields: object) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    span = dict(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="op",
                start_time_unix_nano=10**18, end_time_unix_nano=10**18 + 5)
    span.update(fields)
    req.resource_spans.add().scope_spans.add().spans.add(**span)
    return req


def _deep(levels: int) -> ExportTraceServiceRequest:
    req = _one_span()
    value = req.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="k").value
    for _ in range(levels):
        value = value.array_value.values.add()
    value.string_value = "leaf"
    return req


SPAN = b"\x0a\x10" + b"\x01" * 16 + b"\x12\x08" + b"\x02" * 8  # trace_id, span_id


def _wrap(span: bytes) -> bytes:
    """Span bytes in a request with one resource and one scope."""
    ss = b"\x12" + bytes([len(span)]) + span
    rs = b"\x12" + bytes([len(ss)]) + ss
    return b"\x0a" + bytes([len(rs)]) + rs


@pytest.mark.parametrize("data", [
    _one_span(trace_id=bytes(16)).SerializeToString(),           # refused: zero trace id
    _one_span(span_id=b"\x02" * 7).SerializeToString(),          # refused: short span id
    _one_span(parent_span_id=b"\x03" * 4).SerializeToString(),   # refused: parent length
    _one_span(end_time_unix_nano=1).SerializeToString(),         # refused: ends first
    _one_span(end_time_unix_nano=TIME_MAX_NS).SerializeToString(),  # refused: after 2106
    _deep(40).SerializeToString(),                               # deeper than the library goes
    _wrap(SPAN + b"\x0a\x10" + b"\x05" * 16),                    # trace_id twice
    _wrap(SPAN + b"\x2a\x02\xc3\x28"),                           # name: invalid UTF-8
    _wrap(SPAN + b"\xf8\x06\x01"),                               # field 111: unknown here
    _wrap(SPAN + b"\xaa\x00\x02ok"),                             # name's tag in two bytes
    _wrap(SPAN + b"\x2b\x2c"),                                   # a group
], ids=["zero-trace", "short-span", "parent", "ends-first", "after-2106", "deep",
        "trace-twice", "bad-utf8", "unknown-field", "long-tag", "group"])
def test_handed_back(data: bytes) -> None:
    """Refused spans (the Python path names them), and what the library is not sure of."""
    assert native.traces_check(_wrap(SPAN + b"\x2a\x02ok")) == 1  # the same, well made
    assert check_trace_bytes(data) is None
    assert native.traces_check(data) is None


def test_events_and_links_checked() -> None:
    ok = _one_span()
    span = ok.resource_spans[0].scope_spans[0].spans[0]
    span.events.add(time_unix_nano=10**18, name="e")
    span.links.add(trace_id=b"\x07" * 16, span_id=b"\x08" * 8)
    span.links.add()  # ids left out: allowed
    assert native.traces_check(ok.SerializeToString()) == 1
    span.events.add(time_unix_nano=TIME_MAX_NS)
    assert native.traces_check(ok.SerializeToString()) is None
    del span.events[-1]
    span.links.add(trace_id=b"\x07" * 15)
    assert native.traces_check(ok.SerializeToString()) is None
    assert decode_traces(ok, records=False).rejected == 1


def _profiles() -> ExportProfilesServiceRequest:
    b = ProfileBuilder()
    for i in range(40):
        b.sample([f"leaf{i % 7}", "mid", "main"], 10_000_000, bytes([i % 5 + 1]) * 16,
                 bytes([i + 1]) * 8, service="svc")
    return b.build()


def _lean(req: ExportProfilesServiceRequest, wire: bytes | None = None) -> tuple[object, ...]:
    d = decode_profiles(req, records=False, wire=wire)
    return len(d.batch), d.rejected, d.message


def test_profile_columns_and_dictionary_of_a_usual_request() -> None:
    req = _profiles()
    wire = req.SerializeToString()
    cols = native.profile_columns(wire)
    assert cols is not None and len(cols) == 1 and cols[0] is not None
    stacks, links, values = cols[0]
    samples = req.resource_profiles[0].scope_profiles[0].profiles[0].samples
    assert stacks.tolist() == [s.stack_index for s in samples]
    assert links.tolist() == [s.link_index for s in samples]
    assert values.tolist() == [s.values[0] for s in samples]
    summary = native.dictionary_summary(wire, FRAME_FANOUT)
    d = req.dictionary
    assert summary is not None and (summary.strings, summary.links, summary.stacks) == (
        len(d.string_table), len(d.link_table), len(d.stack_table))
    assert summary.depth == 3 and summary.excess == 0
    assert _lean(req, wire) == _lean(req) == (40, 0, "")


def test_unusual_samples_and_entries_are_left_to_python() -> None:
    req = _profiles()
    prof = req.resource_profiles[0].scope_profiles[0].profiles[0]
    prof.samples[3].timestamps_unix_nano.append(10**18)  # an unusual sample
    cols = native.profile_columns(req.SerializeToString())
    assert cols is not None and cols[0] is None
    req = _profiles()
    req.dictionary.link_table.add(trace_id=b"\x01" * 15, span_id=b"\x02" * 8)  # unused, bad
    wire = req.SerializeToString()
    assert native.dictionary_summary(wire, FRAME_FANOUT) is None
    assert _lean(req, wire) == _lean(req) == (40, 0, "")
    req.resource_profiles[0].scope_profiles[0].profiles[0].samples[0].link_index = \
        len(req.dictionary.link_table) - 1  # now used: refused, named the same
    wire = req.SerializeToString()
    assert _lean(req, wire) == _lean(req) and _lean(req)[1] == 1


def test_amplifying_stacks_are_not_verified() -> None:
    """Stacks whose frames outgrow their references (one location of many lines used again
    and again): the budget refuses them, with or without the native columns."""
    req = _profiles()
    d = req.dictionary
    loc = d.location_table[1]
    for _ in range(200):
        loc.lines.add(function_index=loc.lines[0].function_index, line=1)
    samples = req.resource_profiles[0].scope_profiles[0].profiles[0].samples
    for k in range(20):  # each 39 x 201 frames: under the depth limit, far over the fanout
        d.stack_table.add().location_indices.extend([1] * 39)
        samples[k].stack_index = len(d.stack_table) - 1
    wire = req.SerializeToString()
    summary = native.dictionary_summary(wire, FRAME_FANOUT)
    assert summary is not None and summary.excess > FRAME_SLACK
    assert summary.depth <= 8192
    got = _lean(req, wire)
    assert got == _lean(req) and got[1] == 1 and "per reference" in str(got[2])


def test_buffers_other_than_bytes_are_handed_back() -> None:
    """ctypes reads a bytes object in place; anything else goes the Python path."""
    data = _one_span().SerializeToString()
    assert native.traces_check(data) == 1
    for other in (bytearray(data), memoryview(data)):
        assert native.traces_check(other) is None  # type: ignore[arg-type]
        assert native.traces_split(other) is None  # type: ignore[arg-type]
        assert native.profile_columns(other) is None  # type: ignore[arg-type]


def test_a_resource_repeated_in_thousands_of_messages_is_refused_not_allocated() -> None:
    """A message per trace (partition count unknown) repeats the resource: a 100 KB
    resource attribute and 2 000 traces would be 200 MB of messages. Both splits stop at
    the limit, and the exporter refuses the request for good (InvalidData)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="big").value.string_value = "x" * 100_000
    ss = rs.scope_spans.add()
    for i in range(2000):
        ss.spans.add(trace_id=(i + 1).to_bytes(16, "big"), span_id=b"\x02" * 8, name="op")
    data = req.SerializeToString()
    limit = split_limit(len(data))
    assert native.traces_check(data) == 2000
    assert native.traces_split(data, None, 0, limit) == native.TOO_LARGE
    with pytest.raises(InvalidData, match="resource and scope fields"):
        split_trace_bytes(data)
    parts = native.traces_split(data, "sarama_compat", 6, limit)  # per partition: fine
    assert isinstance(parts, dict) and len(parts) == 6

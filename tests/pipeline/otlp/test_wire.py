"""pipeline/otlp/wire.py: splitting trace requests on their bytes gives what splitting the
parsed request gives (``split.split_traces``), message for message."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pipeline.kafka.buckets import Buckets
from pipeline.native import traces_split
from pipeline.otlp.split import split_traces
from pipeline.otlp.wire import _header, split_trace_bytes

TRACES = [bytes([i + 1]) * 16 for i in range(12)]


def _request(shape: list[list[list[int]]]) -> ExportTraceServiceRequest:
    """resources -> scopes -> spans, each span naming its trace by index."""
    req = ExportTraceServiceRequest()
    n = 0
    for r, scopes in enumerate(shape):
        rs = req.resource_spans.add(schema_url=f"r{r}")
        rs.resource.attributes.add(key="service.name").value.string_value = f"svc{r}"
        for s, spans in enumerate(scopes):
            ss = rs.scope_spans.add(schema_url=f"s{s}")
            ss.scope.name = f"scope{s}"
            for t in spans:
                n += 1
                sp = ss.spans.add(trace_id=TRACES[t], span_id=n.to_bytes(8, "big"),
                                  name=f"op{n}" * (n % 40), start_time_unix_nano=n)
                sp.attributes.add(key="k").value.int_value = n
    return req


def _bucket(key: str) -> int:
    return int(key[:2], 16) % 3


shapes = st.lists(st.lists(st.lists(st.integers(0, 11), max_size=14), min_size=1, max_size=3),
                  min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, drop=st.sets(st.integers(0, 40)),
       bucket=st.sampled_from([None, _bucket, Buckets("sarama_compat", 3),
                               Buckets("murmur2", 2)]))
def test_same_messages_as_the_parsed_split(shape: list[list[list[int]]], drop: set[int],
                                           bucket: Callable[[str], int] | None) -> None:
    """Per trace, or per partition (a function of the hex key, or the exporter's
    ``Buckets``, which hashes the request's trace ids together)."""
    req = _request(shape)
    paths = [(ri, si, pi) for ri, rs in enumerate(req.resource_spans)
             for si, ss in enumerate(rs.scope_spans) for pi in range(len(ss.spans))]
    rejected = [p for i, p in enumerate(paths) if i in drop]
    want = split_traces(req, rejected, bucket_of=bucket)
    got = split_trace_bytes(req.SerializeToString(), rejected, bucket)
    assert got.keys() == want.keys()
    for key, data in got.items():
        assert ExportTraceServiceRequest.FromString(data) == want[key]


def test_a_trace_id_after_other_fields_is_found() -> None:
    """Writers may put fields in any order: the trace id is looked for in the span."""
    span = Span(name="late", span_id=b"\x01" * 8, trace_id=TRACES[2])
    wire = span.SerializeToString()
    head = Span(trace_id=TRACES[2]).SerializeToString()
    reordered = wire[len(head):] + head  # everything else first, then the trace id
    assert Span.FromString(reordered) == span
    field = _header(2, len(reordered)) + reordered
    scope = _header(2, len(field)) + field
    data = _header(1, len(scope)) + scope
    got = split_trace_bytes(data)
    assert list(got) == [TRACES[2].hex()]
    assert ExportTraceServiceRequest.FromString(got[TRACES[2].hex()]) == \
        ExportTraceServiceRequest.FromString(data)


def test_scalars_under_message_numbers_are_not_cut_as_messages() -> None:
    """A varint under a message's number (upb: an unknown field) is neither a resource,
    a scope nor a span's trace id."""
    req = _request([[[0, 1]]])
    data = req.SerializeToString() + b"\x08\x07"
    rs = req.resource_spans[0].SerializeToString() + b"\x10\x05"  # ResourceSpans: scope_spans
    data2 = _header(1, len(rs)) + rs
    ss = req.resource_spans[0].scope_spans[0].SerializeToString() + b"\x08\x05"  # scope
    res = req.resource_spans[0].resource.SerializeToString()
    rs3 = _header(1, len(res)) + res + _header(2, len(ss)) + ss
    data3 = _header(1, len(rs3)) + rs3
    for d in (data, data2, data3):
        parsed = ExportTraceServiceRequest.FromString(d)
        want = split_traces(parsed)
        got = split_trace_bytes(d)
        assert got.keys() == want.keys()
        for key, msg in got.items():
            assert ExportTraceServiceRequest.FromString(msg) == want[key]


def test_a_trace_id_given_twice_is_the_last_as_a_parser_reads_it() -> None:
    """A span whose trace id field comes twice is, to upb (the receiver's checks and the
    consumer's parse), in the last one's trace: the message must be keyed by that trace,
    or the span reaches another partition than its trace's samples. Whether the receiver's
    parse gives the trace ids or the span's fields are walked for them."""
    span = Span(name="twice", span_id=b"\x01" * 8, trace_id=TRACES[2])
    wire = Span(trace_id=TRACES[1]).SerializeToString() + span.SerializeToString()
    assert Span.FromString(wire).trace_id == TRACES[2]
    field = _header(2, len(wire)) + wire
    scope = _header(2, len(field)) + field
    data = _header(1, len(scope)) + scope
    assert traces_split(data) is None  # the native split leaves a repeated field to Python
    for ids in (None, [TRACES[2]]):
        got = split_trace_bytes(data, trace_ids=ids)
        assert list(got) == [TRACES[2].hex()]
        assert ExportTraceServiceRequest.FromString(got[TRACES[2].hex()]) == \
            ExportTraceServiceRequest.FromString(data)
    # trace ids that are not the request's spans (one too few): each span walked instead
    assert split_trace_bytes(data, trace_ids=[]) == split_trace_bytes(data)


def test_a_span_whose_tag_is_longer_than_it_need_be_is_kept() -> None:
    """A span field whose tag is a two-byte varint (0x92 0x00: field 2, length-delimited)
    is a span to upb, so the receiver accepted it: the split carries it (it had dropped
    it, an acknowledged span lost), under its own trace."""
    spans = [Span(name=f"s{i}", span_id=bytes([i + 1]) * 8, trace_id=TRACES[i]).SerializeToString()
             for i in range(3)]
    field = (_header(2, len(spans[0])) + spans[0] + bytes([0x92, 0x00, len(spans[1])])
             + spans[1] + _header(2, len(spans[2])) + spans[2])
    scope = _header(2, len(field)) + field
    data = _header(1, len(scope)) + scope
    parsed = ExportTraceServiceRequest.FromString(data)
    assert len(parsed.resource_spans[0].scope_spans[0].spans) == 3
    ids = [s.trace_id for s in parsed.resource_spans[0].scope_spans[0].spans]
    for parsed_ids in (None, ids):
        got = split_trace_bytes(data, trace_ids=parsed_ids)
        assert sorted(got) == sorted(t.hex() for t in TRACES[:3])
        for i in range(3):
            (s,) = ExportTraceServiceRequest.FromString(
                got[TRACES[i].hex()]).resource_spans[0].scope_spans[0].spans
            assert s == parsed.resource_spans[0].scope_spans[0].spans[i]

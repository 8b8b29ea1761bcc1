"""pipeline/otlp/traces.py: ExportTraceServiceRequest -> ``SpanBatch``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1 import trace_pb2

from pipeline.otlp.traces import decode_traces

TRACE = bytes(range(1, 17))
PARENT = bytes(range(11, 19))


def span_id(n: int) -> bytes:
    return n.to_bytes(8, "big")


def kv(key: str, **value: Any) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))


def new_span(n: int, **fields: Any) -> trace_pb2.Span:
    defaults: dict[str, Any] = dict(trace_id=TRACE, span_id=span_id(n), name=f"op{n}",
                                    start_time_unix_nano=1_000 * n,
                                    end_time_unix_nano=1_000 * n + 500)
    defaults.update(fields)
    return trace_pb2.Span(**defaults)


def request(layout: list[list[int]], service: str | None = "svc") -> ExportTraceServiceRequest:
    """A request of len(layout) resources; layout[i][j] valid spans in scope j of resource i.

    Span ids count up from 1 in request order, so that span n is ``span_id(n)``.
    """
    req = ExportTraceServiceRequest()
    n = 0
    for ri, scopes in enumerate(layout):
        rs = req.resource_spans.add()
        if service is not None:
            rs.resource.attributes.append(kv("service.name", string_value=f"{service}{ri}"))
        for sj, count in enumerate(scopes):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = f"scope{sj}", "1.0"
            for _ in range(count):
                n += 1
                ss.spans.append(new_span(n))
    return req


class TestDecodeValid:
    def test_span_fields(self) -> None:
        """A valid span keeps its ids, name, kind, times, status, trace_state and scope."""
        req = request([[0]])
        s = req.resource_spans[0].scope_spans[0].spans.add()
        s.CopyFrom(new_span(1, parent_span_id=PARENT, kind=trace_pb2.Span.SPAN_KIND_SERVER,
                            trace_state="k=v"))
        s.status.code = trace_pb2.Status.STATUS_CODE_ERROR
        s.status.message = "boom"
        dec = decode_traces(req)
        assert (dec.rejected, dec.message) == (0, "")
        (span,) = dec.batch.spans
        assert (span.trace_id, span.span_id, span.parent_span_id) == (TRACE, span_id(1), PARENT)
        assert (span.name, span.kind, span.start_ns, span.end_ns) == ("op1", 2, 1_000, 1_500)
        assert (span.status_code, span.status_message, span.trace_state) == (2, "boom", "k=v")
        assert (span.scope_name, span.scope_version) == ("scope0", "1.0")
        assert span.duration_ns == 500

    def test_attributes_as_strings(self) -> None:
        """int, bool, double, string attributes are strings; arrays and maps are JSON."""
        req = request([[1]])
        req.resource_spans[0].scope_spans[0].spans[0].attributes.extend([
            kv("http.status_code", int_value=503),
            kv("error", bool_value=True),
            kv("cache.hit", bool_value=False),
            kv("ratio", double_value=0.25),
            kv("route", string_value="/api"),
            kv("tags", array_value=ArrayValue(values=[
                AnyValue(int_value=1), AnyValue(string_value="two"), AnyValue(bool_value=True),
                AnyValue(double_value=1.5)])),
            kv("nested", kvlist_value=KeyValueList(values=[kv("a", int_value=1)])),
            KeyValue(key="empty"),
        ])
        (span,) = decode_traces(req).batch.spans
        assert span.attributes == {
            "http.status_code": "503",
            "error": "true",
            "cache.hit": "false",
            "ratio": "0.25",
            "route": "/api",
            "tags": '[1,"two",true,1.5]',
            "nested": '{"a":1}',
            "empty": "",
        }
        assert json.loads(span.attributes["tags"]) == [1, "two", True, 1.5]

    @pytest.mark.parametrize(("value", "text"), [
        (3.0, "3"), (-0.5, "-0.5"), (1e20, "100000000000000000000"), (1e21, "1e+21"),
        (1e-7, "1e-7"),
    ])
    def test_double_formatted_as_collector(self, value: float, text: str) -> None:
        """A double attribute reads as the Collector's ``AsString`` writes it (ES6 style).

        spanprof fills the same ``otel_traces`` columns as the Collector's ClickHouse
        exporter, so ``SpanAttributes['x'] = '3'`` must match spans from either writer.
        """
        req = request([[1]])
        req.resource_spans[0].scope_spans[0].spans[0].attributes.append(
            kv("x", double_value=value))
        (span,) = decode_traces(req).batch.spans
        assert span.attributes["x"] == text

    def test_double_in_array_formatted_as_collector(self) -> None:
        """Doubles inside an array are JSON numbers as Go writes them: 2.0 is ``2``."""
        req = request([[1]])
        req.resource_spans[0].scope_spans[0].spans[0].attributes.append(
            kv("xs", array_value=ArrayValue(values=[AnyValue(double_value=2.0)])))
        (span,) = decode_traces(req).batch.spans
        assert span.attributes["xs"] == "[2]"

    def test_bytes_base64_as_collector(self) -> None:
        """A bytes attribute is standard base64, as the Collector's ``AsString`` writes it."""
        req = request([[1]])
        req.resource_spans[0].scope_spans[0].spans[0].attributes.extend([
            kv("blob", bytes_value=b"\x01\xab"),
            kv("blobs", array_value=ArrayValue(values=[AnyValue(bytes_value=b"\x01\xab")])),
        ])
        (span,) = decode_traces(req).batch.spans
        assert (span.attributes["blob"], span.attributes["blobs"]) == ("Aas=", '["Aas="]')

    def test_service_and_resource_attributes_from_resource(self) -> None:
        """Each span takes service.name and the resource attributes of its own resource."""
        req = request([[1], [2]])
        req.resource_spans[1].resource.attributes.append(kv("host.name", string_value="h1"))
        spans = decode_traces(req).batch.spans
        assert [(s.span_id, s.service) for s in spans] == \
            [(span_id(1), "svc0"), (span_id(2), "svc1"), (span_id(3), "svc1")]
        assert spans[0].resource_attributes == {"service.name": "svc0"}
        assert spans[2].resource_attributes == {"service.name": "svc1", "host.name": "h1"}

    def test_unknown_service_when_absent(self) -> None:
        """A resource without service.name gives ``unknown_service``."""
        (span,) = decode_traces(request([[1]], service=None)).batch.spans
        assert span.service == "unknown_service"

    def test_root_span_and_zero_duration_accepted(self) -> None:
        """An empty parent_span_id (a root) and end == start are valid."""
        req = request([[0]])
        req.resource_spans[0].scope_spans[0].spans.append(
            new_span(1, start_time_unix_nano=7, end_time_unix_nano=7))
        dec = decode_traces(req)
        assert dec.rejected == 0
        assert (dec.batch.spans[0].parent_span_id, dec.batch.spans[0].duration_ns) == (b"", 0)

    def test_events_and_links(self) -> None:
        """Span events and links are carried with their attributes as strings."""
        req = request([[0]])
        s = new_span(1)
        s.events.add(time_unix_nano=1_200, name="exception",
                     attributes=[kv("exception.type", string_value="ValueError")])
        s.links.add(trace_id=TRACE[::-1], span_id=PARENT, trace_state="a=b",
                    attributes=[kv("n", int_value=3)])
        req.resource_spans[0].scope_spans[0].spans.append(s)
        (span,) = decode_traces(req).batch.spans
        (event,) = span.events
        assert (event.time_ns, event.name, event.attributes) == \
            (1_200, "exception", {"exception.type": "ValueError"})
        (link,) = span.links
        assert (link.trace_id, link.span_id, link.trace_state, link.attributes) == \
            (TRACE[::-1], PARENT, "a=b", {"n": "3"})

    def test_empty_request(self) -> None:
        """An empty request decodes to an empty batch."""
        dec = decode_traces(ExportTraceServiceRequest())
        assert (dec.batch.spans, dec.rejected, dec.message) == ([], 0, "")


BAD_SPANS: dict[str, tuple[dict[str, Any], str]] = {
    "trace_id_15_bytes": ({"trace_id": TRACE[:15]}, "trace_id must be 16 bytes"),
    "trace_id_zero": ({"trace_id": bytes(16)}, "trace_id must be 16 bytes and not all zero"),
    "trace_id_empty": ({"trace_id": b""}, "trace_id must be 16 bytes"),
    "span_id_7_bytes": ({"span_id": span_id(99)[:7]}, "span_id must be 8 bytes"),
    "span_id_zero": ({"span_id": bytes(8)}, "span_id must be 8 bytes and not all zero"),
    "parent_5_bytes": ({"parent_span_id": PARENT[:5]},
                       "parent_span_id must be empty or 8 bytes, got 5 bytes"),
    "end_before_start": ({"start_time_unix_nano": 2_000, "end_time_unix_nano": 1_999},
                         "end_time_unix_nano is before start_time_unix_nano"),
}


class TestRejection:
    """A malformed span is rejected alone; the spans around it, in every scope, pass.

    The request has 2 resources x 2 scopes x 3 spans (span ids 1..12); the bad span is
    inserted at resource_spans[1].scope_spans[1].spans[1].
    """

    PATH = "resource_spans[1].scope_spans[1].spans[1]: "

    @pytest.mark.parametrize(("fields", "problem"), list(BAD_SPANS.values()),
                             ids=list(BAD_SPANS))
    def test_bad_span_rejected_alone(self, fields: dict[str, Any], problem: str) -> None:
        """The bad span is counted, named by its path, and the twelve others are accepted."""
        req = request([[3, 3], [3, 3]])
        spans = req.resource_spans[1].scope_spans[1].spans
        spans.insert(1, new_span(99, **fields))
        dec = decode_traces(req)
        assert dec.rejected == 1
        assert dec.message.startswith(self.PATH + problem), dec.message
        assert [s.span_id for s in dec.batch.spans] == [span_id(n) for n in range(1, 13)]

    def test_each_bad_span_counted(self) -> None:
        """All the bad spans of one request are counted; three are named, then '(and N more)'."""
        req = request([[1]])
        spans = req.resource_spans[0].scope_spans[0].spans
        for fields, _ in BAD_SPANS.values():
            spans.append(new_span(99, **fields))
        spans.append(new_span(2))
        dec = decode_traces(req)
        assert dec.rejected == len(BAD_SPANS)
        problems = [p for _, p in BAD_SPANS.values()]
        parts = dec.message.split("; ")
        assert len(parts) == 3
        for k, part in enumerate(parts):
            assert part.startswith(f"resource_spans[0].scope_spans[0].spans[{k + 1}]: "
                                   f"{problems[k]}"), part
        assert parts[-1].endswith(f" (and {len(BAD_SPANS) - 3} more)")
        assert [s.span_id for s in dec.batch.spans] == [span_id(1), span_id(2)]

    def test_parent_of_8_bytes_accepted(self) -> None:
        """An 8-byte parent_span_id passes the length check and is kept as sent."""
        req = request([[0]])
        req.resource_spans[0].scope_spans[0].spans.append(new_span(1, parent_span_id=PARENT))
        dec = decode_traces(req)
        assert dec.rejected == 0
        assert dec.batch.spans[0].parent_span_id == PARENT


class TestWithoutRecords:
    """A gateway validates without building records (``records=False``): the same spans
    are refused with the same message, and the batch counts the others."""

    @pytest.mark.parametrize(("fields", "problem"), list(BAD_SPANS.values()),
                             ids=list(BAD_SPANS))
    def test_same_verdict_as_with_records(self, fields: dict[str, Any], problem: str) -> None:
        req = request([[3, 3], [3, 3]])
        req.resource_spans[1].scope_spans[1].spans.insert(1, new_span(99, **fields))
        req.resource_spans[0].scope_spans[0].spans.append(new_span(98, **fields))
        full, lean = decode_traces(req), decode_traces(req, records=False)
        assert (lean.rejected, lean.message) == (full.rejected, full.message) == (
            2, lean.message)
        assert lean.batch.spans == [] and len(lean.batch) == len(full.batch) == 12
        assert lean.batch.sources[0][1] == full.batch.sources[0][1]  # the refused paths

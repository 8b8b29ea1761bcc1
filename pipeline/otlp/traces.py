"""ExportTraceServiceRequest -> ``SpanBatch``, rejecting spans that could not be stored.

A span is refused (counted in ``partial_success``) when its ids have the wrong length, it
ends before it starts, or any of its times (start, end, events) is outside the storable
range (``pipeline/otlp/bounds.py``): ``Timestamp`` also becomes ``DateTime`` columns, which
end in 2106. Strings need no check here: protobuf refuses invalid UTF-8 when it parses
(and ``pipeline/otlp/jsonwire.py`` refuses lone surrogates in JSON).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline import native
from pipeline.otlp.bounds import TIME_MAX_NS, TIME_RANGE
from pipeline.otlp.common import Rejections, attributes_dict, is_zero, service_name
from pipeline.records import Span, SpanBatch, SpanEvent, SpanLink

ZERO_TRACE, ZERO_SPAN = bytes(16), bytes(8)


class Decoded(NamedTuple):
    batch: SpanBatch
    rejected: int
    message: str


def decode_traces(req: ExportTraceServiceRequest, records: bool = True,
                  wire: bytes | None = None) -> Decoded:
    """The spans of ``req`` that can be stored, and what was refused; without
    ``records`` the same checks, but the batch holds only the request and a count (a
    gateway passes the request on as it came, less what was refused): its bytes as
    received (``wire``) when given, which the kafka exporter splits without parsing."""
    if not records:
        return _validate(req, wire)
    spans: list[Span] = []
    append = spans.append
    refused = Rejections()
    for ri, rs in enumerate(req.resource_spans):
        res_attrs = attributes_dict(rs.resource.attributes)
        service = service_name(res_attrs)
        for si, ss in enumerate(rs.scope_spans):
            scope = ss.scope
            scope_name, scope_version = scope.name, scope.version
            for pi, s in enumerate(ss.spans):
                # each field read once (a upb read builds its value anew); the common span
                # is checked in one test, as in _validate, the rest names its problem
                tid, sid, parent = s.trace_id, s.span_id, s.parent_span_id
                start, end = s.start_time_unix_nano, s.end_time_unix_nano
                events, links = s.events, s.links
                if not (len(tid) == 16 and len(sid) == 8 and tid != ZERO_TRACE
                        and sid != ZERO_SPAN and len(parent) in (0, 8)
                        and start <= end < TIME_MAX_NS and not events and not links):
                    problem = _check_ids(tid, sid, parent)
                    if problem is None:
                        problem = _check_times(s)
                    if problem is None and links:
                        problem = _check_links(links)
                    if problem is not None:
                        refused.add((ri, si, pi),
                                    f"resource_spans[{ri}].scope_spans[{si}].spans[{pi}]",
                                    problem)
                        continue
                status = s.status
                attrs = s.attributes
                # positional: Span's field order (records.py)
                append(Span(
                    tid, sid, b"" if parent == ZERO_SPAN else parent, s.name, s.kind, service,
                    start, end, status.code, status.message, s.trace_state, scope_name,
                    scope_version, res_attrs, attributes_dict(attrs) if attrs else {},
                    [SpanEvent(e.time_unix_nano, e.name, attributes_dict(e.attributes))
                     for e in events] if events else [],
                    [SpanLink(lk.trace_id, lk.span_id, lk.trace_state,
                              attributes_dict(lk.attributes)) for lk in links] if links else []))
    return Decoded(SpanBatch(spans, sources=[(req, refused.paths)]), refused.count,
                   refused.message)


class WireSpans(NamedTuple):
    """A request's bytes as received, with every span's trace id as the parse read it, in
    order: the Kafka exporter keys each span by it (a span may give the field twice; the
    last is the one a parser keeps) without walking the span's fields again."""

    data: bytes
    trace_ids: list[bytes]


def check_trace_bytes(data: bytes) -> Decoded | None:
    """A gateway's check of a request on its bytes, in the native library (one walk, no
    parse): what ``decode_traces(parsed, records=False, wire=data)`` gives for a request
    whose spans all pass; None for any other (malformed, a span refused, a field the
    library does not know, or no library), which the caller parses and decodes here."""
    n = native.traces_check(data)
    if n is None:
        return None
    return Decoded(SpanBatch([], sources=[(data, [])], items=n), 0, "")


def _validate(req: ExportTraceServiceRequest, wire: bytes | None) -> Decoded:
    ok = 0
    refused = Rejections()
    tids: list[bytes] = []
    for ri, rs in enumerate(req.resource_spans):
        for si, ss in enumerate(rs.scope_spans):
            for pi, s in enumerate(ss.spans):
                tid, sid = s.trace_id, s.span_id
                tids.append(tid)
                if (len(tid) == 16 and len(sid) == 8 and tid != ZERO_TRACE
                        and sid != ZERO_SPAN and len(s.parent_span_id) in (0, 8)
                        and s.start_time_unix_nano <= s.end_time_unix_nano < TIME_MAX_NS
                        and not s.events and not s.links):
                    ok += 1  # the common span, in one test; the checks below name problems
                    continue
                problem = _check_ids(tid, sid, s.parent_span_id)
                if problem is None:
                    problem = _check_times(s)
                if problem is None and s.links:
                    problem = _check_links(s.links)
                if problem is None:
                    ok += 1
                else:
                    refused.add((ri, si, pi),
                                f"resource_spans[{ri}].scope_spans[{si}].spans[{pi}]", problem)
    source = req if wire is None else WireSpans(wire, tids)
    return Decoded(SpanBatch([], sources=[(source, refused.paths)], items=ok), refused.count,
                   refused.message)


def _check_ids(trace_id: bytes, span_id: bytes, parent: bytes) -> str | None:
    if len(trace_id) != 16 or is_zero(trace_id):
        return f"trace_id must be 16 bytes and not all zero, got {len(trace_id)} bytes"
    if len(span_id) != 8 or is_zero(span_id):
        return f"span_id must be 8 bytes and not all zero, got {len(span_id)} bytes"
    if parent and len(parent) != 8:
        return f"parent_span_id must be empty or 8 bytes, got {len(parent)} bytes"
    return None


def _check_times(s: Any) -> str | None:
    """One chained comparison for the common span; events only when there are some."""
    start, end = s.start_time_unix_nano, s.end_time_unix_nano
    if start <= end < TIME_MAX_NS:  # unsigned on the wire: never below 1970
        if s.events and max(e.time_unix_nano for e in s.events) >= TIME_MAX_NS:
            return f"an events[].time_unix_nano is outside the storable time range {TIME_RANGE}"
        return None
    if end < start:
        return "end_time_unix_nano is before start_time_unix_nano"
    return f"end_time_unix_nano {end} is outside the storable time range {TIME_RANGE}"


def _check_links(links: Any) -> str | None:
    for i, lk in enumerate(links):
        if len(lk.trace_id) not in (0, 16) or len(lk.span_id) not in (0, 8):
            return (f"links[{i}] needs a 16-byte trace_id and an 8-byte span_id (or none), "
                    f"got {len(lk.trace_id)} and {len(lk.span_id)} bytes")
    return None

"""ExportTraceServiceRequest -> ``SpanBatch``, rejecting spans with malformed ids."""

from __future__ import annotations

from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.otlp.common import Rejections, attributes_dict, is_zero, service_name
from pipeline.records import Span, SpanBatch, SpanEvent, SpanLink


class Decoded(NamedTuple):
    batch: SpanBatch
    rejected: int
    message: str


def decode_traces(req: ExportTraceServiceRequest) -> Decoded:
    spans: list[Span] = []
    refused = Rejections()
    for ri, rs in enumerate(req.resource_spans):
        res_attrs = attributes_dict(rs.resource.attributes)
        service = service_name(res_attrs)
        for si, ss in enumerate(rs.scope_spans):
            scope_name, scope_version = ss.scope.name, ss.scope.version
            for pi, s in enumerate(ss.spans):
                problem = _check_ids(s.trace_id, s.span_id, s.parent_span_id)
                if problem is None and s.end_time_unix_nano < s.start_time_unix_nano:
                    problem = "end_time_unix_nano is before start_time_unix_nano"
                if problem is not None:
                    refused.add((ri, si, pi),
                                f"resource_spans[{ri}].scope_spans[{si}].spans[{pi}]", problem)
                    continue
                spans.append(Span(
                    trace_id=bytes(s.trace_id),
                    span_id=bytes(s.span_id),
                    parent_span_id=b"" if is_zero(s.parent_span_id) else bytes(s.parent_span_id),
                    name=s.name,
                    kind=int(s.kind),
                    service=service,
                    start_ns=int(s.start_time_unix_nano),
                    end_ns=int(s.end_time_unix_nano),
                    status_code=int(s.status.code),
                    status_message=s.status.message,
                    trace_state=s.trace_state,
                    scope_name=scope_name,
                    scope_version=scope_version,
                    resource_attributes=res_attrs,
                    attributes=attributes_dict(s.attributes),
                    events=[SpanEvent(int(e.time_unix_nano), e.name, attributes_dict(e.attributes))
                            for e in s.events],
                    links=[SpanLink(bytes(lk.trace_id), bytes(lk.span_id), lk.trace_state,
                                    attributes_dict(lk.attributes)) for lk in s.links],
                ))
    return Decoded(SpanBatch(spans, sources=[(req, refused.paths)]), refused.count,
                   refused.message)


def _check_ids(trace_id: bytes, span_id: bytes, parent: bytes) -> str | None:
    if len(trace_id) != 16 or is_zero(trace_id):
        return f"trace_id must be 16 bytes and not all zero, got {len(trace_id)} bytes"
    if len(span_id) != 8 or is_zero(span_id):
        return f"span_id must be 8 bytes and not all zero, got {len(span_id)} bytes"
    if parent and len(parent) != 8:
        return f"parent_span_id must be empty or 8 bytes, got {len(parent)} bytes"
    return None

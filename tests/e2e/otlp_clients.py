"""Clients for the end-to-end tests: the OpenTelemetry SDK's real OTLP/gRPC span exporter,
and raw gRPC stubs for profiles (no SDK exports profiles yet) and for load."""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def sdk_tracer(target: str, service: str, credentials: grpc.ChannelCredentials | None = None,
               headers: dict[str, str] | None = None) -> tuple[TracerProvider, Any]:
    """A tracer whose spans leave only on ``force_flush()``: the test decides when.
    Plain text unless ``credentials`` (TLS) are given; ``headers``: e.g. a bearer token."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=target, insecure=credentials is None,
                                credentials=credentials, headers=headers, timeout=30)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000,
                                                   max_export_batch_size=512))
    return provider, provider.get_tracer("spanprof-tests")


def ids_of(span: Any) -> tuple[bytes, bytes]:
    ctx = span.get_span_context()
    return ctx.trace_id.to_bytes(16, "big"), ctx.span_id.to_bytes(8, "big")


def sdk_spans(target: str, service: str, n: int,
              credentials: grpc.ChannelCredentials | None = None,
              headers: dict[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    """``n`` root spans ``op0``.. sent by the SDK's exporter; their (trace id, span id)."""
    provider, tracer = sdk_tracer(target, service, credentials, headers)
    keys = []
    for i in range(n):
        with tracer.start_as_current_span(f"op{i}") as span:
            keys.append(ids_of(span))
    provider.force_flush()
    provider.shutdown()
    return keys


def profiles_stub(channel: grpc.Channel) -> Any:
    return profiles_service_pb2_grpc.ProfilesServiceStub(channel)


def traces_stub(channel: grpc.Channel) -> Any:
    return trace_service_pb2_grpc.TraceServiceStub(channel)

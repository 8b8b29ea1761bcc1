"""The OTLP/HTTP receiver: the OpenTelemetry SDK's real HTTP exporter, JSON, bad input."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from google.rpc.status_pb2 import Status

from pipeline.errors import Retryable
from pipeline.otlp.builder import ProfileBuilder
from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_http import HttpConfig
from pipeline.registry import Context
from tests.pipeline.receivers.test_otlp_grpc import FakeConsumer, span_request

PB = {"content-type": "application/x-protobuf"}
JS = {"content-type": "application/json"}


@pytest.fixture
async def server() -> AsyncIterator[tuple[OtlpReceiver, FakeConsumer, str]]:
    fake = FakeConsumer()
    http = HttpConfig(endpoint="127.0.0.1:0", max_request_bytes=256 << 10,
                      max_decompressed_bytes=1 << 20, max_spans_per_request=50)
    r = OtlpReceiver(Config(protocols=Protocols(http=http)),
                     Context("otlp", ["traces", "profiles"],
                             next={"traces": fake, "profiles": fake}))
    await r.start()
    assert r.http is not None and r.grpc is None
    yield r, fake, f"http://127.0.0.1:{r.http.port}"
    await r.shutdown()


SPAN_JSON = {"resourceSpans": [{
    "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "web"}}]},
    "scopeSpans": [{"spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
        "name": "GET /", "kind": 2, "startTimeUnixNano": "1544712660000000000",
        "endTimeUnixNano": "1544712661000000000",
        "attributes": [{"key": "n", "value": {"intValue": "42"}}]}]}]}]}


class TestOtlpHttpReceiver:
    async def test_sdk_http_exporter(self, server: Any) -> None:
        """Spans exported by the OpenTelemetry SDK's OTLP/HTTP exporter (protobuf, gzip)
        arrive with their ids, names and service."""
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        r, fake, url = server
        provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
            endpoint=url + "/v1/traces", compression=Compression.Gzip)))
        tracer = provider.get_tracer("t")

        def make() -> int:
            with tracer.start_as_current_span("checkout") as span:
                pass
            return span.get_span_context().span_id  # type: ignore[no-any-return]
        sid = await asyncio.to_thread(make)
        await asyncio.to_thread(provider.shutdown)
        (batch,) = fake.batches
        (span,) = batch.spans  # type: ignore[union-attr]
        assert (span.span_id, span.name, span.service) == (sid.to_bytes(8, "big"), "checkout",
                                                           "shop")

    async def test_json_mapping_hex_ids_string_ints(self, server: Any) -> None:
        """The OTLP JSON mapping: hex ids, integer enums, 64-bit values as strings; the
        response is JSON too."""
        r, fake, url = server
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/traces", data=json.dumps(SPAN_JSON),
                                 headers=JS) as resp:
                assert resp.status == 200 and await resp.json() == {}
        (span,) = fake.batches[0].spans  # type: ignore[union-attr]
        assert span.trace_id.hex() == "5b8efff798038103d269b633813fc60c"
        assert span.start_ns == 1544712660000000000 and span.kind == 2
        assert span.attributes == {"n": "42"}

    async def test_profiles_protobuf_partial_success(self, server: Any) -> None:
        """Profiles over HTTP; an inconsistent profile is counted in partial_success."""
        from opentelemetry.proto.collector.profiles.v1development import (
            profiles_service_pb2 as pps,
        )
        r, fake, url = server
        b = ProfileBuilder()
        b.sample(["f"], 10, b"\x01" * 16, b"\x02" * 8, service="a")
        b.sample(["g"], 10, service="b").stack_index = 99
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1development/profiles",
                                 data=gzip.compress(b.build().SerializeToString()),
                                 headers={**PB, "content-encoding": "gzip"}) as resp:
                assert resp.status == 200
                out = pps.ExportProfilesServiceResponse.FromString(await resp.read())
        assert out.partial_success.rejected_profiles == 1
        assert "stack_index 99 out of range" in out.partial_success.error_message
        assert [s.service for s in fake.batches[0].samples] == ["a"]  # type: ignore[union-attr]

    @pytest.mark.parametrize("body,headers,status,text", [
        (b"\xff\xfe junk", PB, 400, "not an ExportTraceServiceRequest"),
        (b"{not json", JS, 400, "not valid JSON"),
        (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}),
         JS, 400, "is not a hex id"),
        (b"x", {"content-type": "text/plain"}, 415, "unsupported content type"),
        (gzip.compress(b"\0" * (4 << 20), mtime=0), {**PB, "content-encoding": "gzip"}, 413,
         "decompresses to more than max_decompressed_bytes=1048576"),
        (gzip.compress(b"\0" * (4 << 20), mtime=0), PB, 413,  # gzip without the header: same limit
         "decompresses to more than max_decompressed_bytes=1048576"),
        (b"\0" * (300 << 10), PB, 413, "over max_request_bytes=262144"),
        (lambda: span_request([bytes([1, i + 1]) + bytes(6) for i in range(51)])
         .SerializeToString(), PB, 413, "51 spans in one request, over max_spans_per_request=50"),
    ])
    async def test_bad_requests(self, server: Any, body: Any, headers: dict[str, str],
                                status: int, text: str) -> None:
        """Malformed bodies, bad JSON ids, a wrong content type, a gzip bomb, an oversized
        body and too many spans each get their status and a google.rpc.Status naming the
        problem (in the request's encoding); nothing is taken; the receiver keeps serving."""
        r, fake, url = server
        async with aiohttp.ClientSession() as http:
            data = body() if callable(body) else body
            async with http.post(url + "/v1/traces", data=data, headers=headers) as resp:
                assert resp.status == status
                raw = await resp.read()
                if resp.content_type == "application/json":
                    message = json.loads(raw)["message"]
                else:
                    assert resp.content_type == "application/x-protobuf"
                    message = Status.FromString(raw).message
                assert text in message
            assert fake.batches == []
            async with http.post(url + "/v1/traces", data=json.dumps(SPAN_JSON),
                                 headers=JS) as resp:
                assert resp.status == 200
        assert len(fake.batches) == 1

    async def test_backpressure_503_retry_after(self, server: Any) -> None:
        """A full pipeline answers 503 with Retry-After (the spec's retryable status)."""
        r, fake, url = server
        fake.fail = Retryable("full", retry_after=3)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/traces", data=json.dumps(SPAN_JSON),
                                 headers=JS) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "3"

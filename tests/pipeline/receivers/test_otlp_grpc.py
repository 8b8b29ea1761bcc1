"""The OTLP/gRPC receiver in process, with a fake next consumer."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.errors import InvalidData, Retryable
from pipeline.otlp.builder import ProfileBuilder
from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_grpc import PROFILES_METHOD, TRACE_METHOD, GrpcConfig
from pipeline.records import Batch
from pipeline.registry import Context

TID = bytes(range(1, 17))


class FakeConsumer:
    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.fail: Exception | None = None

    async def consume(self, batch: Batch) -> None:
        if self.fail is not None:
            raise self.fail
        self.batches.append(batch)


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[OtlpReceiver, FakeConsumer, grpc.aio.Channel]]:
    fake = FakeConsumer()
    cfg = Config(protocols=Protocols(grpc=GrpcConfig(
        endpoint="127.0.0.1:0", max_recv_msg_size_mib=1, max_spans_per_request=50,
        max_samples_per_request=20)))
    r = OtlpReceiver(cfg, Context("otlp", ["traces", "profiles"],
                                  next={"traces": fake, "profiles": fake}))
    await r.start()
    assert r.grpc is not None and r.http is None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc.port}")
    yield r, fake, channel
    await channel.close()
    await r.shutdown()


def span_request(span_ids: list[bytes], trace_id: bytes = TID) -> tps.ExportTraceServiceRequest:
    req = tps.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name",
                                           value=AnyValue(string_value="svc")))
    ss = rs.scope_spans.add()
    for sid in span_ids:
        ss.spans.add(trace_id=trace_id, span_id=sid, name="op", start_time_unix_nano=1,
                     end_time_unix_nano=2)
    return req


def two_bad_profiles() -> Any:
    """A profile request of three services' profiles: "a" good, "b" with a link outside
    the dictionary, "c" with a function outside it."""
    b = ProfileBuilder()
    b.sample(["good"], 10, TID, b"\x01" * 8, service="a")
    bad_link = b.sample(["x"], 10, TID, b"\x01" * 8, service="b")
    bad_link.link_index = 42
    b.sample(["y"], 10, TID, b"\x01" * 8, service="c")
    req = b.build()
    req.dictionary.location_table.add().lines.add(function_index=999)
    req.dictionary.stack_table.add(location_indices=[len(req.dictionary.location_table) - 1])
    req.resource_profiles[2].scope_profiles[0].profiles[0].samples[0].stack_index = \
        len(req.dictionary.stack_table) - 1
    return req


class TestOtlpGrpcReceiver:
    async def test_garbage_is_invalid_argument_and_serving_continues(self, receiver: Any) -> None:
        """Bytes that are not a protobuf message get INVALID_ARGUMENT on both services, and
        the very next good request is accepted."""
        r, fake, channel = receiver
        for method in (TRACE_METHOD, PROFILES_METHOD):
            call = channel.unary_unary(method, request_serializer=None,
                                       response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"\x0a\xff\xff\xff\xff\x0f\x00")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not an Export" in (err.value.details() or "")
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        resp = await stub.Export(span_request([b"\x01" * 8]))
        assert not resp.HasField("partial_success")
        assert len(fake.batches) == 1 and fake.batches[0].spans[0].span_id == b"\x01" * 8
        assert r.metrics["malformed_requests"] == 2

    async def test_invalid_spans_partial_success(self, receiver: Any) -> None:
        """Spans with wrong-length ids are rejected and counted; the rest go downstream."""
        r, fake, channel = receiver
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        resp = await stub.Export(span_request([b"\x01" * 8, b"\x02" * 7, b"\x03" * 8]))
        assert resp.partial_success.rejected_spans == 1
        assert "spans[1]: span_id must be 8 bytes" in resp.partial_success.error_message
        assert [s.span_id for s in fake.batches[0].spans] == [b"\x01" * 8, b"\x03" * 8]

    async def test_inconsistent_dictionary_partial_success(self, receiver: Any) -> None:
        """A profile referencing a link or function outside the dictionary is rejected (and
        counted in rejected_profiles); the request's other profiles are accepted."""
        r, fake, channel = receiver
        stub = profiles_service_pb2_grpc.ProfilesServiceStub(channel)
        resp = await stub.Export(two_bad_profiles())
        assert resp.partial_success.rejected_profiles == 2
        msg = resp.partial_success.error_message
        assert "resource_profiles[1].scope_profiles[0].profiles[0]: samples[0]: link_index 42 " \
               "out of range" in msg
        assert "function_index 999 out of range" in msg
        (batch,) = fake.batches
        assert [s.service for s in batch.samples] == ["a"]

    async def test_downstream_errors_map_to_status(self, receiver: Any) -> None:
        """Retryable downstream -> UNAVAILABLE (clients retry); InvalidData ->
        INVALID_ARGUMENT; a success is never returned for data that was not taken."""
        r, fake, channel = receiver
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        for exc, code in ((Retryable("sink down"), grpc.StatusCode.UNAVAILABLE),
                          (InvalidData("bad"), grpc.StatusCode.INVALID_ARGUMENT)):
            fake.fail = exc
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Export(span_request([b"\x01" * 8]))
            assert err.value.code() == code
        assert fake.batches == []
        assert r.metrics["refused_spans"] == 2
        assert r.metrics["accepted_spans"] == 0

    async def test_unavailable_says_when_to_retry(self, receiver: Any) -> None:
        """A refusal carries the downstream's retry hint as RetryInfo, in the status
        details (google.rpc.Status) and under the key the Python SDK's exporter reads."""
        from google.rpc import error_details_pb2, status_pb2

        r, fake, channel = receiver
        fake.fail = Retryable("queue is full", retry_after=2.5)
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Export(span_request([b"\x01" * 8]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(err.value.trailing_metadata())
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        assert (status.code, status.message) == (14, "queue is full")
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info)
        assert 2_000_000_000 <= info.retry_delay.ToNanoseconds() <= 3_000_000_000  # ±20%
        alone = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
        assert alone == info

    async def test_oversized_request_refused(self, receiver: Any) -> None:
        """A request over max_recv_msg_size_mib is refused by gRPC itself."""
        r, fake, channel = receiver
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        req = span_request([b"\x01" * 8])
        req.resource_spans[0].scope_spans[0].spans[0].name = "x" * (2 * 1024 * 1024)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Export(req)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fake.batches == []

    async def test_gzip_bomb_refused_by_decompressed_size(self, receiver: Any) -> None:
        """A gzip-compressed request that inflates beyond max_recv_msg_size_mib (1 MiB here)
        is refused with RESOURCE_EXHAUSTED, though it is tiny on the wire; the next request
        is served."""
        r, fake, _ = receiver
        async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc.port}",
                                             compression=grpc.Compression.Gzip) as ch:
            stub = trace_service_pb2_grpc.TraceServiceStub(ch)
            req = span_request([b"\x01" * 8])
            req.resource_spans[0].scope_spans[0].spans[0].name = "\0" * (8 << 20)
            assert len(gzip.compress(req.SerializeToString())) < 64 << 10
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Export(req)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await stub.Export(span_request([b"\x02" * 8]))
        assert [b.spans[0].span_id for b in fake.batches] == [b"\x02" * 8]

    async def test_too_many_items_refused_whole_naming_the_key(self, receiver: Any) -> None:
        """More spans (samples) than max_spans_per_request (max_samples_per_request) in one
        request: RESOURCE_EXHAUSTED naming the key, nothing taken; at the limit: taken."""
        r, fake, channel = receiver
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Export(span_request([bytes([1, i + 1]) + bytes(6) for i in range(51)]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "51 spans in one request, over receivers.otlp.protocols.grpc." \
               "max_spans_per_request=50" in (err.value.details() or "")
        await stub.Export(span_request([bytes([1, i + 1]) + bytes(6) for i in range(50)]))
        b = ProfileBuilder()
        for i in range(21):
            b.sample(["f"], 10, TID, b"\x01" * 8, timestamps=[i + 1])
        pstub = profiles_service_pb2_grpc.ProfilesServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pstub.Export(b.build())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_samples_per_request=20" in (err.value.details() or "")
        assert [len(x) for x in fake.batches] == [50]

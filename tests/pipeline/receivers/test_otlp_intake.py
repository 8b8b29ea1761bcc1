"""The ``otlp`` receiver with its intake log (pipeline/receivers/intake.py), in process:
answers given before the pipeline has the request, with the same partial_success as
without an intake, and the pipeline given the same records behind, once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from pipeline.errors import Retryable
from pipeline.receivers.intake import IntakeConfig
from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_grpc import GrpcConfig
from pipeline.receivers.otlp_http import HttpConfig
from pipeline.records import Batch
from pipeline.registry import Context
from tests.pipeline.receivers.test_otlp_grpc import span_request, two_bad_profiles
from tests.pipeline.receivers.test_otlp_http import SPAN_JSON


class GatedConsumer:
    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.gate = asyncio.Event()
        self.fail: list[Exception] = []

    async def consume(self, batch: Batch) -> None:
        await self.gate.wait()
        if self.fail:
            raise self.fail.pop(0)
        self.batches.append(batch)


@pytest.fixture
async def receiver(tmp_path: Path) -> AsyncIterator[tuple[OtlpReceiver, GatedConsumer,
                                                          grpc.aio.Channel, str]]:
    fake = GatedConsumer()
    cfg = Config(protocols=Protocols(
        grpc=GrpcConfig(endpoint="127.0.0.1:0", max_spans_per_request=50,
                        max_samples_per_request=20),
        http=HttpConfig(endpoint="127.0.0.1:0")),
        intake=IntakeConfig(max_mib=1))
    r = OtlpReceiver(cfg, Context("otlp", ["traces", "profiles"],
                                  next={"traces": fake, "profiles": fake},
                                  data_dir=str(tmp_path)))
    await r.start()
    assert r.grpc is not None and r.http is not None and r.intake is not None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc.port}")
    yield r, fake, channel, f"http://127.0.0.1:{r.http.port}"
    await channel.close()
    fake.gate.set()
    await r.shutdown()


async def delivered(r: OtlpReceiver, fake: GatedConsumer) -> list[Batch]:
    fake.gate.set()
    assert r.intake is not None
    await asyncio.wait_for(r.intake.wait_idle(), 5)
    return fake.batches


class TestOtlpIntake:
    async def test_traces_answered_first_partial_success_as_without(
            self, receiver: Any) -> None:
        """A request with a refused span is answered (partial_success naming it) while the
        pipeline holds everything; the pipeline then gets the other spans as records, with
        the request's id; the same request sent again is not delivered again."""
        r, fake, channel, _ = receiver
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        req = span_request([b"\x01" * 8, b"\x02" * 7, b"\x03" * 8])
        resp = await asyncio.wait_for(stub.Export(req), 5)
        assert resp.partial_success.rejected_spans == 1
        assert "spans[1]: span_id must be 8 bytes" in resp.partial_success.error_message
        assert fake.batches == [] and len(r.intake) == 1
        again = await asyncio.wait_for(stub.Export(req), 5)
        assert again.partial_success.rejected_spans == 1
        (batch,) = await delivered(r, fake)
        assert [s.span_id for s in batch.spans] == [b"\x01" * 8, b"\x03" * 8]
        assert batch.tenant == "default" and batch.requests[0][1] == 2
        assert r.metrics["accepted_spans"] == 2 and r.metrics["duplicate_requests"] == 1

    async def test_profiles_refused_profiles_as_without(self, receiver: Any) -> None:
        """A profile request with two inconsistent profiles: rejected_profiles 2 in the
        answer, the good profile's samples delivered behind."""
        r, fake, channel, _ = receiver
        stub = profiles_service_pb2_grpc.ProfilesServiceStub(channel)
        resp = await asyncio.wait_for(stub.Export(two_bad_profiles()), 5)
        assert resp.partial_success.rejected_profiles == 2
        (batch,) = await delivered(r, fake)
        assert [s.service for s in batch.samples] == ["a"]
        assert [s.span_id for s in batch.samples] == [b"\x01" * 8]

    async def test_http_json_logged_and_decoded_behind(self, receiver: Any) -> None:
        """OTLP/HTTP JSON goes through the same log: answered 200, decoded behind."""
        r, fake, _, url = receiver
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/traces", data=json.dumps(SPAN_JSON),
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                assert await resp.json() == {}
        (batch,) = await delivered(r, fake)
        assert batch.spans[0].span_id.hex() == "eee19b7ec3c1b174"

    async def test_pipeline_refusing_for_now_is_retried_not_answered(
            self, receiver: Any) -> None:
        """The pipeline refusing for now (the memory limiter, a full sending queue) no
        longer reaches the client, which was answered: the intake tries again."""
        r, fake, channel, _ = receiver
        fake.fail = [Retryable("busy", retry_after=0.01)] * 3
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        await asyncio.wait_for(stub.Export(span_request([b"\x05" * 8])), 5)
        (batch,) = await delivered(r, fake)
        assert batch.spans[0].span_id == b"\x05" * 8
        assert r.metrics["intake_delivery_retries"] == 3

    async def test_full_intake_says_when_to_retry(self, receiver: Any) -> None:
        """Beyond the intake's max_mib: UNAVAILABLE with a RetryInfo delay on gRPC, 503
        with Retry-After on HTTP; nothing of the refused requests delivered."""
        r, fake, channel, url = receiver
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        big = span_request([bytes([1, i, 0, 0, 0, 0, 0, 1]) for i in range(1, 40)])
        for span in big.resource_spans[0].scope_spans[0].spans:
            span.name = "n" * 30_000  # ~1.2 MB: over max_mib=1 with one waiting
        await stub.Export(span_request([b"\x07" * 8]))  # waits: the pipeline is held
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Export(big)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "intake is full" in (err.value.details() or "")
        md = dict(err.value.trailing_metadata() or ())
        assert "google.rpc.retryinfo-bin" in md
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/traces", data=big.SerializeToString(),
                              headers={"Content-Type": "application/x-protobuf"}) as resp:
                assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
        batches = await delivered(r, fake)
        assert [len(b) for b in batches] == [1]

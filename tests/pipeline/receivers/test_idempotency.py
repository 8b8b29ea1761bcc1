"""A request sent again is delivered once (pipeline/receivers/idempotency.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from pipeline.errors import Retryable
from pipeline.receivers.idempotency import RecentRequests, request_key
from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_grpc import TRACE_METHOD, GrpcConfig
from pipeline.registry import Context
from tests.pipeline.receivers.test_otlp_grpc import span_request


class Slow:
    """A downstream that takes ``delay`` seconds per batch and counts what it stored."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.stored = 0
        self.calls = 0
        self.fail: Exception | None = None

    async def consume(self, batch: Any = None) -> None:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.stored += 1


class TestRecentRequests:
    async def test_a_delivered_request_sent_again_is_not_delivered_again(self) -> None:
        """The second send answers success at once; the downstream saw one batch."""
        r, down = RecentRequests(), Slow()
        key = request_key("/v1/traces", b"body")
        assert await r.deliver(key, down.consume) is False
        assert await r.deliver(key, down.consume) is True
        assert await r.deliver(request_key("/v1/traces", b"other"), down.consume) is False
        assert down.stored == 2 and r.duplicates == 1

    async def test_a_resend_while_the_first_is_in_flight_waits_for_it(self) -> None:
        """Both callers return when the one delivery is done."""
        r, down = RecentRequests(), Slow(0.2)
        key = request_key(b"x")
        first = asyncio.create_task(r.deliver(key, down.consume))
        await asyncio.sleep(0.05)
        assert await r.deliver(key, down.consume) is True
        assert await first is False
        assert down.calls == 1

    async def test_a_failure_is_shared_and_not_remembered(self) -> None:
        """A refused delivery refuses its resends in flight too, and a later send is
        delivered afresh (nothing was stored)."""
        r, down = RecentRequests(), Slow(0.1)
        down.fail = Retryable("full")
        key = request_key(b"x")
        first = asyncio.create_task(r.deliver(key, down.consume))
        await asyncio.sleep(0.02)
        with pytest.raises(Retryable):
            await r.deliver(key, down.consume)
        with pytest.raises(Retryable):
            await first
        down.fail = None
        assert await r.deliver(key, down.consume) is False
        assert down.calls == 2 and down.stored == 1

    async def test_a_client_giving_up_does_not_stop_the_delivery(self) -> None:
        """The first caller is cancelled (its deadline); the delivery goes on and a resend
        arriving after it finished is not delivered again."""
        r, down = RecentRequests(), Slow(0.2)
        key = request_key(b"x")
        first = asyncio.create_task(r.deliver(key, down.consume))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.3)
        assert down.stored == 1
        assert await r.deliver(key, down.consume) is True
        assert down.calls == 1

    async def test_remembered_for_a_while_and_bounded(self) -> None:
        """After ``recent_s`` (or beyond ``max_entries``) a request is delivered again."""
        now = [0.0]
        r, down = RecentRequests(recent_s=10, max_entries=2, clock=lambda: now[0]), Slow()
        for k in (b"a", b"b", b"c"):
            await r.deliver(request_key(k), down.consume)
        assert await r.deliver(request_key(b"a"), down.consume) is False  # forgotten: bound
        now[0] = 11.0
        assert await r.deliver(request_key(b"c"), down.consume) is False  # forgotten: time
        assert down.stored == 5


class TestResendOverGrpc:
    async def test_a_request_resent_after_a_deadline_is_stored_once(self) -> None:
        """An exporter's call times out while the pipeline is slow (ClickHouse retrying);
        it resends the same request, as the SDKs do: the pipeline stores it once and both
        the late first attempt and the resend count as one."""
        down = Slow(0.6)
        cfg = Config(protocols=Protocols(grpc=GrpcConfig(endpoint="127.0.0.1:0")))
        r = OtlpReceiver(cfg, Context("otlp", ["traces"], next={"traces": down}))
        await r.start()
        assert r.grpc is not None
        body = span_request([b"\x01" * 8]).SerializeToString()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc.port}") as ch:
                call = ch.unary_unary(TRACE_METHOD, request_serializer=None,
                                      response_deserializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(body, timeout=0.2)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await call(body, timeout=5)  # joins the first delivery
                await call(body, timeout=5)  # delivered already: answered at once
        finally:
            await r.shutdown()
        assert (down.calls, down.stored) == (1, 1)
        assert r.grpc.metrics["duplicate_requests"] == 2


class TestFailingStore:
    """A store whose inserts fail (``stalled`` gives its delay): the client is answered
    Retryable with that delay at once, the delivery goes on, and a resend once it is done
    is answered as delivered, without a second delivery."""

    async def test_client_answered_while_the_delivery_goes_on(self) -> None:
        delay: list[float | None] = [None]
        recent = RecentRequests(stalled=lambda: delay[0])
        release = asyncio.Event()
        deliveries = 0

        async def deliver() -> None:
            nonlocal deliveries
            deliveries += 1
            await release.wait()

        first = asyncio.ensure_future(recent.deliver(7, deliver))
        await asyncio.sleep(0.5)
        assert not first.done()  # a healthy store: the client waits for the outcome
        delay[0] = 4.0
        with pytest.raises(Retryable) as err:
            await asyncio.wait_for(first, timeout=1.0)
        assert err.value.retry_after == 4.0
        with pytest.raises(Retryable):  # a resend meanwhile: the same answer, no delivery
            await asyncio.wait_for(recent.deliver(7, deliver), timeout=1.0)
        release.set()
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(recent.deliver(7, deliver), timeout=1.0) is True
        assert deliveries == 1

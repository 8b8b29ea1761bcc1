"""Whose data a request is (issue #17): the receivers give every batch its tenant, from the
token with auth on, from ``X-Scope-OrgID`` with auth off, else ``default``; a header naming
another tenant than the token's, or naming none validly, is refused before the body is
read; the same bytes sent by two tenants are two requests, not a resend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from pipeline.auth import AuthConfig, TokenAuth
from pipeline.config.tls import ReceiverAuth
from pipeline.errors import ConfigError
from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_grpc import TRACE_METHOD, GrpcConfig
from pipeline.receivers.otlp_http import HttpConfig
from pipeline.receivers.pyroscope import Config as PyroscopeConfig
from pipeline.receivers.pyroscope import PyroscopeReceiver
from pipeline.registry import Context
from pipeline.tenants import Refused, TenantLimits, Tenants, TenantsConfig
from tests.pipeline.receivers.test_otlp_grpc import FakeConsumer, span_request
from tests.pipeline.receivers.test_pyroscope import pprof

TOKEN_A = "tok-team-a-3f9c2b7d81e4a6c0"
TOKEN_B = "tok-team-b-8d1e5a2f0c7b9e34"
PB = {"content-type": "application/x-protobuf"}
BODY = span_request([b"\x01" * 8]).SerializeToString()


class Servers:
    def __init__(self, r: OtlpReceiver, fake: FakeConsumer) -> None:
        self.r, self.fake = r, fake
        assert r.grpc is not None and r.http is not None
        self.url = f"http://127.0.0.1:{r.http.port}/v1/traces"
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc.port}")

    async def grpc_send(self, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
        call = self.channel.unary_unary(TRACE_METHOD, request_serializer=None,
                                        response_deserializer=None)
        try:
            await call(BODY, metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    async def http_send(self, headers: dict[str, str]) -> tuple[int, str]:
        async with aiohttp.ClientSession() as s, \
                s.post(self.url, data=BODY, headers={**PB, **headers}) as resp:
            return resp.status, await resp.text()

    def tenants(self) -> list[str]:
        return [b.tenant for b in self.fake.batches]


async def started(auth: TokenAuth | None) -> Servers:
    fake = FakeConsumer()
    ra = ReceiverAuth("tenantauth") if auth is not None else None
    cfg = Config(protocols=Protocols(
        grpc=GrpcConfig(endpoint="127.0.0.1:0", auth=ra),
        http=HttpConfig(endpoint="127.0.0.1:0", auth=ra)))
    r = OtlpReceiver(cfg, Context("otlp", ["traces"], next={"traces": fake},
                                  authenticators={"tenantauth": auth} if auth else {}))
    await r.start()
    return Servers(r, fake)


@pytest.fixture
async def open_door() -> AsyncIterator[Servers]:
    s = await started(None)
    yield s
    await s.channel.close()
    await s.r.shutdown()


@pytest.fixture
async def locked() -> AsyncIterator[Servers]:
    auth = TokenAuth(AuthConfig(tokens={TOKEN_A: "team-a", TOKEN_B: "team-b"}),
                     "tenantauth", None)
    await auth.start()
    s = await started(auth)
    yield s
    await s.channel.close()
    await s.r.shutdown()
    await auth.shutdown()


class TestAuthOff:
    async def test_org_id_names_the_tenant(self, open_door: Servers) -> None:
        """No header: ``default``; ``X-Scope-OrgID`` (HTTP header, gRPC metadata) names it."""
        s = open_door
        assert await s.http_send({}) == (200, "")
        assert (await s.http_send({"X-Scope-OrgID": "team-a"}))[0] == 200
        assert await s.grpc_send([("x-scope-orgid", "team-b")]) == grpc.StatusCode.OK
        assert s.tenants() == ["default", "team-a", "team-b"]

    @pytest.mark.parametrize("bad", ["x' OR 1=1 --", "a|b", "../etc", "", "x" * 65,
                                     "team a", "-lead"])
    async def test_a_bad_org_id_is_refused(self, open_door: Servers, bad: str) -> None:
        """A value that is not a tenant name: 400 / INVALID_ARGUMENT naming the header;
        nothing delivered, the value never echoed."""
        s = open_door
        status, text = await s.http_send({"X-Scope-OrgID": bad})
        assert status == 400 and "X-Scope-OrgID" in text
        if bad:
            assert bad not in text
        code = await s.grpc_send([("x-scope-orgid", bad)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert s.fake.batches == []
        assert s.r.metrics["refused_tenant_requests"] == 2

    async def test_two_org_ids_are_refused(self, open_door: Servers) -> None:
        """Two tenant headers: which one a proxy read is unknown, so neither is taken."""
        s = open_door
        code = await s.grpc_send([("x-scope-orgid", "team-a"), ("x-scope-orgid", "team-b")])
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert s.fake.batches == []

    async def test_same_bytes_of_two_tenants_are_two_requests(self, open_door: Servers
                                                              ) -> None:
        """Identical bodies from two tenants both arrive; the same tenant's resend does not."""
        s = open_door
        for tenant in ("team-a", "team-b", "team-a"):
            assert (await s.http_send({"X-Scope-OrgID": tenant}))[0] == 200
        assert s.tenants() == ["team-a", "team-b"]
        assert s.r.metrics["duplicate_requests"] == 1


class TestAuthOn:
    async def test_the_token_names_the_tenant(self, locked: Servers) -> None:
        """Each token's batches are its tenant's, over both protocols; the same header as
        the token's tenant is accepted."""
        s = locked
        assert (await s.http_send({"Authorization": f"Bearer {TOKEN_A}"}))[0] == 200
        md = [("authorization", f"Bearer {TOKEN_B}"), ("x-scope-orgid", "team-b")]
        assert await s.grpc_send(md) == grpc.StatusCode.OK
        assert s.tenants() == ["team-a", "team-b"]

    async def test_org_id_cannot_borrow_another_tenant(self, locked: Servers) -> None:
        """A token with ``X-Scope-OrgID`` naming another tenant: 403 / PERMISSION_DENIED,
        nothing delivered; without any token the header alone is 401."""
        s = locked
        status, _ = await s.http_send({"Authorization": f"Bearer {TOKEN_A}",
                                       "X-Scope-OrgID": "team-b"})
        assert status == 403
        md = [("authorization", f"Bearer {TOKEN_A}"), ("x-scope-orgid", "team-b")]
        assert await s.grpc_send(md) == grpc.StatusCode.PERMISSION_DENIED
        assert (await s.http_send({"X-Scope-OrgID": "team-a"}))[0] == 401
        assert await s.grpc_send([("x-scope-orgid", "team-a")]) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert s.fake.batches == []


async def test_pyroscope_ingest_carries_the_tenant() -> None:
    """The Pyroscope receiver's batches name the tenant of ``X-Scope-OrgID`` too, and the
    same upload from two tenants is two uploads."""
    fake = FakeConsumer()
    r = PyroscopeReceiver(PyroscopeConfig(endpoint="127.0.0.1:0"),
                          Context("pyroscope", ["profiles"], next={"profiles": fake}))
    await r.start()
    raw = pprof([([1], 10, {"span_id": "00000000000000aa"})])
    url = f"http://127.0.0.1:{r.port}/ingest?name=shop&format=pprof&from=1&until=2"
    try:
        async with aiohttp.ClientSession() as http:
            for tenant in ("team-p", "team-q"):
                async with http.post(url, data=raw, headers={"X-Scope-OrgID": tenant}) as resp:
                    assert resp.status == 200
        assert [b.tenant for b in fake.batches] == ["team-p", "team-q"]
    finally:
        await r.shutdown()


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TestLimits:
    def test_config_problems_name_the_keys(self) -> None:
        """Negative or infinite limits, a bad tenant name under overrides and max_tenants 0
        are each reported with their key."""
        cfg = TenantsConfig(max_tenants=0, limits=TenantLimits(requests_per_second=-1),
                            overrides={"bad name": TenantLimits(),
                                       "team-a": TenantLimits(bytes_per_second=-5)})
        with pytest.raises(ConfigError) as err:
            cfg.validate()
        text = "\n".join(err.value.problems)
        for key in ("max_tenants", "limits.requests_per_second", "overrides: 'bad name'",
                    "overrides.team-a.bytes_per_second"):
            assert key in text

    def test_requests_per_second_per_tenant(self) -> None:
        """A tenant over its rate is refused with the wait until its bucket refills; another
        tenant (its own override) is not held back by it."""
        clock = FakeClock()
        t = Tenants(TenantsConfig(limits=TenantLimits(requests_per_second=2),
                                  overrides={"big": TenantLimits(requests_per_second=100)}),
                    clock=clock)
        t.admit("a")
        t.admit("a")
        with pytest.raises(Refused) as err:
            t.admit("a")
        assert err.value.retry_after is not None and 0.4 <= err.value.retry_after <= 0.6
        assert "requests_per_second" in str(err.value)
        for _ in range(50):
            t.admit("big")
        clock.t += 0.5
        t.admit("a")
        assert t.counters()["a"] == {"requests": 3, "throttled_requests": 1}

    def test_bytes_per_second_charged_after_the_body(self) -> None:
        """A big body is taken, then the tenant waits until its bytes are paid back."""
        clock = FakeClock()
        t = Tenants(TenantsConfig(limits=TenantLimits(bytes_per_second=1000)), clock=clock)
        t.admit("a")
        t.charge("a", 3000)
        with pytest.raises(Refused) as err:
            t.admit("a")
        assert err.value.retry_after is not None and 2.0 <= err.value.retry_after <= 2.1
        clock.t += 2.1
        t.admit("a")

    def test_max_tenants(self) -> None:
        """Beyond max_tenants a new tenant is refused for good (no retry); known tenants
        and the default tenant go on."""
        t = Tenants(TenantsConfig(max_tenants=1))
        t.admit("a")
        with pytest.raises(Refused) as err:
            t.admit("b")
        assert err.value.retry_after is None and "max_tenants" in str(err.value)
        t.admit("a")
        t.admit("default")

    async def test_receivers_refuse_a_tenant_over_its_rate(self) -> None:
        """At the doors: 429 with Retry-After over HTTP, RESOURCE_EXHAUSTED with a RetryInfo
        over gRPC, for the tenant over its rate only; per-tenant counters count the spans."""
        fake = FakeConsumer()
        tenants = Tenants(TenantsConfig(overrides={"slow": TenantLimits(
            requests_per_second=1)}))
        cfg = Config(protocols=Protocols(grpc=GrpcConfig(endpoint="127.0.0.1:0"),
                                         http=HttpConfig(endpoint="127.0.0.1:0")))
        r = OtlpReceiver(cfg, Context("otlp", ["traces"], next={"traces": fake},
                                      tenants=tenants))
        await r.start()
        s = Servers(r, fake)
        try:
            assert (await s.http_send({"X-Scope-OrgID": "slow"}))[0] == 200
            async with aiohttp.ClientSession() as http, \
                    http.post(s.url, data=BODY, headers={**PB, "X-Scope-OrgID": "slow"}) as resp:
                assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
            call = s.channel.unary_unary(TRACE_METHOD, request_serializer=None,
                                         response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(BODY, metadata=[("x-scope-orgid", "slow")], timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            keys = [k for k, _ in err.value.trailing_metadata() or ()]
            assert "google.rpc.retryinfo-bin" in keys
            assert (await s.http_send({"X-Scope-OrgID": "fast"}))[0] == 200
            assert s.tenants() == ["slow", "fast"]
            counts = tenants.counters()
            assert counts["slow"]["throttled_requests"] == 2
            assert counts["slow"]["accepted_spans"] == counts["fast"]["accepted_spans"] == 1
            assert counts["slow"]["bytes"] == len(BODY)
        finally:
            await s.channel.close()
            await r.shutdown()

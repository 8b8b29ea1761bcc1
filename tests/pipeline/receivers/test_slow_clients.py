"""Slow, greedy and surplus clients against real started receivers, over real sockets:
header, body and idle timeouts, a chunked body over the limit, max_connections, and gRPC
calls over max_concurrent_requests."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_grpc import GrpcConfig
from pipeline.receivers.otlp_http import HttpConfig
from pipeline.records import Batch
from pipeline.registry import Context
from tests.pipeline.receivers.test_otlp_grpc import FakeConsumer, span_request

BODY = span_request([b"\x01" * 8]).SerializeToString()


def post(body: bytes = BODY, extra: str = "") -> bytes:
    return (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


@asynccontextmanager
async def http_receiver(**kw: Any) -> AsyncIterator[tuple[OtlpReceiver, int]]:
    cfg = HttpConfig(endpoint="127.0.0.1:0", **kw)
    fake = FakeConsumer()
    r = OtlpReceiver(Config(protocols=Protocols(http=cfg)),
                     Context("otlp", ["traces"], next={"traces": fake}))
    await r.start()
    assert r.http is not None and r.http.port is not None
    try:
        yield r, r.http.port
    finally:
        await r.shutdown()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``limit_s`` passes), and when."""
    t0, data = time.monotonic(), b""
    s.settimeout(0.1)
    while time.monotonic() - t0 < limit_s:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def trickle(s: socket.socket, data: bytes, every_s: float, limit_s: float) -> float:
    """Send ``data`` a byte at a time; the seconds until the server closed the socket."""
    t0 = time.monotonic()
    for b in data:
        try:
            s.sendall(bytes([b]))
            s.settimeout(every_s)
            if s.recv(1) == b"":
                break
        except TimeoutError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            break
        if time.monotonic() - t0 > limit_s:
            break
    return time.monotonic() - t0


class TestHttpTimeouts:
    async def test_trickled_headers_are_cut_off_at_read_header_timeout(self) -> None:
        """A client sending its headers a byte every 50 ms is disconnected once
        read_header_timeout (0.5 s) has passed, though it never stopped sending."""
        async with http_receiver(read_header_timeout=0.5) as (r, port):
            s = await asyncio.to_thread(connect, port)
            took = await asyncio.to_thread(trickle, s, post() * 10, 0.05, 10.0)
            s.close()
            assert 0.4 < took < 1.5
            assert r.http is not None and r.http.metrics["header_timeouts"] == 1

    async def test_silent_connection_closed_at_read_header_timeout(self) -> None:
        """A connection that sends nothing at all is closed after read_header_timeout."""
        async with http_receiver(read_header_timeout=0.5) as (_, port):
            s = await asyncio.to_thread(connect, port)
            data, took = await asyncio.to_thread(read_until_closed, s, 5.0)
            s.close()
            assert data == b"" and 0.4 < took < 1.5

    async def test_idle_keepalive_connection_closed_at_idle_timeout(self) -> None:
        """After an answered request the connection is idle: the header timeout does not
        apply (it outlives it), idle_timeout does."""
        async with http_receiver(read_header_timeout=0.3, idle_timeout=1.5) as (_, port):
            s = await asyncio.to_thread(connect, port)
            s.sendall(post())
            data, took = await asyncio.to_thread(read_until_closed, s, 5.0)
            s.close()
            assert data.startswith(b"HTTP/1.1 200")
            assert 1.2 < took < 3.0

    async def test_trickled_body_answered_408_at_read_timeout(self) -> None:
        """Headers in time, then the body a byte every 50 ms: 408 once read_timeout
        (1 s) has passed, and the connection is closed."""
        async with http_receiver(read_header_timeout=0.5, read_timeout=1.0) as (_, port):
            s = await asyncio.to_thread(connect, port)
            body = b"\x00" * 200
            s.sendall(post(body)[: -len(body)])
            took = await asyncio.to_thread(trickle, s, body, 0.05, 10.0)
            s.close()
            assert 0.9 < took < 2.5

    async def test_408_body_names_read_timeout(self) -> None:
        """The 408 says which key to raise."""
        async with http_receiver(read_timeout=0.5) as (_, port):
            s = await asyncio.to_thread(connect, port)
            s.sendall(post(b"\x00" * 100)[:-50])
            data, took = await asyncio.to_thread(read_until_closed, s, 5.0)
            s.close()
            assert data.startswith(b"HTTP/1.1 408") and b"read_timeout" in data
            assert took < 2.5


class TestHttpBodyLimit:
    async def test_chunked_body_over_limit_refused_while_streaming(self) -> None:
        """A chunked body (no Content-Length) of 64 MiB against max_request_bytes = 1 MiB:
        413 naming the key, sent while the client is still sending, and the server reads
        little more than the limit before it stops (the client could send at most the
        limit, plus what the kernels buffer, plus the 256 KiB read after an answer)."""
        limit = 1 << 20

        def send() -> tuple[bytes, int]:
            s = connect(port)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/x-protobuf\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"10000\r\n" + b"\x0a" * 0x10000 + b"\r\n"
            sent, answer, pending = 0, b"", b""
            s.setblocking(False)
            deadline = time.monotonic() + 20
            while sent < 64 << 20 and time.monotonic() < deadline:
                try:
                    answer += s.recv(65536)
                    if b"\r\n\r\n" in answer:
                        break
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    break
                pending = pending or chunk
                try:
                    n = s.send(pending)
                except BlockingIOError:
                    time.sleep(0.001)
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent, pending = sent + n, pending[n:]
            s.setblocking(True)
            rest, _ = read_until_closed(s, 3.0)
            s.close()
            return answer + rest, sent

        async with http_receiver(max_request_bytes=limit) as (r, port):
            answer, sent = await asyncio.to_thread(send)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"max_request_bytes=1048576" in answer
        assert sent < limit + (4 << 20), sent  # seen: 1.2 MiB of the 64 MiB offered

    async def test_content_length_over_limit_refused_before_reading(self) -> None:
        """A Content-Length over the limit is refused from the headers alone."""
        async with http_receiver(max_request_bytes=1000) as (_, port):
            s = await asyncio.to_thread(connect, port)
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                      b"x-protobuf\r\nContent-Length: 99999999\r\n\r\n")
            data, _ = await asyncio.to_thread(read_until_closed, s, 5.0)
            s.close()
            assert data.startswith(b"HTTP/1.1 413") and b"max_request_bytes=1000" in data


class TestMaxConnections:
    async def test_connection_over_limit_gets_503_and_the_others_keep_working(self) -> None:
        """With max_connections = 3, a 4th connection is answered 503 with Retry-After and
        closed; the three open ones still get their requests answered, and once one
        closes a new connection is served."""
        async with http_receiver(max_connections=3) as (r, port):
            held = [await asyncio.to_thread(connect, port) for _ in range(3)]
            await asyncio.sleep(0.1)  # the server has accepted them
            extra = await asyncio.to_thread(connect, port)
            extra.sendall(post())
            data, _ = await asyncio.to_thread(read_until_closed, extra, 5.0)
            extra.close()
            assert data.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in data
            assert b"max_connections=3" in data

            def roundtrip(s: socket.socket) -> bytes:
                s.sendall(post())
                s.settimeout(5)
                return s.recv(65536)
            for s in held:
                assert (await asyncio.to_thread(roundtrip, s)).startswith(b"HTTP/1.1 200")
            held.pop().close()
            await asyncio.sleep(0.2)
            fresh = await asyncio.to_thread(connect, port)
            assert (await asyncio.to_thread(roundtrip, fresh)).startswith(b"HTTP/1.1 200")
            for s in [*held, fresh]:
                s.close()
            assert r.http is not None and r.http.metrics["refused_connections"] == 1


class SlowConsumer(FakeConsumer):
    async def consume(self, batch: Batch) -> None:
        await asyncio.sleep(0.5)
        await super().consume(batch)


@pytest.fixture
async def grpc_receiver() -> AsyncIterator[tuple[OtlpReceiver, SlowConsumer, int]]:
    fake = SlowConsumer()
    cfg = Config(protocols=Protocols(grpc=GrpcConfig(
        endpoint="127.0.0.1:0", max_concurrent_requests=100, handshake_timeout=1.0)))
    r = OtlpReceiver(cfg, Context("otlp", ["traces"], next={"traces": fake}))
    await r.start()
    assert r.grpc is not None and r.grpc.port is not None
    yield r, fake, r.grpc.port
    await r.shutdown()


def retry_delay(err: grpc.aio.AioRpcError) -> float | None:
    for key, value in err.trailing_metadata() or ():
        if key == "google.rpc.retryinfo-bin":
            info = error_details_pb2.RetryInfo.FromString(value)
            return float(info.retry_delay.ToNanoseconds()) / 1e9
    return None


class TestGrpcConcurrency:
    async def test_300_calls_on_one_channel_succeed_or_are_told_when_to_retry(
            self, grpc_receiver: Any) -> None:
        """300 concurrent Export calls on one channel, downstream taking 0.5 s each, with
        max_concurrent_requests = 100: every call succeeds or gets UNAVAILABLE with a
        RetryInfo delay; none gets another status (no refused stream, no
        RESOURCE_EXHAUSTED)."""
        r, fake, port = grpc_receiver
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            # 300 different requests (the same one sent again would be delivered once)
            reqs = [span_request([i.to_bytes(8, "big")]) for i in range(1, 301)]
            got = await asyncio.gather(*(stub.Export(req, timeout=30) for req in reqs),
                                       return_exceptions=True)
        ok = [g for g in got if not isinstance(g, BaseException)]
        errors = [g for g in got if isinstance(g, BaseException)]
        others = [e for e in errors if not (isinstance(e, grpc.aio.AioRpcError)
                                            and e.code() == grpc.StatusCode.UNAVAILABLE
                                            and retry_delay(e))]
        assert others == []
        assert len(ok) >= 100 and len(ok) + len(errors) == 300
        assert len(fake.batches) == len(ok)
        assert all(0.5 < (retry_delay(e) or 0) < 1.5 for e in errors)
        assert r.grpc.metrics["throttled_requests"] == len(errors)

    async def test_silent_connection_closed_after_handshake_timeout(
            self, grpc_receiver: Any) -> None:
        """A TCP connection that never sends the HTTP/2 preface is closed after
        handshake_timeout (1 s here)."""
        _, _, port = grpc_receiver
        s = await asyncio.to_thread(connect, port)
        data, took = await asyncio.to_thread(read_until_closed, s, 10.0)
        s.close()
        assert took < 3.0

"""OTLP/gRPC: ``TraceService/Export`` and ``ProfilesService/Export`` (the ``grpc``
protocol of the ``otlp`` receiver, pipeline/receivers/otlp.py).

Requests are taken as raw bytes and parsed here, so that garbage is answered with
``INVALID_ARGUMENT`` (grpc's own deserialiser would make it ``INTERNAL``). Items that fail
validation are counted in ``partial_success``; the rest are accepted. The reply is sent
only once the pipeline has made the data durable; if it cannot, the client gets
``UNAVAILABLE`` with a ``RetryInfo`` delay and retries. Limits: ``max_recv_msg_size_mib``
is enforced by gRPC on the message *after* decompression (a gzip bomb is refused,
``RESOURCE_EXHAUSTED``), and ``max_spans_per_request`` / ``max_samples_per_request`` on the
message before decoding.

Hostile or simply too many clients (keys of the ``grpc`` protocol, defaults in brackets):

* ``max_concurrent_requests`` [256]: Export calls being handled at once, over all
  connections. One more is answered ``UNAVAILABLE`` with a ``RetryInfo`` delay of about
  a second, so that exporters back off and retry: grpc's own limits answer
  ``RESOURCE_EXHAUSTED`` (``maximum_concurrent_rpcs``) or refuse the stream (HTTP/2
  ``max_concurrent_streams``) without a delay, which clients count as failures.
* ``max_concurrent_streams`` [1024]: HTTP/2 streams per connection, kept above
  ``max_concurrent_requests`` so that the answer above is the one clients see.
* ``handshake_timeout`` [10s] (``grpc.server_handshake_timeout_ms``): a connection that has
  not sent the HTTP/2 preface and settings by then is closed (a silent or slow socket).
* ``max_connection_idle`` [5m] (``grpc.max_connection_idle_ms``): a connection without a
  call for this long gets a GOAWAY (clients reconnect when they next send).
* ``keepalive_time`` [60s] / ``keepalive_timeout`` [20s] (``grpc.keepalive_*``): the server
  pings a connection quiet for ``keepalive_time`` and drops it if the ping is not answered
  within ``keepalive_timeout`` (a vanished client no longer holds its streams).
* Fixed: clients may ping every 10s, with or without calls
  (``grpc.http2.min_ping_interval_without_data_ms``, ``grpc.keepalive_permit_without_calls``),
  the OpenTelemetry SDKs' keepalive settings included; faster pingers get a GOAWAY.

A message trickled slowly is bounded by the client's deadline, ``max_recv_msg_size_mib``
and the keepalive; grpc core has no per-message read timeout.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import grpc
import msgspec
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline import native
from pipeline.config import (
    Duration,
    MessageSizeMiB,
    PositiveInt,
    PositiveInt32,
    check_endpoint,
)
from pipeline.config.tls import ReceiverAuth, TlsConfig
from pipeline.errors import ConfigError, InvalidData, Retryable, TooLarge
from pipeline.otlp.bounds import RecordsLimit
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.authn import Refusal, authenticator, grpc_tenant
from pipeline.receivers.idempotency import RecentRequests, preload_recent, tenant_request_key
from pipeline.receivers.limits import ITEMS
from pipeline.receivers.otlp_request import take_request
from pipeline.registry import Context
from pipeline.tls import ServerTls


def retry_trailers(message: str, delay_s: float,
                   code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
                   ) -> tuple[tuple[str, bytes], ...]:
    """How long to wait before retrying, for an ``UNAVAILABLE`` (or ``code``) answer: a
    ``RetryInfo`` in the status details (``grpc-status-details-bin``, what the Collector
    sends and the Go and Java exporters read) and alone under ``google.rpc.retryinfo-bin``
    (what the Python SDK's exporter reads). The delay varies by ±20%, so that clients
    refused together (a client takes it as is, instead of its own jittered backoff) do not
    all come back at the same instant."""
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromNanoseconds(int(delay_s * random.uniform(0.8, 1.2) * 1e9))
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return (("grpc-status-details-bin", status.SerializeToString()),
            ("google.rpc.retryinfo-bin", info.SerializeToString()))


TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROFILES_METHOD = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export"
# signal -> (request type, response type, decoder, partial_success field)
SERVICES: dict[str, tuple[Any, Any, Any, str]] = {
    "traces": (tps.ExportTraceServiceRequest, tps.ExportTraceServiceResponse, decode_traces,
               "rejected_spans"),
    "profiles": (pps.ExportProfilesServiceRequest, pps.ExportProfilesServiceResponse,
                 decode_profiles, "rejected_profiles"),
}


CLIENT_PING_MIN_MS = 10_000
RETRY_BUSY_S = 1.0  # the delay asked of a call refused over max_concurrent_requests


def _ms(seconds: float) -> int:
    """A duration as grpc core's millisecond options take it (a C int)."""
    return min(int(seconds * 1000), 2**31 - 1)


class GrpcConfig(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "127.0.0.1:4317"
    max_recv_msg_size_mib: MessageSizeMiB = 16
    max_concurrent_streams: PositiveInt32 = 1024      # HTTP/2 streams per connection
    max_concurrent_requests: PositiveInt = 256        # over: UNAVAILABLE + RetryInfo
    handshake_timeout: Duration = Duration(10.0)      # HTTP/2 preface + settings
    max_connection_idle: Duration = Duration(300.0)   # no call for this long: GOAWAY
    keepalive_time: Duration = Duration(60.0)         # ping a quiet connection ...
    keepalive_timeout: Duration = Duration(20.0)      # ... drop it if no answer by then
    max_spans_per_request: PositiveInt = 100_000
    max_samples_per_request: RecordsLimit = 1_000_000  # at most 2^21
    tls: TlsConfig | None = None                      # pipeline/tls.py
    auth: ReceiverAuth | None = None                  # pipeline/auth.py

    def validate(self, key: str) -> None:
        check_endpoint(self.endpoint, f"{key}.endpoint")
        if self.tls is not None:
            self.tls.validate(f"{key}.tls", grpc_listener=True)
        if self.max_recv_msg_size_mib < 1:
            raise ConfigError(f"{key}.max_recv_msg_size_mib: must be at least 1")


class GrpcServer:
    def __init__(self, cfg: GrpcConfig, ctx: Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics: Counter[str] = Counter()
        self.tls: ServerTls | None = None
        self.auth = authenticator(cfg.auth, ctx.authenticators,
                                  f"receivers.{ctx.id}.protocols.grpc")
        self._stopped = False
        self._in_flight = 0
        # resent requests delivered once; clients not kept waiting on a failing store
        self.recent = RecentRequests(stalled=getattr(ctx.store, "stalled", None))
        self.intake: Any = None  # the receiver's intake log (intake.py), if it has one

    def __repr__(self) -> str:
        return f"<GrpcServer {self.ctx.id} port={self.port} {dict(self.metrics)}>"

    async def start(self) -> None:
        await preload_recent(self.recent, self.ctx, self.log)
        g = self.cfg
        size = g.max_recv_msg_size_mib * 1024 * 1024
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_concurrent_streams", g.max_concurrent_streams),
            ("grpc.server_handshake_timeout_ms", _ms(g.handshake_timeout)),
            ("grpc.max_connection_idle_ms", _ms(g.max_connection_idle)),
            ("grpc.keepalive_time_ms", _ms(g.keepalive_time)),
            ("grpc.keepalive_timeout_ms", _ms(g.keepalive_timeout)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MIN_MS),
        ])
        handlers = {}
        if "traces" in self.ctx.next:
            handlers[TRACE_METHOD] = grpc.unary_unary_rpc_method_handler(self._export_traces)
        if "profiles" in self.ctx.next:
            handlers[PROFILES_METHOD] = grpc.unary_unary_rpc_method_handler(
                self._export_profiles)
        self.server.add_generic_rpc_handlers([_Handlers(handlers)])
        try:
            if g.tls is not None:
                self.tls = ServerTls(g.tls, f"receivers.{self.ctx.id}.protocols.grpc.tls",
                                     self.log)
                self.port = self.server.add_secure_port(g.endpoint, _credentials(self.tls))
                self.tls.start()
            else:
                self.port = self.server.add_insecure_port(g.endpoint)
        except RuntimeError as err:
            raise ConfigError(f"receivers.{self.ctx.id}.protocols.grpc.endpoint: cannot listen "
                              f"on {g.endpoint}: {err}") from None
        await self.server.start()
        # native: a gateway's usual requests are checked and split in pipeline/native
        self.log.info("otlp_grpc_listening", endpoint=g.endpoint, port=self.port,
                      tls=self.tls is not None, native=native.AVAILABLE,
                      **({} if native.AVAILABLE else {"native_missing": native.WHY_NOT}))

    async def _deliver(self, signal: str, batch: Any, context: grpc.aio.ServicerContext,
                       key: int, rejected: int, data: bytes) -> None:
        batch.requests = [(key, len(batch))]  # stored with the rows (a restart knows it)
        if self.intake is not None:  # logged, decoded and delivered behind
            def send() -> Any:
                return self.intake.put(signal, batch.tenant, key, "pb", rejected, data)
        else:
            def send() -> Any:
                return self.ctx.next[signal].consume(batch)
        try:
            # a resent request (its first attempt still on its way, or stored already) is
            # delivered once: pipeline/receivers/idempotency.py
            if await self.recent.deliver(key, send):
                self.metrics["duplicate_requests"] += 1
                return
        except InvalidData as err:
            self.metrics[f"refused_{ITEMS[signal]}"] += len(batch)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Retryable as err:
            self.metrics[f"refused_{ITEMS[signal]}"] += len(batch)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err),
                                trailing_metadata=retry_trailers(str(err), err.retry_after))
        self.metrics[f"accepted_{ITEMS[signal]}"] += len(batch)
        self.ctx.tenants.count(batch.tenant, f"accepted_{ITEMS[signal]}", len(batch))

    async def _export(self, signal: str, data: bytes,
                      context: grpc.aio.ServicerContext) -> bytes:
        """One Export call of either service, if fewer than ``max_concurrent_requests``
        are being handled; otherwise UNAVAILABLE with a delay, before any parsing. First
        its tenant (``authn.grpc_tenant``): with ``auth``, a call without a known token is
        UNAUTHENTICATED; an ``x-scope-orgid`` naming another tenant PERMISSION_DENIED."""
        tenant = grpc_tenant(self.auth, self.ctx.tenants, context.invocation_metadata())
        if isinstance(tenant, Refusal):
            self.metrics[tenant.metric] += 1
            await context.abort(tenant.grpc, tenant.message, trailing_metadata=() if
                                tenant.retry_after is None else
                                retry_trailers(tenant.message, tenant.retry_after,
                                               tenant.grpc))
            raise AssertionError("abort returned")  # it raises; this tells mypy
        self.ctx.tenants.charge(tenant, len(data))
        limit = self.cfg.max_concurrent_requests
        if self._in_flight >= limit:
            self.metrics["throttled_requests"] += 1
            msg = (f"receivers.{self.ctx.id}.protocols.grpc: {self._in_flight} requests in "
                   f"flight, at max_concurrent_requests={limit}: retry later")
            await context.abort(grpc.StatusCode.UNAVAILABLE, msg,
                                trailing_metadata=retry_trailers(msg, RETRY_BUSY_S))
        self._in_flight += 1
        try:
            return await self._export_admitted(signal, data, context, tenant)
        finally:
            self._in_flight -= 1

    async def _export_admitted(self, signal: str, data: bytes,
                               context: grpc.aio.ServicerContext, tenant: str) -> bytes:
        """Parse, validate, deliver and answer one Export call."""
        request_type, response_type, decode, rejected_field = SERVICES[signal]
        # logged in an intake: checked as a gateway does, decoded behind
        records = self.intake is None and self.ctx.records.get(signal, True)
        limit_key = "max_spans_per_request" if signal == "traces" else "max_samples_per_request"
        try:
            decoded = take_request(
                signal, data, records=records, parse=request_type.FromString, decode=decode,
                wire=data, limit=getattr(self.cfg, limit_key),
                key=f"receivers.{self.ctx.id}.protocols.grpc.{limit_key}")
        except DecodeError as err:
            self.metrics["malformed_requests"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"not an {request_type.__name__}: {err}")
        except TooLarge as err:
            self.metrics["refused_requests"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        if len(decoded.batch):
            decoded.batch.tenant = tenant
            await self._deliver(signal, decoded.batch, context,
                                tenant_request_key(tenant, signal, data), decoded.rejected,
                                data)
        resp = response_type()
        if decoded.rejected:
            self.metrics[f"refused_{rejected_field.split('_', 1)[1]}"] += decoded.rejected
            setattr(resp.partial_success, rejected_field, decoded.rejected)
            resp.partial_success.error_message = decoded.message
            self.log.info("otlp_items_rejected", signal=signal, rejected=decoded.rejected,
                          reason=decoded.message[:300])
        return bytes(resp.SerializeToString())

    async def _export_traces(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._export("traces", data, context)

    async def _export_profiles(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._export("profiles", data, context)

    async def shutdown(self) -> None:
        """Stop accepting; let in-flight requests finish (they wait for durability)."""
        if self._stopped:
            return
        self._stopped = True
        if self.tls is not None:
            await self.tls.stop()
        if self.server is not None:
            await self.server.stop(grace=30.0)
            self.log.info("otlp_grpc_stopped", **dict(self.metrics))


def _credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """grpc's dynamic credentials: its fetcher, called on a grpc thread at each handshake,
    returns a reload's certificates once (None keeps the last ones)."""
    def config(files: tuple[bytes, bytes, bytes | None]) -> Any:
        key, cert, ca = files
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> Any:
        nxt = tls.take_update()
        return None if nxt is None else config(nxt)

    return grpc.dynamic_ssl_server_credentials(config(tls.files()), fetch,
                                               require_client_authentication=tls.mtls)


class _Handlers(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no stubs
    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.handlers.get(details.method)

"""``otlp`` receiver: OTLP over gRPC and/or HTTP, configured as in the OpenTelemetry
Collector.

    receivers:
      otlp:
        protocols:
          grpc:                                  # TraceService/Export, ProfilesService/Export
            endpoint: 127.0.0.1:4317
            max_recv_msg_size_mib: 16            # after decompression (gzip bombs stop here)
            max_concurrent_streams: 1024         # HTTP/2 streams per connection
            max_concurrent_requests: 256         # over: UNAVAILABLE + RetryInfo (~1s)
            handshake_timeout: 10s               # HTTP/2 preface and settings
            max_connection_idle: 5m              # no call for this long: GOAWAY
            keepalive_time: 60s                  # ping a quiet connection, drop it when
            keepalive_timeout: 20s               # the ping is not answered by then
            max_spans_per_request: 100000
            max_samples_per_request: 1000000
          http:                                  # POST /v1/traces, /v1development/profiles
            endpoint: 127.0.0.1:4318
            max_request_bytes: 16777216          # body as sent, chunked too
            max_decompressed_bytes: 67108864     # after gzip
            max_spans_per_request: 100000
            max_samples_per_request: 1000000
            read_header_timeout: 10s             # request line + headers, else closed
            read_timeout: 30s                    # the whole body: 408, closed
            idle_timeout: 60s                    # keep-alive connection without a request
            max_connections: 1000                # more: 503 + Retry-After: 1, closed
        intake:                                  # answer once logged on disk (intake.py)
          directory: intake                      # under data_dir, then the receiver's id
          max_mib: 64                            # logged, not yet delivered: beyond, retry
          concurrency: 8                         # batches handed to the pipeline at once

A protocol runs when its key is present (``grpc:`` with no value takes the defaults, as in
the Collector); with no ``protocols`` at all, gRPC alone runs. Both servers feed the same
pipelines. See otlp_grpc.py and otlp_http.py for what each answers.

With ``intake`` (absent: off) both servers answer a request once it is checked and its
bytes are in the receiver's intake log on local disk, and the log's drainer decodes it and
hands it to the pipelines behind: the answer no longer waits for decoding, the exporters
and the correlator (``intake.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

import msgspec

from pipeline.errors import ConfigError
from pipeline.receivers.intake import Intake, IntakeConfig
from pipeline.receivers.otlp_grpc import SERVICES, GrpcConfig, GrpcServer
from pipeline.receivers.otlp_http import HttpConfig, HttpServer, parse_body
from pipeline.receivers.otlp_request import take_request
from pipeline.registry import Context, Factory

UNSET = msgspec.UNSET


class Protocols(msgspec.Struct, forbid_unknown_fields=True):
    # absent: off; present (even empty, ``grpc:``): on with defaults for what is not given
    grpc: GrpcConfig | None | msgspec.UnsetType = UNSET
    http: HttpConfig | None | msgspec.UnsetType = UNSET

    def enabled(self) -> tuple[GrpcConfig | None, HttpConfig | None]:
        g = None if self.grpc is UNSET else (self.grpc or GrpcConfig())
        h = None if self.http is UNSET else (self.http or HttpConfig())
        return g, h


class Config(msgspec.Struct, forbid_unknown_fields=True):
    protocols: Protocols = msgspec.field(default_factory=lambda: Protocols(grpc=None))
    intake: IntakeConfig | None = None

    def validate(self) -> None:
        g, h = self.protocols.enabled()
        if g is None and h is None:
            raise ConfigError("protocols: enable at least one protocol (grpc, http)")
        problems: list[str] = []  # both protocols' problems, reported together
        if self.intake is not None:
            try:
                self.intake.validate("intake")
            except ConfigError as err:
                problems.extend(err.problems)
        for proto, key in ((g, "protocols.grpc"), (h, "protocols.http")):
            if proto is None:
                continue
            try:
                proto.validate(key)
            except ConfigError as err:
                problems.extend(err.problems)
        if problems:
            raise ConfigError(problems)


class OtlpReceiver:
    def __init__(self, cfg: Config, ctx: Context) -> None:
        g, h = cfg.protocols.enabled()
        self.grpc = GrpcServer(g, ctx) if g is not None else None
        self.http = HttpServer(h, ctx) if h is not None else None
        if self.grpc is not None and self.http is not None:
            # one memory of delivered requests: the store's recent ids are read once
            self.http.recent = self.grpc.recent
        self.ctx = ctx
        self.intake: Intake | None = None
        if cfg.intake is not None:
            self.intake = Intake(os.path.join(ctx.data_dir, cfg.intake.directory, ctx.id),
                                 cfg.intake, self._decode_logged, self._deliver_logged,
                                 ctx.store, ctx.log)
            for s in self.servers:
                s.intake = self.intake
                s.recent.stalled = None  # a client waits for the log's fsync only

    def _decode_logged(self, signal: str, fmt: str, body: bytes) -> Any:
        """A logged request decoded as the pipeline wants it (its records, or its bytes
        checked for a gateway): what the servers would have decoded before answering."""
        request_type, _, decode, _ = SERVICES[signal]
        wire = body if fmt == "pb" else None
        return take_request(signal, body, records=self.ctx.records.get(signal, True),
                            parse=lambda b: parse_body(b, request_type, wire is None),
                            decode=decode, wire=wire, limit=0, key="")

    async def _deliver_logged(self, signal: str, batch: Any) -> None:
        await self.ctx.next[signal].consume(batch)

    def __repr__(self) -> str:
        return f"<OtlpReceiver {self.ctx.id} grpc={self.grpc!r} http={self.http!r}>"

    @property
    def servers(self) -> list[Any]:
        return [s for s in (self.grpc, self.http) if s is not None]

    @property
    def metrics(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for s in self.servers:
            out.update(s.metrics)
        if self.intake is not None:
            out.update(self.intake.metrics)
            out["intake_waiting_requests"] = len(self.intake)
        return out

    async def start(self) -> None:
        replayed: list[int] = []
        if self.intake is not None:
            replayed = await self.intake.open()
        started = []
        try:
            for s in self.servers:
                s.recent.preload(replayed)  # logged: delivered, whatever a resend says
                await s.start()
                started.append(s)
        except BaseException:
            for s in started:
                await s.shutdown()
            if self.intake is not None:
                await self.intake.close()
            raise

    async def shutdown(self) -> None:
        # together: neither protocol keeps taking requests while the other drains
        await asyncio.gather(*(s.shutdown() for s in self.servers))
        if self.intake is not None:
            await self.intake.close()  # what is logged goes to the pipelines, still running


def create(cfg: Config, ctx: Context) -> OtlpReceiver:
    return OtlpReceiver(cfg, ctx)


FACTORY = Factory(type="otlp", kind="receiver", config=Config, create=create,
                  signals=("traces", "profiles"))

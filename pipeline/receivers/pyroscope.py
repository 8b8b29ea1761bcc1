"""``pyroscope`` receiver: what Pyroscope SDKs (Go, Java, .NET, Python, Ruby, Rust) push.

    receivers:
      pyroscope:
        endpoint: 127.0.0.1:4040              # the SDKs' default server address
        max_request_bytes: 16777216           # body as sent
        max_decompressed_bytes: 67108864      # after gzip: a bomb is refused, not inflated
        max_samples_per_request: 1000000      # records of a push, counted before any is built
        max_stack_depth: 8192                 # frames in one stack, inlined lines included
        max_table_entries: 1000000            # per pprof table (strings, functions, ...)
        max_labels: 128                       # labels of one sample, or of one series
        max_profiles_per_request: 1000        # raw profiles in one push
        read_header_timeout: 10s              # slow clients: headers, body (408), idle
        read_timeout: 30s
        idle_timeout: 60s
        max_connections: 1000                 # beyond: 503 + Retry-After

* ``POST /push.v1.PusherService/Push`` (Connect unary, ``application/proto``, gzip body):
  series labels (``service_name``) and raw pprof samples;
* ``POST /ingest?name=APP{k=v,...}&from=T&until=T[&format=pprof|folded|lines]`` (legacy,
  ``pyroscope-go`` and older SDKs): pprof as the body or as a multipart form (``profile``,
  ``sample_type_config``, ``prev_profile``), or folded text; without ``format`` the body's
  format is detected, as Pyroscope's server decides it (``pipeline/pyroscope/ingest.py``).

Samples become the same records as OTLP profiles, links taken from span labels (see
``pipeline/pyroscope/pprof.py``). Errors: 400 with a message for bad data (Connect error
JSON on the push path), 413 for limits, 503 with ``Retry-After`` when downstream is full.

A push is bounded before it is decoded: every raw profile of it is inflated within one
``max_decompressed_bytes`` for the whole push, parsed and its tables checked, and its
records counted; only when the push is within ``max_samples_per_request`` are records and
stacks built, within a stack budget shared by the push (``pipeline/otlp/stacks.py``).
Values that could not be stored (times after 2106, values over 2^44 ns, ...) are 400s
naming the field (``pipeline/otlp/bounds.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web
from google.protobuf.message import DecodeError

from pipeline.config import Duration, PositiveInt, check_endpoint
from pipeline.config.tls import ReceiverAuth, TlsConfig
from pipeline.errors import InvalidData, Retryable, TooLarge
from pipeline.otlp.bounds import RecordsLimit
from pipeline.otlp.common import UNKNOWN_SERVICE
from pipeline.pyroscope import pprof
from pipeline.pyroscope.ingest import (  # parse_*: this module's API before ingest.py
    decode_ingest,
    parse_multipart,
    parse_name,
    parse_sample_type_config,
)
from pipeline.pyroscope.messages import PushRequest, PushResponse
from pipeline.receivers.authn import TENANT
from pipeline.receivers.http_body import BodyTimeout, UnsupportedEncoding, read_body
from pipeline.receivers.http_receiver import HttpReceiver
from pipeline.receivers.limits import check_items
from pipeline.records import ProfileBatch, concat
from pipeline.registry import Context, Factory

__all__ = ["FACTORY", "PUSH_PATH", "Config", "PyroscopeReceiver", "decode_push",
           "parse_multipart", "parse_name", "parse_sample_type_config"]
PUSH_PATH = "/push.v1.PusherService/Push"
Limit = Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]


class Config(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "127.0.0.1:4040"
    max_request_bytes: PositiveInt = 16 << 20
    max_decompressed_bytes: PositiveInt = 64 << 20
    max_samples_per_request: RecordsLimit = 1_000_000
    max_stack_depth: Limit = pprof.DEFAULT_LIMITS.max_stack_depth
    max_table_entries: Limit = 1_000_000
    max_labels: Limit = 128
    max_profiles_per_request: Limit = 1000
    # the listener's guards against slow and greedy clients (pipeline/receivers/http.py)
    read_header_timeout: Duration = Duration(10.0)
    read_timeout: Duration = Duration(30.0)
    idle_timeout: Duration = Duration(60.0)
    max_connections: PositiveInt = 1000
    tls: TlsConfig | None = None  # pipeline/tls.py
    auth: ReceiverAuth | None = None  # pipeline/auth.py

    def validate(self) -> None:
        check_endpoint(self.endpoint)
        if self.tls is not None:
            self.tls.validate("tls")

    @property
    def limits(self) -> pprof.Limits:
        return pprof.Limits(self.max_samples_per_request, self.max_stack_depth,
                            self.max_table_entries, self.max_labels)


def decode_push(body: bytes, cfg: Config) -> list[ProfileBatch]:
    """A push.v1.PushRequest, bounded before records are built (module docstring)."""
    try:
        req = PushRequest.FromString(body)
    except DecodeError as err:
        raise InvalidData(f"not a push.v1.PushRequest: {err}") from None
    limits = cfg.limits
    n_raw = sum(len(series.samples) for series in req.series)
    if n_raw > cfg.max_profiles_per_request:
        raise TooLarge(f"{n_raw} profiles in one push, over max_profiles_per_request="
                       f"{cfg.max_profiles_per_request}")
    room = cfg.max_decompressed_bytes
    prepared: list[tuple[str, pprof.Prepared]] = []
    records = 0
    for i, series in enumerate(req.series):
        if len(series.labels) > limits.max_labels:
            raise TooLarge(f"series[{i}] has {len(series.labels)} labels, over max_labels="
                           f"{limits.max_labels}")
        labels = {lp.name: lp.value for lp in series.labels}
        service = labels.get("service_name") or UNKNOWN_SERVICE
        for j, raw in enumerate(series.samples):
            try:
                p = pprof.parse(raw.raw_profile, room)
                room -= p.ByteSize()
                prep = pprof.prepare(p, None, limits)
            except InvalidData as err:
                raise type(err)(f"series[{i}].samples[{j}]: {err}") from None
            records += prep.records
            if records > limits.max_samples:
                raise TooLarge(f"more than {limits.max_samples} samples in one push, over "
                               "max_samples_per_request: send smaller pushes")
            prepared.append((service, prep))
    budget = pprof.Budget(limits)
    return [pprof.build(prep, service, budget) for service, prep in prepared]


class PyroscopeReceiver(HttpReceiver):
    event = "pyroscope"
    cfg: Config

    def routes(self, app: web.Application) -> None:
        app.router.add_post(PUSH_PATH, self.push)
        app.router.add_post("/ingest", self.ingest)

    async def _body(self, request: web.Request) -> bytes:
        body = await read_body(request, self.cfg.max_request_bytes,
                               self.cfg.max_decompressed_bytes)
        self.ctx.tenants.charge(request[TENANT], len(body))
        return body

    async def _deliver(self, batches: list[ProfileBatch], tenant: str,
                       *key: bytes | str) -> None:
        """Hand the push on, once if the client sends the same one again (``key``: what
        identifies it, see ``pipeline/receivers/idempotency.py``)."""
        batch = concat(batches) if batches else ProfileBatch([], {})  # type: ignore[arg-type]
        check_items(len(batch), self.cfg.max_samples_per_request, "samples",
                    "max_samples_per_request")
        if len(batch):
            await self.deliver_once("profiles", batch, tenant, *key)
        self.metrics["accepted_samples"] += len(batch)

    async def _handle(self, work: Any, connect: bool) -> web.Response:
        try:
            await work()
        except InvalidData as err:
            status = 413 if isinstance(err, TooLarge) else 408 if isinstance(
                err, BodyTimeout) else 415 if isinstance(err, UnsupportedEncoding) else 400
            self.metrics["refused_requests"] += 1
            self.log.info("pyroscope_request_refused", status=status, reason=str(err)[:300])
            if connect:
                code = {413: "resource_exhausted", 408: "deadline_exceeded"}.get(
                    status, "invalid_argument")
                return web.json_response({"code": code, "message": str(err)}, status=status)
            return web.Response(status=status, text=str(err))
        except Retryable as err:
            self.metrics["refused_requests"] += 1
            headers = {"Retry-After": str(max(1, int(err.retry_after)))}
            if connect:
                return web.json_response({"code": "unavailable", "message": str(err)},
                                         status=503, headers=headers)
            return web.Response(status=503, text=str(err), headers=headers)
        if connect:
            return web.Response(body=PushResponse().SerializeToString(),
                                content_type="application/proto")
        return web.Response(status=200)

    async def push(self, request: web.Request) -> web.Response:
        async def work() -> None:
            body = await self._body(request)
            await self._deliver(decode_push(body, self.cfg), request[TENANT], request.path,
                                body)
        return await self._handle(work, connect=True)

    async def ingest(self, request: web.Request) -> web.Response:
        async def work() -> None:
            data = await self._body(request)
            got = decode_ingest(request.query, request.headers.get("Content-Type", ""),
                                data, self.cfg.max_decompressed_bytes, self.cfg.limits)
            # keyed by what the form holds, not its bytes: a resend may draw a new boundary
            await self._deliver([got.batch], request[TENANT], request.path,
                                request.query_string, *got.key)
        return await self._handle(work, connect=False)


def create(cfg: Config, ctx: Context) -> PyroscopeReceiver:
    return PyroscopeReceiver(cfg, ctx)


FACTORY = Factory(type="pyroscope", kind="receiver", config=Config, create=create,
                  signals=("profiles",))

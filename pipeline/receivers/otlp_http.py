"""OTLP/HTTP: ``POST /v1/traces`` and ``POST /v1development/profiles`` (the ``http``
protocol of the ``otlp`` receiver, pipeline/receivers/otlp.py).

Bodies are protobuf (``application/x-protobuf``) or the OTLP JSON mapping
(``application/json``: hex trace/span ids, integer enums, 64-bit integers as strings), gzip
or not. As the OTLP/HTTP spec says: 200 with the Export*ServiceResponse (``partial_success``
when items were refused), 400 for a malformed body, 415 for another content type, 413 over
a limit, 503 with ``Retry-After`` when the pipeline cannot take the data now; error bodies
are a ``google.rpc.Status``. Responses use the request's encoding.

Whatever a client sends is answered 4xx, never 500: a body that cannot be parsed or
decoded (deep JSON nesting, lone surrogates, invalid UTF-8, numbers out of range) is a 400
naming the body; a content type or ``Content-Encoding`` it cannot read is a 415; a body
slower than ``read_timeout`` a 408. Connection limits (``read_header_timeout``,
``read_timeout``, ``idle_timeout``, ``max_connections``) are pipeline/receivers/http.py's.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.config import Duration, PositiveInt, check_endpoint
from pipeline.config.tls import ReceiverAuth, TlsConfig
from pipeline.errors import InvalidData, Retryable, TooLarge
from pipeline.otlp import jsonwire
from pipeline.otlp.bounds import RecordsLimit
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.authn import TENANT
from pipeline.receivers.http_body import BodyTimeout, UnsupportedEncoding, read_body
from pipeline.receivers.http_receiver import HttpReceiver
from pipeline.receivers.limits import ITEMS
from pipeline.receivers.otlp_request import take_request

ROUTES: dict[str, tuple[str, Any, Any, str]] = {
    "/v1/traces": ("traces", tps.ExportTraceServiceRequest, decode_traces, "rejected_spans"),
    "/v1development/profiles": ("profiles", pps.ExportProfilesServiceRequest, decode_profiles,
                                "rejected_profiles"),
}


# what a client's body can make the parsers raise: a 400, never a 500
CLIENT_FAULTS = (InvalidData, DecodeError, json_format.ParseError, ValueError, TypeError,
                 RecursionError, OverflowError)


def parse_body(body: bytes, request_type: Any, is_json: bool) -> Any:
    """The request message; JSON through pipeline/otlp/jsonwire.py (strict UTF-8, no lone
    surrogates, bounded depth, hex ids)."""
    if is_json:
        return jsonwire.parse_request(body, request_type)
    return request_type.FromString(body)


def _printable(text: str) -> str:
    """``text`` safe to put in a protobuf string (lone surrogates from a client's JSON
    would make encoding the error answer itself fail)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "127.0.0.1:4318"
    max_request_bytes: PositiveInt = 16 << 20         # body as sent
    max_decompressed_bytes: PositiveInt = 64 << 20    # after gzip: a bomb is refused, not inflated
    max_spans_per_request: PositiveInt = 100_000
    max_samples_per_request: RecordsLimit = 1_000_000  # at most 2^21
    # connection limits (pipeline/receivers/http.py): slow and surplus clients
    read_header_timeout: Duration = Duration(10.0)   # request line + headers (slowloris)
    read_timeout: Duration = Duration(30.0)          # the whole body, once headers are in
    idle_timeout: Duration = Duration(60.0)          # keep-alive connection without a request
    max_connections: PositiveInt = 1000              # more: 503 + Retry-After: 1, closed
    tls: TlsConfig | None = None                     # pipeline/tls.py
    auth: ReceiverAuth | None = None                 # pipeline/auth.py

    def validate(self, key: str) -> None:
        check_endpoint(self.endpoint, f"{key}.endpoint")
        if self.tls is not None:
            self.tls.validate(f"{key}.tls")


class HttpServer(HttpReceiver):
    endpoint_key = "protocols.http.endpoint"
    event = "otlp_http"
    cfg: HttpConfig

    def routes(self, app: web.Application) -> None:
        for path, (signal, *_rest) in ROUTES.items():
            if signal in self.ctx.next:
                app.router.add_post(path, self.export)

    def _error(self, status: int, message: str, is_json: bool,
               headers: dict[str, str] | None = None) -> web.Response:
        """An error answer with a google.rpc.Status body, as the OTLP/HTTP spec says."""
        code = {400: 3, 408: 4, 413: 8, 415: 3, 503: 14}.get(status, 2)  # gRPC code numbers
        st = Status(code=code, message=_printable(message))
        if is_json:
            return web.json_response(json_format.MessageToDict(st), status=status,
                                     headers=headers)
        return web.Response(status=status, body=st.SerializeToString(), headers=headers,
                            content_type="application/x-protobuf")

    async def export(self, request: web.Request) -> web.Response:
        route = ROUTES[request.path]
        signal, request_type, decode, _ = route
        ctype = request.content_type
        is_json = ctype == "application/json"
        if not is_json and ctype not in ("application/x-protobuf", "application/protobuf"):
            return self._error(415, f"unsupported content type {ctype[:80]!r}: use "
                               "application/x-protobuf or application/json", False)
        items = ITEMS[signal]
        limit_key = f"max_{items}_per_request"
        try:
            body = await read_body(request, self.cfg.max_request_bytes,
                                   self.cfg.max_decompressed_bytes)
            self.ctx.tenants.charge(request[TENANT], len(body))
            decoded = take_request(
                signal, body, records=self.records(signal),
                parse=lambda b: parse_body(b, request_type, is_json), decode=decode,
                wire=None if is_json else body, limit=getattr(self.cfg, limit_key),
                key=limit_key)
        except TooLarge as err:
            self.metrics["refused_requests"] += 1
            return self._error(413, f"receivers.{self.ctx.id}.protocols.http: {err}", is_json)
        except UnsupportedEncoding as err:
            self.metrics["malformed_requests"] += 1
            return self._error(415, str(err), is_json)
        except BodyTimeout as err:
            self.metrics["refused_requests"] += 1
            return self._error(408, f"receivers.{self.ctx.id}.protocols.http: {err}", is_json,
                               {"Connection": "close"})
        except CLIENT_FAULTS as err:
            return self._malformed(err, request_type.__name__, is_json)
        return await self._deliver(route, decoded, is_json, request[TENANT],
                                   request.path, body)

    def _malformed(self, err: Exception, what: str, is_json: bool) -> web.Response:
        """400 for a body that cannot be read as ``what``. An exception other than the
        parsers' own (RecursionError for deep nesting, UnicodeError for lone surrogates,
        ValueError, ...) is logged by type: still the body's fault, but worth seeing."""
        self.metrics["malformed_requests"] += 1
        if not isinstance(err, InvalidData | DecodeError | json_format.ParseError):
            self.log.info("otlp_http_undecodable", error=type(err).__name__,
                          reason=_printable(str(err))[:300])
        detail = str(err) if not isinstance(err, RecursionError) else "nested too deeply"
        return self._error(400, f"request body is not an {what}: {detail}", is_json)

    async def _deliver(self, route: tuple[str, Any, Any, str], decoded: Any,
                       is_json: bool, tenant: str, path: str, body: bytes) -> web.Response:
        """Hand the batch on (once, if the client sends it again); answer once the pipeline
        has it (or says when to retry)."""
        signal, request_type, _, rejected_field = route
        items = ITEMS[signal]
        log = None if self.intake is None else \
            (lambda key: self.intake.put(signal, tenant, key, "json" if is_json else "pb",
                                         decoded.rejected, body))
        try:
            if len(decoded.batch):
                await self.deliver_once(signal, decoded.batch, tenant, path, body, log=log)
        except InvalidData as err:
            self.metrics[f"refused_{items}"] += len(decoded.batch)
            return self._error(400, str(err), is_json)
        except Retryable as err:
            self.metrics[f"refused_{items}"] += len(decoded.batch)
            return self._error(503, str(err), is_json,
                               {"Retry-After": str(max(1, int(err.retry_after)))})
        self.metrics[f"accepted_{items}"] += len(decoded.batch)
        resp = request_type.__name__.replace("Request", "Response")
        out = (tps if signal == "traces" else pps).__dict__[resp]()
        if decoded.rejected:
            self.metrics[f"refused_{rejected_field.split('_', 1)[1]}"] += decoded.rejected
            setattr(out.partial_success, rejected_field, decoded.rejected)
            out.partial_success.error_message = _printable(decoded.message)
        if is_json:
            return web.json_response(json_format.MessageToDict(out))
        return web.Response(body=out.SerializeToString(), content_type="application/x-protobuf")

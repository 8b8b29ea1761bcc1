"""OTLP/HTTP: ``POST /v1/traces`` and ``POST /v1development/profiles`` (the ``http``
protocol of the ``otlp`` receiver, pipeline/receivers/otlp.py).

Bodies are protobuf (``application/x-protobuf``) or the OTLP JSON mapping
(``application/json``: hex trace/span ids, integer enums, 64-bit integers as strings), gzip
or not. As the OTLP/HTTP spec says: 200 with the Export*ServiceResponse (``partial_success``
when items were refused), 400 for a malformed body, 415 for another content type, 413 over
a limit, 503 with ``Retry-After`` when the pipeline cannot take the data now; error bodies
are a ``google.rpc.Status``. Responses use the request's encoding.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.errors import InvalidData, Retryable, TooLarge
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.http import HttpReceiver, check_endpoint, read_body
from pipeline.receivers.limits import check_items, count_items

ROUTES: dict[str, tuple[str, Any, Any, str]] = {
    "/v1/traces": ("traces", tps.ExportTraceServiceRequest, decode_traces, "rejected_spans"),
    "/v1development/profiles": ("profiles", pps.ExportProfilesServiceRequest, decode_profiles,
                                "rejected_profiles"),
}
# OTLP JSON writes these bytes fields as hex, protobuf's JSON mapping expects base64
ITEMS = {"traces": "spans", "profiles": "samples"}
HEX_FIELDS = {"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id",
              "profileId", "profile_id"}


def _hex_to_base64(node: Any, path: str = "") -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in HEX_FIELDS and isinstance(v, str):
                try:
                    out[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise InvalidData(f"{path}{k}: {v!r} is not a hex id") from None
            else:
                out[k] = _hex_to_base64(v, f"{path}{k}.")
        return out
    if isinstance(node, list):
        return [_hex_to_base64(v, path) for v in node]
    return node


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "127.0.0.1:4318"
    max_request_bytes: int = 16 << 20         # body as sent
    max_decompressed_bytes: int = 64 << 20    # after gzip: a bomb is refused, not inflated
    max_spans_per_request: int = 100_000
    max_samples_per_request: int = 1_000_000

    def validate(self, key: str) -> None:
        check_endpoint(self.endpoint, f"{key}.endpoint")


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
        code = {400: 3, 413: 8, 415: 3, 503: 14}.get(status, 2)  # gRPC code numbers
        st = Status(code=code, message=message)
        if is_json:
            return web.json_response(json_format.MessageToDict(st), status=status,
                                     headers=headers)
        return web.Response(status=status, body=st.SerializeToString(), headers=headers,
                            content_type="application/x-protobuf")

    async def export(self, request: web.Request) -> web.Response:
        signal, request_type, decode, rejected_field = ROUTES[request.path]
        ctype = request.content_type
        is_json = ctype == "application/json"
        if not is_json and ctype not in ("application/x-protobuf", "application/protobuf"):
            return self._error(415, f"unsupported content type {ctype!r}: use "
                               "application/x-protobuf or application/json", False)
        items = ITEMS[signal]
        limit_key = f"max_{items}_per_request"
        try:
            body = await read_body(request, self.cfg.max_request_bytes,
                                   self.cfg.max_decompressed_bytes)
            if is_json:
                try:
                    doc = json.loads(body)
                except ValueError as err:
                    raise InvalidData(f"not JSON: {err}") from None
                req = json_format.ParseDict(_hex_to_base64(doc), request_type(),
                                            ignore_unknown_fields=True)
            else:
                req = request_type.FromString(body)
            check_items(count_items(signal, req), getattr(self.cfg, limit_key), items,
                        limit_key)
        except TooLarge as err:
            self.metrics["refused_requests"] += 1
            return self._error(413, f"receivers.{self.ctx.id}.protocols.http: {err}", is_json)
        except (InvalidData, DecodeError, json_format.ParseError) as err:
            self.metrics["malformed_requests"] += 1
            return self._error(400, f"not an {request_type.__name__}: {err}", is_json)
        decoded = decode(req)
        try:
            if len(decoded.batch):
                await self.ctx.next[signal].consume(decoded.batch)
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
            out.partial_success.error_message = decoded.message
        if is_json:
            return web.json_response(json_format.MessageToDict(out))
        return web.Response(body=out.SerializeToString(), content_type="application/x-protobuf")

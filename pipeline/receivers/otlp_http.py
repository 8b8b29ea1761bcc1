"""``otlp_http`` receiver: OTLP/HTTP ``POST /v1/traces`` and ``POST /v1development/profiles``.

    receivers:
      otlp_http:
        endpoint: 127.0.0.1:4318
        max_request_bytes: 16777216        # after decompression (gzip bombs stop here)

Bodies are protobuf (``application/x-protobuf``) or the OTLP JSON mapping
(``application/json``: hex trace/span ids, integer enums, 64-bit integers as strings), gzip
or not. As the OTLP/HTTP spec says: 200 with the Export*ServiceResponse (``partial_success``
when items were refused), 400 for a malformed body, 415 for another content type, 413 over
the size limit, 503 with ``Retry-After`` when the pipeline cannot take the data now. The
response uses the request's encoding.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from typing import Any

import msgspec
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

from pipeline.errors import InvalidData, Retryable
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.receivers.http import check_endpoint, serve
from pipeline.registry import Context, Factory

ROUTES: dict[str, tuple[str, Any, Any, str]] = {
    "/v1/traces": ("traces", tps.ExportTraceServiceRequest, decode_traces, "rejected_spans"),
    "/v1development/profiles": ("profiles", pps.ExportProfilesServiceRequest, decode_profiles,
                                "rejected_profiles"),
}
# OTLP JSON writes these bytes fields as hex, protobuf's JSON mapping expects base64
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


class Config(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "127.0.0.1:4318"
    max_request_bytes: int = 16 << 20

    def validate(self) -> None:
        check_endpoint(self.endpoint)


class OtlpHttpReceiver:
    def __init__(self, cfg: Config, ctx: Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.metrics: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def __repr__(self) -> str:
        return f"<OtlpHttpReceiver {self.ctx.id} port={self.port} {dict(self.metrics)}>"

    async def start(self) -> None:
        # aiohttp inflates gzip bodies chunk by chunk and stops at client_max_size
        app = web.Application(client_max_size=self.cfg.max_request_bytes)
        for path, (signal, *_rest) in ROUTES.items():
            if signal in self.ctx.next:
                app.router.add_post(path, self.export)
        self._runner, self.port = await serve(app, self.cfg.endpoint,
                                              f"receivers.{self.ctx.id}.endpoint")
        self.log.info("otlp_http_listening", endpoint=self.cfg.endpoint, port=self.port)

    async def export(self, request: web.Request) -> web.Response:
        signal, request_type, decode, rejected_field = ROUTES[request.path]
        ctype = request.content_type
        is_json = ctype == "application/json"
        if not is_json and ctype not in ("application/x-protobuf", "application/protobuf"):
            return web.Response(status=415, text=f"unsupported content type {ctype!r}: "
                                "use application/x-protobuf or application/json")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(status=413, text="request body (decompressed) over "
                                f"max_request_bytes={self.cfg.max_request_bytes}")
        try:
            if is_json:
                try:
                    doc = json.loads(body)
                except ValueError as err:
                    raise InvalidData(f"not JSON: {err}") from None
                req = json_format.ParseDict(_hex_to_base64(doc), request_type(),
                                            ignore_unknown_fields=True)
            else:
                req = request_type.FromString(body)
        except (InvalidData, DecodeError, json_format.ParseError) as err:
            self.metrics["malformed_requests"] += 1
            return web.Response(status=400, text=f"not an {request_type.__name__}: {err}")
        decoded = decode(req)
        try:
            if len(decoded.batch):
                await self.ctx.next[signal].consume(decoded.batch)
        except InvalidData as err:
            return web.Response(status=400, text=str(err))
        except Retryable as err:
            return web.Response(status=503, text=str(err),
                                headers={"Retry-After": str(max(1, int(err.retry_after)))})
        self.metrics[f"accepted_{'spans' if signal == 'traces' else 'samples'}"] += \
            len(decoded.batch)
        resp = request_type.__name__.replace("Request", "Response")
        out = (tps if signal == "traces" else pps).__dict__[resp]()
        if decoded.rejected:
            setattr(out.partial_success, rejected_field, decoded.rejected)
            out.partial_success.error_message = decoded.message
        if is_json:
            return web.json_response(json_format.MessageToDict(out))
        return web.Response(body=out.SerializeToString(), content_type="application/x-protobuf")

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def create(cfg: Config, ctx: Context) -> OtlpHttpReceiver:
    return OtlpHttpReceiver(cfg, ctx)


FACTORY = Factory(type="otlp_http", kind="receiver", config=Config, create=create,
                  signals=("traces", "profiles"))

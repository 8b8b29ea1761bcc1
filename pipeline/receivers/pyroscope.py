"""``pyroscope`` receiver: what Pyroscope SDKs (Go, Java, .NET, Python, Ruby, Rust) push.

    receivers:
      pyroscope:
        endpoint: 127.0.0.1:4040              # the SDKs' default server address
        max_request_bytes: 16777216           # body as sent
        max_decompressed_bytes: 67108864      # after gzip: a bomb is refused, not inflated
        max_samples_per_request: 1000000

* ``POST /push.v1.PusherService/Push`` (Connect unary, ``application/proto``, gzip body):
  series labels (``service_name``) and raw pprof samples;
* ``POST /ingest?name=APP{k=v,...}&format=pprof`` (legacy): a pprof body, or the multipart
  form with a ``profile`` file and optionally ``sample_type_config`` (JSON, Java agents).

Samples become the same records as OTLP profiles, links taken from span labels (see
``pipeline/pyroscope/pprof.py``). Errors: 400 with a message for bad data (Connect error
JSON on the push path), 413 for limits, 503 with ``Retry-After`` when downstream is full.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web
from google.protobuf.message import DecodeError

from pipeline.errors import InvalidData, Retryable, TooLarge
from pipeline.otlp.common import UNKNOWN_SERVICE
from pipeline.pyroscope.messages import PushRequest, PushResponse
from pipeline.pyroscope.pprof import decode_pprof
from pipeline.receivers.http import HttpReceiver, check_endpoint, read_body
from pipeline.receivers.limits import check_items
from pipeline.records import ProfileBatch
from pipeline.registry import Context, Factory
from processors.batch import merge

PUSH_PATH = "/push.v1.PusherService/Push"
# legacy app names end with the profile type: "checkout.cpu{env=prod}"
PROFILE_SUFFIXES = (".cpu", ".wall", ".itimer", ".alloc_objects", ".alloc_space",
                    ".inuse_objects", ".inuse_space", ".lock_count", ".lock_duration")


class Config(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "127.0.0.1:4040"
    max_request_bytes: int = 16 << 20
    max_decompressed_bytes: int = 64 << 20
    max_samples_per_request: int = 1_000_000

    def validate(self) -> None:
        check_endpoint(self.endpoint)


class PyroscopeReceiver(HttpReceiver):
    event = "pyroscope"
    cfg: Config

    def routes(self, app: web.Application) -> None:
        app.router.add_post(PUSH_PATH, self.push)
        app.router.add_post("/ingest", self.ingest)

    async def _body(self, request: web.Request) -> bytes:
        return await read_body(request, self.cfg.max_request_bytes,
                               self.cfg.max_decompressed_bytes)

    async def _part(self, part: Any) -> bytes:
        """A multipart form's file, read in chunks within max_request_bytes (aiohttp's
        client_max_size does not bound multipart reads)."""
        chunks, size = [], 0
        while chunk := await part.read_chunk():
            size += len(chunk)
            if size > self.cfg.max_request_bytes:
                raise TooLarge(f"multipart 'profile' part over max_request_bytes="
                               f"{self.cfg.max_request_bytes}")
            chunks.append(chunk)
        return bytes(part.decode(b"".join(chunks)))

    async def _deliver(self, batches: list[ProfileBatch]) -> None:
        batch = merge(batches) if batches else ProfileBatch([], {})  # type: ignore[arg-type]
        check_items(len(batch), self.cfg.max_samples_per_request, "samples",
                    "max_samples_per_request")
        if len(batch):
            await self.ctx.next["profiles"].consume(batch)
        self.metrics["accepted_samples"] += len(batch)

    async def _handle(self, work: Any, connect: bool) -> web.Response:
        try:
            await work()
        except InvalidData as err:
            status = 413 if isinstance(err, TooLarge) else 400
            self.metrics["refused_requests"] += 1
            self.log.info("pyroscope_request_refused", status=status, reason=str(err)[:300])
            if connect:
                code = "resource_exhausted" if status == 413 else "invalid_argument"
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
            try:
                req = PushRequest.FromString(body)
            except DecodeError as err:
                raise InvalidData(f"not a push.v1.PushRequest: {err}") from None
            batches = []
            for i, series in enumerate(req.series):
                labels = {lp.name: lp.value for lp in series.labels}
                service = labels.get("service_name") or UNKNOWN_SERVICE
                for j, raw in enumerate(series.samples):
                    try:
                        batches.append(decode_pprof(raw.raw_profile, service,
                                                    self.cfg.max_decompressed_bytes))
                    except InvalidData as err:
                        raise InvalidData(f"series[{i}].samples[{j}]: {err}") from None
            await self._deliver(batches)
        return await self._handle(work, connect=True)

    async def ingest(self, request: web.Request) -> web.Response:
        async def work() -> None:
            fmt = request.query.get("format", "folded")
            if fmt != "pprof":
                raise InvalidData(f"format={fmt}: only pprof is supported")
            name = request.query.get("name", "")
            app, _, rest = name.partition("{")
            labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
            for suffix in PROFILE_SUFFIXES:
                if app.endswith(suffix):
                    app = app[: -len(suffix)]
            service = labels.get("service_name") or app or UNKNOWN_SERVICE
            sample_types: dict[str, Any] | None = None
            if request.content_type.startswith("multipart/"):
                data = b""
                async for part in await request.multipart():
                    field = getattr(part, "name", None)
                    if field == "profile":
                        data = await self._part(part)
                    elif field == "sample_type_config":
                        try:
                            sample_types = json.loads(await self._part(part))
                        except ValueError as err:
                            raise InvalidData(f"sample_type_config: not JSON: {err}") from None
                        if not isinstance(sample_types, dict):
                            raise InvalidData("sample_type_config: expected a JSON object")
                if not data:
                    raise InvalidData("multipart form has no 'profile' part")
            else:
                data = await self._body(request)
            await self._deliver([decode_pprof(data, service, self.cfg.max_decompressed_bytes,
                                              sample_types)])
        return await self._handle(work, connect=False)


def create(cfg: Config, ctx: Context) -> PyroscopeReceiver:
    return PyroscopeReceiver(cfg, ctx)


FACTORY = Factory(type="pyroscope", kind="receiver", config=Config, create=create,
                  signals=("profiles",))

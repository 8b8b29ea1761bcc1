"""What the HTTP receivers share: endpoint checks and serving an aiohttp app."""

from __future__ import annotations

from collections import Counter
from typing import Any

from aiohttp import web

from pipeline.errors import ConfigError, TooLarge
from pipeline.receivers.limits import gunzip_limited
from pipeline.registry import Context


def check_endpoint(endpoint: str, key: str = "endpoint") -> None:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{key}: expected HOST:PORT, got {endpoint!r}")


async def serve(app: web.Application, endpoint: str, where: str) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``endpoint`` (port 0 picks a free one); return the runner and port.
    ``where`` is the config key named when the port cannot be bound."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = endpoint.rpartition(":")
    site = web.TCPSite(runner, host, int(port))
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise ConfigError(f"{where}: cannot listen on {endpoint}: {err.strerror}") from None
    sockets = getattr(site._server, "sockets", None) or []
    return runner, sockets[0].getsockname()[1] if sockets else int(port)


def app_for(max_decompressed_bytes: int) -> web.Application:
    """aiohttp inflates gzip request bodies itself, chunk by chunk, and stops at
    ``client_max_size``: that is where a gzip bomb is refused, before it is inflated."""
    return web.Application(client_max_size=max_decompressed_bytes)


async def read_body(request: web.Request, max_request_bytes: int,
                    max_decompressed_bytes: int) -> bytes:
    """The request body, within both limits (``TooLarge`` names the key it broke)."""
    if request.content_length and request.content_length > max_request_bytes:
        raise TooLarge(f"request body of {request.content_length} bytes, over "
                       f"max_request_bytes={max_request_bytes}")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge("request body decompresses to more than max_decompressed_bytes="
                       f"{max_decompressed_bytes}") from None
    if body[:2] == b"\x1f\x8b":  # gzip without Content-Encoding: inflated here, bounded
        body = gunzip_limited(body, max_decompressed_bytes, "request body",
                              "max_decompressed_bytes")
    return body


class HttpReceiver:
    """What the aiohttp receivers share: metrics, the server's lifecycle on
    ``cfg.endpoint`` with ``cfg.max_decompressed_bytes``, and a repr. Subclasses add their
    routes in ``routes`` and say where their endpoint key sits (``endpoint_key``) and what
    their log events are called (``event``)."""

    endpoint_key = "endpoint"
    event = "http"

    def __init__(self, cfg: Any, ctx: Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.metrics: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ctx.id} port={self.port} {dict(self.metrics)}>"

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        app = app_for(self.cfg.max_decompressed_bytes)
        self.routes(app)
        self._runner, self.port = await serve(app, self.cfg.endpoint,
                                              f"receivers.{self.ctx.id}.{self.endpoint_key}")
        self.log.info(f"{self.event}_listening", endpoint=self.cfg.endpoint, port=self.port)

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # finishes requests in flight
            self._runner = None

"""What the HTTP listeners share (OTLP/HTTP, Pyroscope, the admin API): serving an aiohttp
app behind per-connection guards. Reading a body within limits is ``http_body.py``; the
receivers' common base, ``http_receiver.py``.

A hostile or broken client must not hold the server's sockets, memory or time. Each
listener enforces, with these keys in its config (defaults in ``ServerLimits``)::

    read_header_timeout: 10s   request line and headers complete within this, counted from
                               the connection's start or a keep-alive request's first byte;
                               else the connection is closed (slowloris)
    read_timeout: 30s          the whole body within this once the headers are in: 408 when
                               the handler is reading it, the connection closed otherwise
    idle_timeout: 60s          a keep-alive connection with no request in it is closed
    max_connections: 1000      open connections; one more is answered ``503`` with
                               ``Retry-After: 1`` and closed (see ``GuardedProtocol``)

aiohttp has no header or body timeout (its ``keepalive_timeout`` starts at connect and
after each response, and is not reset by incoming bytes), so the listener's protocol is an
aiohttp ``RequestHandler`` with one timer: armed for the headers when a request begins,
re-armed for the body when the app's first middleware sees the request, cancelled when the
handler returns.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from pipeline.auth import TokenAuth
from pipeline.config.tls import TlsConfig
from pipeline.errors import ConfigError
from pipeline.receivers.authn import http_middleware
from pipeline.tenants import Tenants
from pipeline.tls import ServerTls


@dataclass(frozen=True)
class ServerLimits:
    """A listener's connection limits (seconds, connections); see the module docstring."""

    read_header_timeout: float = 10.0
    read_timeout: float = 30.0
    idle_timeout: float = 60.0
    max_connections: int = 1000

    @classmethod
    def of(cls, cfg: Any) -> ServerLimits:
        """The limits a config sets; a config without these keys (yet) gets the defaults."""
        d = cls()
        return cls(*(getattr(cfg, f, getattr(d, f)) for f in
                     ("read_header_timeout", "read_timeout", "idle_timeout",
                      "max_connections")))


# after a response, at most this much of a body the handler did not read is read and
# dropped (so that a client still sending can see the answer), for at most LINGER_S
LINGER_BYTES = 256 << 10
LINGER_S = 2.0
# a refused connection is closed this long after its 503, time for the client to read it
REFUSED_CLOSE_S = 1.0
# the protocol's body timer fires this long after ``read_timeout``: a handler reading the
# body answers 408 first, the timer closes connections whose handler is not reading
BODY_GRACE_S = 1.0
LOG_EVERY_S = 10.0


def _refusal(max_connections: int) -> bytes:
    text = f"over max_connections={max_connections}: retry later\n".encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
            b"Content-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(text), text))


class _Listener:
    """What one listener's connections share: its limits, how many are open, and counters
    (``metrics``: refused_connections, header_timeouts, body_timeouts,
    malformed_http_requests)."""

    def __init__(self, limits: ServerLimits, metrics: Counter[str], log: Any) -> None:
        self.limits = limits
        self.metrics = metrics
        self.log = log
        self.open = 0
        self._logged: dict[str, float] = {}

    def note(self, metric: str, event: str, **fields: Any) -> None:
        """Count a guard's action in ``metric``; log ``event`` at most every LOG_EVERY_S
        (a flood of slow clients must not become a flood of log lines)."""
        self.metrics[metric] += 1
        now = time.monotonic()
        if now - self._logged.get(event, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[event] = now
            self.log.warning(event, total=self.metrics[metric], **fields)


class GuardedProtocol(RequestHandler):
    """aiohttp's connection protocol with the listener's guards (module docstring).

    Over ``max_connections`` a connection is answered ``503`` + ``Retry-After`` and closed
    rather than refused at accept: the kernel would queue it in the backlog (the client
    waits, then times out) or reset it (the client sees a network error); a 503 with
    Retry-After is what OTLP exporters and HTTP clients retry on, after the delay asked."""

    def __init__(self, manager: web.Server, *, listener: _Listener,
                 loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._listener = listener
        self._timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # the current (or last) request's body
        self._in_handler = False
        self._lingered = 0
        self._close_after_response = False
        self._quiet = False  # handle_error is answering a client's fault
        self._state = "new"  # new -> open (counted) | refused

    @property
    def limits(self) -> ServerLimits:
        """The listener's limits (``read_body`` times a body by ``read_timeout``)."""
        return self._listener.limits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        lst = self._listener
        if lst.open >= lst.limits.max_connections:
            self._state = "refused"
            lst.note("refused_connections", "http_connection_refused",
                     max_connections=lst.limits.max_connections)
            t: Any = transport
            t.write(_refusal(lst.limits.max_connections))
            if t.can_write_eof():
                t.write_eof()
            self._loop.call_later(REFUSED_CLOSE_S, t.close)
            return
        self._state = "open"
        lst.open += 1
        super().connection_made(transport)
        self._arm(lst.limits.read_header_timeout, self._headers_late)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._state != "open":
            return  # a refused connection never reached aiohttp
        self._state = "closed"
        self._listener.open -= 1
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._state != "open":
            return
        if not self._in_handler:
            if self._body is not None and not self._body.is_eof():
                self._lingered += len(data)  # the rest of a body nobody reads
                if self._lingered > LINGER_BYTES:
                    self.force_close()
                    return
            elif self._timer is None:  # the first bytes of the next request
                self._arm(self._listener.limits.read_header_timeout, self._headers_late)
        super().data_received(data)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse is the client's fault: counted and logged
        now and then (``http_request_malformed``), not logged with a traceback each
        time, which any client could turn into a log flood."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        self._listener.note("malformed_http_requests", "http_request_malformed", status=status,
                            reason=str(exc or message)[:200])
        self._quiet = True
        try:
            return super().handle_error(request, status, exc, message)
        finally:
            self._quiet = False

    def log_exception(self, *args: Any, **kw: Any) -> None:
        if not self._quiet:
            super().log_exception(*args, **kw)

    def request_started(self, body: StreamReader) -> None:
        """Headers are in (the app's first middleware runs): the body's clock starts."""
        self._in_handler, self._body, self._lingered = True, body, 0
        self._arm(self._listener.limits.read_timeout + BODY_GRACE_S, self._body_late)

    def request_finished(self) -> None:
        self._in_handler = False
        self._disarm()  # idle from now on: aiohttp's keepalive_timeout (idle_timeout)

    def close_after_response(self) -> None:
        """Close once the answer is written, reading nothing more (a body too slow to
        wait for is not worth lingering on either)."""
        self._close_after_response = True

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        out = await super().finish_response(request, resp, start_time)
        if self._close_after_response:
            self.force_close()  # the transport sends what is written, then closes
        return out

    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer = self._loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if not self._in_handler and self.transport is not None:
            self._listener.note("header_timeouts", "http_header_timeout", peer=str(self.peername),
                                read_header_timeout=self._listener.limits.read_header_timeout)
            self.force_close()

    def _body_late(self) -> None:
        self._timer = None
        if self._body is not None and not self._body.is_eof() and self.transport is not None:
            self._listener.note("body_timeouts", "http_body_timeout", peer=str(self.peername),
                                read_timeout=self._listener.limits.read_timeout)
            self.force_close()


@web.middleware
async def _track(request: web.Request, handler: Any) -> web.StreamResponse:
    """Tells the connection's guard when a request's handler starts and ends."""
    proto = request.protocol
    if not isinstance(proto, GuardedProtocol):
        return await handler(request)  # type: ignore[no-any-return]
    proto.request_started(request.content)
    try:
        return await handler(request)  # type: ignore[no-any-return]
    finally:
        proto.request_finished()


def _faults(log: Any) -> Any:
    """A middleware answering 500 for what a handler did not expect, logged with its
    traceback: a server fault. Handlers answer client errors themselves (4xx)."""
    @web.middleware
    async def faults(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except (web.HTTPException, asyncio.CancelledError, ConnectionError):
            raise
        except Exception as err:
            log.exception("http_handler_failed", method=request.method, path=request.path,
                          error=type(err).__name__)
            return web.json_response({"error": "internal error (logged)"}, status=500)
    return faults


class _GuardedSite(web.TCPSite):
    """A TCP site whose connections use ``GuardedProtocol`` (aiohttp's ``Server`` always
    makes plain ``RequestHandler``s)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, listener: _Listener,
                 auto_decompress: bool, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._listener = listener
        self._auto_decompress = auto_decompress

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        manager = self._runner.server
        assert manager is not None
        lst, auto = self._listener, self._auto_decompress

        def protocol() -> GuardedProtocol:
            return GuardedProtocol(
                manager, listener=lst, loop=loop, access_log=None,
                keepalive_timeout=lst.limits.idle_timeout, lingering_time=LINGER_S,
                auto_decompress=auto)
        # with TLS, a client that fails its handshake (plain text, no certificate under
        # mTLS) is disconnected by asyncio; the listener goes on
        self._server = await loop.create_server(protocol, self._host, self._port,
                                                backlog=self._backlog, ssl=self._ssl_context)


async def serve(app: web.Application, endpoint: str, where: str,
                limits: ServerLimits | None = None, metrics: Counter[str] | None = None,
                log: Any = None, auto_decompress: bool = True,
                tls: TlsConfig | None = None, auth: TokenAuth | None = None,
                open_paths: Collection[str] = (), tenants: Tenants | None = None
                ) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``endpoint`` (port 0 picks a free one) behind ``limits``; return the
    runner and port. ``where`` is the config key of the endpoint, named when the port
    cannot be bound; guard counters go to ``metrics``. ``auto_decompress=False`` leaves
    gzip bodies to ``read_body`` (which counts the bytes as sent). ``tls``: the listener's
    certificates, served and reloaded until the runner is cleaned up (pipeline/tls.py);
    ``auth``: every path but ``open_paths`` needs a token (``authn.py``), and every
    request gets its tenant (``authn.TENANT``) from it or from ``X-Scope-OrgID``;
    ``tenants``: a tenant over its limits is refused (``pipeline/tenants.py``)."""
    log = log or structlog.get_logger()
    metrics = metrics if metrics is not None else Counter()
    app.middlewares.append(_track)  # first: the body's clock starts before anything else
    app.middlewares.append(_faults(log))
    # every request's tenant: its token's with ``auth``, else X-Scope-OrgID's or default
    app.middlewares.append(http_middleware(auth, metrics, open_paths, tenants))
    server_tls = None
    if tls is not None:
        server_tls = ServerTls(tls, where.removesuffix("endpoint") + "tls", log)
        app.on_cleanup.append(lambda _: server_tls.stop())
    listener = _Listener(limits or ServerLimits(), metrics, log)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = endpoint.rpartition(":")
    site = _GuardedSite(runner, host, int(port), listener, auto_decompress,
                        server_tls.ssl_context() if server_tls is not None else None)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise ConfigError(f"{where}: cannot listen on {endpoint}: {err.strerror}") from None
    if server_tls is not None:
        server_tls.start()
    sockets = getattr(site._server, "sockets", None) or []
    return runner, sockets[0].getsockname()[1] if sockets else int(port)


def app_for(max_decompressed_bytes: int) -> web.Application:
    """``client_max_size`` bounds what aiohttp itself reads whole (``request.post()``);
    bodies go through ``read_body`` (``http_body.py``)."""
    return web.Application(client_max_size=max_decompressed_bytes)

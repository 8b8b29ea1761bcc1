"""The base of the aiohttp receivers (OTLP/HTTP, Pyroscope): their metrics, their server's
lifecycle behind the listener limits (``http.py``), and delivering a request's batch once
however often the client resends it (``idempotency.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pipeline.receivers.authn import authenticator
from pipeline.receivers.http import ServerLimits, app_for, serve
from pipeline.receivers.idempotency import RecentRequests, preload_recent, tenant_request_key
from pipeline.receivers.limits import ITEMS
from pipeline.registry import Context


class HttpReceiver:
    """What the aiohttp receivers share: metrics, the server's lifecycle on
    ``cfg.endpoint`` with ``cfg.max_decompressed_bytes`` and the listener limits
    (``ServerLimits.of(cfg)``), and a repr. Subclasses add their routes in ``routes`` and
    say where their endpoint key sits (``endpoint_key``) and what their log events are
    called (``event``)."""

    endpoint_key = "endpoint"
    event = "http"

    def __init__(self, cfg: Any, ctx: Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.metrics: Counter[str] = Counter()
        self.limits = ServerLimits.of(cfg)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        # resent requests delivered once; clients not kept waiting on a failing store
        self.recent = RecentRequests(stalled=getattr(ctx.store, "stalled", None))
        self.intake: Any = None  # the receiver's intake log (intake.py), if it has one

    def records(self, signal: str) -> bool:
        """Whether a request is decoded into records before it is answered: not when it
        is logged in an intake (checked as a gateway does; decoded behind)."""
        return self.intake is None and self.ctx.records.get(signal, True)

    async def deliver_once(self, signal: str, batch: Any, tenant: str,
                           *key_parts: bytes | str,
                           log: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Hand ``batch`` on, as ``tenant``'s, unless the same request (``key_parts``: what
        identifies it, e.g. its path and body) of the same tenant is being delivered or was
        delivered lately; see ``pipeline/receivers/idempotency.py``. With ``log`` the
        request is logged by it (given its key: ``Intake.put``) instead."""
        batch.tenant = tenant
        key = tenant_request_key(tenant, *key_parts)
        batch.requests = [(key, len(batch))]  # stored with the rows (a restart knows it)
        if await self.recent.deliver(key, (lambda: log(key)) if log is not None else
                                     (lambda: self.ctx.next[signal].consume(batch))):
            self.metrics["duplicate_requests"] += 1
        else:
            self.ctx.tenants.count(tenant, f"accepted_{ITEMS[signal]}", len(batch))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ctx.id} port={self.port} {dict(self.metrics)}>"

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        await preload_recent(self.recent, self.ctx, self.log)
        app = app_for(self.cfg.max_decompressed_bytes)
        self.routes(app)
        key = f"receivers.{self.ctx.id}.{self.endpoint_key}"
        self._runner, self.port = await serve(
            app, self.cfg.endpoint, key, self.limits, self.metrics, self.log,
            auto_decompress=False, tls=self.cfg.tls,
            auth=authenticator(self.cfg.auth, self.ctx.authenticators,
                               key.removesuffix(".endpoint")), tenants=self.ctx.tenants)
        self.log.info(f"{self.event}_listening", endpoint=self.cfg.endpoint, port=self.port,
                      tls=self.cfg.tls is not None)

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # finishes requests in flight
            self._runner = None

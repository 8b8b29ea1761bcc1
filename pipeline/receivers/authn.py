"""A listener's ``auth: {authenticator: ID}``: every request must carry a token the named
extension knows (``pipeline/auth.py``), else it is refused before its body is read: HTTP
``401`` with ``WWW-Authenticate``, gRPC ``UNAUTHENTICATED``. Refusals are counted in the
listener's ``unauthenticated_requests``; the token is never logged. The tenant a token
maps to is kept on the request (``request["tenant"]``) for what comes after it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

from aiohttp import web

from pipeline.auth import TokenAuth
from pipeline.errors import ConfigError

REFUSED = "missing or unknown token: send Authorization: Bearer <token> (or basic auth)"


def authenticator(auth: Any, authenticators: Any, key: str) -> TokenAuth | None:
    """The extension a listener's ``auth:`` names (None: no auth)."""
    if auth is None:
        return None
    found = authenticators.get(auth.authenticator)
    if found is None:
        raise ConfigError(f"{key}.auth.authenticator: {auth.authenticator!r} is not a started "
                          "extension")
    return found  # type: ignore[no-any-return]


def http_middleware(auth: TokenAuth, metrics: Counter[str],
                    open_paths: Collection[str] = ()) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in open_paths:
            tenant = auth.tenant_of_http(request.headers)
            if tenant is None:
                metrics["unauthenticated_requests"] += 1
                return web.json_response(
                    {"error": REFUSED}, status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="spanprof"'})
            request["tenant"] = tenant
        return await handler(request)  # type: ignore[no-any-return]
    return check

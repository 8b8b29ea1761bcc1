"""Whose request is it: a listener's ``auth: {authenticator: ID}`` and ``X-Scope-OrgID``.

With ``auth``, every request must carry a token the named extension knows
(``pipeline/auth.py``), else it is refused before its body is read: HTTP ``401`` with
``WWW-Authenticate``, gRPC ``UNAUTHENTICATED``. The token's tenant is the request's; an
``X-Scope-OrgID`` beside it naming another tenant is refused (``403`` /
``PERMISSION_DENIED``): a client cannot reach another tenant's data by naming it. Without
``auth``, ``X-Scope-OrgID`` names the tenant (Grafana's backends' convention), else it is
``default``; a value that is not a tenant name is ``400`` / ``INVALID_ARGUMENT``.

Refusals are counted in the listener's ``unauthenticated_requests`` (or
``refused_tenant_requests``); the token is never logged. The tenant is kept on the request
(``request[TENANT]``) for what comes after it."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import grpc
from aiohttp import web

from pipeline.auth import DEFAULT_TENANT, TokenAuth, tenant_from_header
from pipeline.errors import ConfigError, InvalidData
from pipeline.tenants import Refused, Tenants

REFUSED = "missing or unknown token: send Authorization: Bearer <token> (or basic auth)"
ORG_ID = "x-scope-orgid"  # lower case: gRPC metadata keys are
TENANT = web.RequestKey("tenant", str)  # request[TENANT]: whose request it is


class Refusal(NamedTuple):
    http: int
    grpc: grpc.StatusCode
    message: str
    metric: str
    retry_after: float | None = None  # retryable after this many seconds


UNAUTHENTICATED = Refusal(401, grpc.StatusCode.UNAUTHENTICATED, REFUSED,
                          "unauthenticated_requests")


def authenticator(auth: Any, authenticators: Any, key: str) -> TokenAuth | None:
    """The extension a listener's ``auth:`` names (None: no auth)."""
    if auth is None:
        return None
    found = authenticators.get(auth.authenticator)
    if found is None:
        raise ConfigError(f"{key}.auth.authenticator: {auth.authenticator!r} is not a started "
                          "extension")
    return found  # type: ignore[no-any-return]


def resolve_tenant(auth: TokenAuth | None, token_tenant: Callable[[], str | None],
                   org_ids: Sequence[object]) -> str | Refusal:
    """The request's tenant, or why it is refused. ``token_tenant`` reads the credential
    (called only with ``auth``); ``org_ids``: the ``X-Scope-OrgID`` values sent."""
    org: str | None = None
    if len(org_ids) > 1:
        return Refusal(400, grpc.StatusCode.INVALID_ARGUMENT,
                       "X-Scope-OrgID: sent more than once; send one tenant",
                       "refused_tenant_requests")
    if org_ids:
        value = org_ids[0]
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        try:
            org = tenant_from_header(value if isinstance(value, str) else "")
        except InvalidData as err:
            return Refusal(400, grpc.StatusCode.INVALID_ARGUMENT, str(err),
                           "refused_tenant_requests")
    if auth is None:
        return org or DEFAULT_TENANT
    tenant = token_tenant()
    if tenant is None:
        return UNAUTHENTICATED
    if org is not None and org != tenant:
        return Refusal(403, grpc.StatusCode.PERMISSION_DENIED,
                       "X-Scope-OrgID names a tenant other than the token's: leave it out "
                       "or send the token's own", "refused_tenant_requests")
    return tenant


def admit(auth: TokenAuth | None, tenants: Tenants | None,
          token_tenant: Callable[[], str | None], org_ids: Sequence[object]) -> str | Refusal:
    """``resolve_tenant``, then, with ``tenants``, that tenant's limits
    (``pipeline/tenants.py``): the request's tenant, counted in, or why it is refused."""
    tenant = resolve_tenant(auth, token_tenant, org_ids)
    if isinstance(tenant, Refusal) or tenants is None:
        return tenant
    try:
        tenants.admit(tenant)
    except Refused as err:
        if err.retry_after is None:
            return Refusal(403, grpc.StatusCode.PERMISSION_DENIED, str(err),
                           "refused_tenant_requests")
        return Refusal(429, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err),
                       "throttled_requests", err.retry_after)
    return tenant


def grpc_tenant(auth: TokenAuth | None, tenants: Tenants | None,
                metadata: Sequence[tuple[str, str | bytes]] | None) -> str | Refusal:
    """``admit`` for a gRPC call's metadata."""
    items = list(metadata or ())
    org = [item[1] for item in items if isinstance(item, tuple | list) and len(item) == 2
           and isinstance(item[0], str) and item[0].lower() == ORG_ID]
    return admit(auth, tenants, lambda: auth.tenant_of_grpc(items) if auth else None, org)


def http_middleware(auth: TokenAuth | None, metrics: Counter[str],
                    open_paths: Collection[str] = (), tenants: Tenants | None = None) -> Any:
    """Sets ``request[TENANT]`` on every request but ``open_paths``, or refuses it; with
    ``tenants``, a tenant over its limits is refused too."""
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in open_paths:
            org = [v for k, v in request.headers.items() if k.lower() == ORG_ID]
            got = admit(auth, tenants, lambda: auth.tenant_of_http(request.headers)
                        if auth else None, org)
            if isinstance(got, Refusal):
                metrics[got.metric] += 1
                headers = {"WWW-Authenticate": 'Bearer realm="spanprof"'} \
                    if got.http == 401 else None
                if got.retry_after is not None:
                    headers = {"Retry-After": str(max(1, math.ceil(got.retry_after)))}
                return web.json_response({"error": got.message}, status=got.http,
                                         headers=headers)
            request[TENANT] = got
        return await handler(request)  # type: ignore[no-any-return]
    return check

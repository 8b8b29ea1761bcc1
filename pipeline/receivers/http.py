"""What the HTTP receivers share: endpoint checks and serving an aiohttp app."""

from __future__ import annotations

from aiohttp import web

from pipeline.errors import ConfigError


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

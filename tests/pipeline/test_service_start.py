"""Service.start: a step that fails stops what started before it (extensions last)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_file
from pipeline.errors import ConfigError
from pipeline.registry import default_factories
from pipeline.service import Service
from tests.conftest import free_port

CONFIG = """
extensions:
  tenantauth: {tokens: {"tok-team-a-3f9c2b7d81e4a6c0": team-a}}
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:PORT", auth: {authenticator: tenantauth}}
exporters:
  debug: {}
service:
  extensions: [tenantauth]
  admin: {endpoint: "127.0.0.1:ADMIN"}
  pipelines:
    traces: {receivers: [otlp], exporters: [debug]}
"""


class Recorder:
    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, []

    async def start(self) -> None:
        self.calls.append("start")

    async def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.mark.parametrize("taken", ["receiver", "admin"])
async def test_a_failed_start_stops_the_extensions(tmp_path: Path, taken: str) -> None:
    """A receiver's or the admin API's port already taken: start raises the config error,
    and the extension that started is shut down again (its reload watcher not left)."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    text = CONFIG.replace("PORT", str(port if taken == "receiver" else free_port())) \
        .replace("ADMIN", str(port if taken == "admin" else free_port()))
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    factories = default_factories()
    service = Service(load_file(str(path), factories), factories)
    ext = service.extensions["tenantauth"] = Recorder(service.extensions["tenantauth"])
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            await service.start()
    finally:
        busy.close()
    assert ext.calls == ["start", "shutdown"]

"""TLS on a listener: the ``tls:`` key of every endpoint (OTLP gRPC and HTTP, Pyroscope,
the admin API), in the OpenTelemetry Collector's shape::

    tls:
      cert_file: server.crt        # PEM, the chain the server presents
      key_file: server.key         # PEM, its private key
      client_ca_file: ca.crt       # set: mTLS, a client must present a certificate it signed
      min_version: "1.2"           # or "1.3" (HTTP listeners only, see below)
      reload_interval: 10s         # the files are checked this often; changed: reloaded

Changed files are reloaded without a restart and without dropping a connection: a new
handshake gets the new certificate, connections already open keep theirs. A reload that
fails (a half-written file, a key that does not match) keeps the previous certificate and
is logged as ``tls_reload_failed``. Whether mTLS is on (``client_ca_file`` set or not) is
fixed at start.

HTTP listeners (aiohttp) take an ``ssl.SSLContext`` whose SNI callback hands every new
handshake the current context. gRPC's listener takes grpc's dynamic server credentials,
whose fetcher grpc calls at each handshake (``otlp_grpc.py``, from ``files()`` and
``take_update()``). grpc's Python API cannot refuse TLS 1.2 (it
offers 1.2 and 1.3), so ``min_version: "1.3"`` is refused on a gRPC endpoint rather than
silently not applied. A plain-text client on a TLS port fails its handshake and is
disconnected; the listener goes on serving.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import Any

from pipeline.background import file_stamp, stop_task
from pipeline.config.tls import TlsConfig, server_context


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _stamp(paths: list[str]) -> tuple[tuple[int, ...], ...]:
    return tuple(file_stamp(p) for p in paths)


class ServerTls:
    """One listener's certificates, reloaded when their files change (``start()``)."""

    def __init__(self, cfg: TlsConfig, key: str, log: Any) -> None:
        self.cfg = cfg
        self.key = key
        self.log = log
        self._paths = [p for p in (cfg.cert_file, cfg.key_file, cfg.client_ca_file) if p]
        self._stamp = _stamp(self._paths)
        self._current = self._build()
        self._outer = self._build()  # what the listener holds; hands over to _current
        # the files' bytes of a reload that gRPC's fetcher has not taken yet
        self._update: tuple[bytes, bytes, bytes | None] | None = None
        self._lock = threading.Lock()  # _update is taken on a grpc thread
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0

    def _build(self) -> ssl.SSLContext:
        ctx = server_context(self.cfg)
        ctx.sni_callback = self._handshake
        return ctx

    def _handshake(self, sslobj: ssl.SSLObject, name: str | None,
                   ctx: ssl.SSLContext) -> None:
        if ctx is not self._current:
            sslobj.context = self._current

    def ssl_context(self) -> ssl.SSLContext:
        return self._outer

    @property
    def mtls(self) -> bool:
        return bool(self.cfg.client_ca_file)

    def files(self) -> tuple[bytes, bytes, bytes | None]:
        """The private key, the certificate chain and the client CA (None: no mTLS)."""
        ca = _read(self.cfg.client_ca_file) if self.cfg.client_ca_file else None
        return _read(self.cfg.key_file), _read(self.cfg.cert_file), ca

    def take_update(self) -> tuple[bytes, bytes, bytes | None] | None:
        """The files of a reload not taken yet (then None until the next one)."""
        with self._lock:
            nxt, self._update = self._update, None
        return nxt

    def reload_if_changed(self) -> bool:
        """Reload when a file changed (True once reloaded); a failure keeps the old ones."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            ctx, files = self._build(), self.files()
        except (OSError, ssl.SSLError, ValueError, RuntimeError) as err:
            self.log.warning("tls_reload_failed", key=self.key, error=str(err))
            return False
        with self._lock:
            self._current, self._update = ctx, files
        self.reloads += 1
        self.log.info("tls_reloaded", key=self.key, cert_file=self.cfg.cert_file)
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(float(self.cfg.reload_interval))
            self.reload_if_changed()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name=f"tls-reload {self.key}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

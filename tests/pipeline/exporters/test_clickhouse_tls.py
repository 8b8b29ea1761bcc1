"""The ClickHouse exporter's ``tls:`` against an https server (issue #17). No ClickHouse
server runs here, so the server is a TLS listener that records the HTTP requests reaching
it and answers 500: a request arrives only when the client trusted the server (its CA
given, or verification off) and, under mTLS, presented its certificate."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pipeline.config.ranges import dec_hook
from pipeline.config.tls import ClientTls
from pipeline.errors import ConfigError
from pipeline.exporters.clickhouse.exporter import Config, connect
from tests.certs import CertAuthority, Issued


class Recorder(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _any(self) -> None:
        type(self).seen.append(self.path)
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _any

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CertAuthority, Issued, Issued]:
    ca = CertAuthority(tmp_path)
    return ca, ca.issue("server"), ca.issue("client", server=False)


def serve(server_cert: Issued, client_ca: Path | None) -> Iterator[tuple[int, list[str]]]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(server_cert.cert, server_cert.key)
    if client_ca is not None:
        ctx.load_verify_locations(cafile=str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    seen: list[str] = []
    handler = type("H", (Recorder,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd.server_address[1], seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def attempt(port: int, tls: dict[str, Any] | None) -> None:
    cfg = msgspec.convert({"endpoint": f"https://127.0.0.1:{port}", "timeout": 3.0,
                           **({"tls": tls} if tls is not None else {})}, Config,
                          dec_hook=dec_hook)
    cfg.validate()
    with pytest.raises(Exception):  # noqa: B017 - the fake answers 500, or TLS fails
        connect(cfg, ".")


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_the_ca_decides_whether_a_request_is_sent(
        pki: tuple[CertAuthority, Issued, Issued], monkeypatch: pytest.MonkeyPatch) -> None:
    ca, server, _ = pki
    for var in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(var, raising=False)
    for port, seen in serve(server, None):
        attempt(port, None)  # the system's CAs: this server is not trusted
        assert seen == []
        attempt(port, {"ca_file": str(ca.path)})
        assert seen, "with the CA the client's request reached the server"
        n = len(seen)
        attempt(port, {"insecure_skip_verify": True})
        assert len(seen) > n


def test_a_client_certificate_for_mutual_tls(
        pki: tuple[CertAuthority, Issued, Issued]) -> None:
    ca, server, client = pki
    for port, seen in serve(server, ca.path):
        attempt(port, {"ca_file": str(ca.path)})
        assert seen == []  # no client certificate: the handshake fails
        attempt(port, {"ca_file": str(ca.path), "cert_file": str(client.cert),
                       "key_file": str(client.key)})
        assert seen


def test_tls_needs_https(pki: tuple[CertAuthority, Issued, Issued]) -> None:
    ca, _, _ = pki
    cfg = msgspec.convert({"endpoint": "http://127.0.0.1:8123",
                           "tls": {"ca_file": str(ca.path)}}, Config)
    with pytest.raises(ConfigError, match="tls: needs an https:// endpoint"):
        cfg.validate()
    assert ClientTls(ca_file=str(ca.path)).ca_file

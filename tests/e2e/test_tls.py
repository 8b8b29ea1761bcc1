"""TLS on every listener of a running ``spanprof run`` (issue #17), with the OpenTelemetry
SDK's real exporters: gRPC and HTTP exporters given the CA are stored; a plain-text client
on a TLS port is refused and the listener goes on; certificates replaced on disk are
served to new connections without a restart while an open connection keeps working; with
``client_ca_file`` (mTLS) a client without a certificate, or with an expired one, is
refused and nothing it sent is stored."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.certs import CertAuthority, Issued
from tests.conftest import SpanprofProcess, side_by_side, wait_until

pytestmark = pytest.mark.e2e
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

CONFIG = """
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{{grpc_port}}
        tls: {tls}
      http:
        endpoint: 127.0.0.1:{{http_port}}
        tls: {tls}
  pyroscope:
    endpoint: 127.0.0.1:{{pyroscope_port}}
    tls: {tls}
exporters:
  clickhouse:
    endpoint: chdb://{{data}}
    flush_interval: 100ms
service:
  admin:
    endpoint: 127.0.0.1:{{admin_port}}
    tls: {admin_tls}
  telemetry: {{{{logs: {{{{encoding: json}}}}}}}}
  pipelines:
    traces: {{{{receivers: [otlp], exporters: [clickhouse]}}}}
    profiles: {{{{receivers: [otlp, pyroscope], exporters: [clickhouse]}}}}
"""


def tls_yaml(server: Issued, client_ca: Path | None = None) -> str:
    ca = f", client_ca_file: {client_ca}" if client_ca else ""
    # braces doubled: SpanprofProcess formats the text once more (its port placeholders)
    return (f"{{{{cert_file: {server.cert}, key_file: {server.key}{ca}, "
            f"reload_interval: 100ms}}}}")


def finished_spans(service: str, n: int) -> list[Any]:
    """``n`` spans made by the SDK, to hand to an exporter under test."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("spanprof-tests")
    for i in range(n):
        with tracer.start_as_current_span(f"op{i}"):
            pass
    return list(memory.get_finished_spans())


def stored(sp: SpanprofProcess, service: str) -> int:
    spans = sp.get("/api/v1/spans?order=duration&limit=1000&method=all")["spans"]
    return sum(1 for s in spans if s["service"] == service)


def client_context(ca: CertAuthority, client: Issued | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.path))
    if client is not None:
        ctx.load_cert_chain(client.cert, client.key)
    return ctx


def served_serial(port: int, ca: CertAuthority) -> int:
    """The serial number of the certificate a new TLS connection to ``port`` is shown."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1") as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def grpc_credentials(ca: CertAuthority, client: Issued | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        ca.path.read_bytes(), client.key.read_bytes() if client else None,
        client.cert.read_bytes() if client else None)


@pytest.fixture(autouse=True)
def _exporter_ca_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE (set on this machine) override a
    session's ``verify``, which is where the SDK's HTTP exporter puts ``certificate_file``:
    with them set, the exporter would verify against the system store, not the test CA."""
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)


class TestTls:
    def test_sdk_exporters_plain_text_refused_and_certificates_reloaded(
            self, tmp_path: Path) -> None:
        ca = CertAuthority(tmp_path / "pki")
        server = ca.issue("server")
        sp = SpanprofProcess(tmp_path / "sp", config_text=CONFIG.format(
            tls=tls_yaml(server), admin_tls=tls_yaml(server)))
        sp.admin_ssl = client_context(ca)
        sp.start()
        # the SDK's exporters, given the CA, over gRPC and HTTP
        grpc_exp = GrpcExporter(endpoint=f"127.0.0.1:{sp.grpc_port}",
                                credentials=grpc_credentials(ca), timeout=10)
        assert grpc_exp.export(finished_spans("over-grpc", 3)) == SpanExportResult.SUCCESS
        http_exp = HttpExporter(endpoint=f"https://127.0.0.1:{sp.http_port}/v1/traces",
                                certificate_file=str(ca.path), timeout=10)
        assert http_exp.export(finished_spans("over-http", 4)) == SpanExportResult.SUCCESS
        wait_until(lambda: stored(sp, "over-grpc") == 3 and stored(sp, "over-http") == 4)

        # plain text on the TLS ports: refused, nothing stored, the listeners go on
        with pytest.raises(grpc.RpcError) as err:
            grpc.insecure_channel(sp.grpc_target).unary_unary(TRACE_EXPORT)(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for port in (sp.http_port, sp.pyroscope_port, sp.admin_port):
            plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
                plain.request("GET", "/health")
                plain.getresponse().read()
            plain.close()
        assert grpc_exp.export(finished_spans("over-grpc", 2)) == SpanExportResult.SUCCESS
        assert sp.get("/health")["status"] == "ok"

        # a keep-alive connection opened before the certificates change
        kept = http.client.HTTPSConnection("127.0.0.1", sp.admin_port, timeout=10,
                                           context=client_context(ca))
        kept.request("GET", "/health")
        assert kept.getresponse().read()
        assert served_serial(sp.http_port, ca) == server.serial
        renewed = ca.issue("renewed")
        for src, dst in ((renewed.key, server.key), (renewed.cert, server.cert)):
            tmp = dst.with_suffix(".new")
            shutil.copy(src, tmp)
            tmp.rename(dst)  # as cert-manager and most tools replace files: atomically
        for port in (sp.http_port, sp.pyroscope_port, sp.admin_port):
            wait_until(lambda port=port: served_serial(port, ca) == renewed.serial,
                       timeout=10)
        # gRPC takes the new certificate at its next handshake: a new channel sees it
        wait_until(lambda: GrpcExporter(
            endpoint=f"127.0.0.1:{sp.grpc_port}", credentials=grpc_credentials(ca),
            timeout=5).export(finished_spans("after-reload", 1)) == SpanExportResult.SUCCESS,
            timeout=15)
        kept.request("GET", "/health")  # the connection from before still works
        assert kept.getresponse().status == 200
        kept.close()
        assert '"tls_reloaded"' in sp.logs()
        # the CLI asks the admin API over https, trusting the CA it is given
        cli = [sys.executable, "-m", "pipeline.cli", "top", "--admin",
               f"https://127.0.0.1:{sp.admin_port}", "--format", "json", "--method", "all"]
        top = subprocess.run([*cli, "--cacert", str(ca.path)], capture_output=True,
                             text=True, timeout=60)
        assert top.returncode == 0, top.stderr
        assert {s["service"] for s in json.loads(top.stdout)} >= {"over-grpc"}
        untrusted = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
        assert sp.stop() == 0

    def test_mutual_tls_refuses_missing_and_expired_client_certificates(
            self, tmp_path: Path) -> None:
        ca = CertAuthority(tmp_path / "pki")
        server = ca.issue("server")
        good = ca.issue("client", server=False)
        expired = ca.issue("old-client", server=False, expired=True)
        stranger = CertAuthority(tmp_path / "other", name="other CA").issue(
            "stranger", server=False)
        sp = SpanprofProcess(tmp_path / "sp", config_text=CONFIG.format(
            tls=tls_yaml(server, client_ca=ca.path), admin_tls=tls_yaml(server)))
        sp.admin_ssl = client_context(ca)
        sp.start()
        target = f"127.0.0.1:{sp.grpc_port}"
        https = f"https://127.0.0.1:{sp.http_port}/v1/traces"
        refused: list[tuple[str, Any]] = []
        for client, name in ((None, "none"), (expired, "expired"), (stranger, "stranger")):
            # (timeout: a refused handshake is retried until then; 1 s is ample for a
            # loopback handshake, and what got through would be stored: checked below)
            refused.append((f"grpc-{name}", GrpcExporter(
                endpoint=target, credentials=grpc_credentials(ca, client), timeout=1)))
            refused.append((f"http-{name}", HttpExporter(
                endpoint=https, certificate_file=str(ca.path), timeout=1,
                client_key_file=str(client.key) if client else None,
                client_certificate_file=str(client.cert) if client else None)))
        # all at once, each waiting out its retries
        results = dict(zip([n for n, _ in refused], side_by_side(
            *(lambda n=n, e=e: e.export(finished_spans(n, 1)) for n, e in refused)),
            strict=True))
        assert results == {n: SpanExportResult.FAILURE for n, _ in refused}
        g = GrpcExporter(endpoint=target, credentials=grpc_credentials(ca, good), timeout=10)
        assert g.export(finished_spans("grpc-good", 2)) == SpanExportResult.SUCCESS
        h = HttpExporter(endpoint=https, certificate_file=str(ca.path), timeout=10,
                         client_key_file=str(good.key), client_certificate_file=str(good.cert))
        assert h.export(finished_spans("http-good", 3)) == SpanExportResult.SUCCESS
        wait_until(lambda: stored(sp, "grpc-good") == 2 and stored(sp, "http-good") == 3)
        time.sleep(0.5)  # anything refused would have been flushed by now too
        services = {s["service"] for s in sp.get("/api/v1/spans?limit=1000&method=all")["spans"]}
        assert services == {"grpc-good", "http-good"}
        assert sp.stop() == 0

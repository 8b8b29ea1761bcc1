"""The ``tls:`` key of every listener, checked when the config is loaded: each problem
names its key; the files are loaded once so that a key that does not match its
certificate is found before anything listens."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_text
from pipeline.config.tls import TlsConfig
from pipeline.errors import ConfigError
from pipeline.registry import default_factories
from pipeline.tls import ServerTls
from tests.certs import CertAuthority

FACTORIES = default_factories()

CONFIG = """
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:0", tls: {grpc}}}
      http: {{endpoint: "127.0.0.1:0", tls: {http}}}
  pyroscope: {{endpoint: "127.0.0.1:0", tls: {http}}}
exporters:
  debug: {{}}
service:
  admin: {{endpoint: "127.0.0.1:0", tls: {http}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [debug]}}
    profiles: {{receivers: [otlp, pyroscope], exporters: [debug]}}
"""


def problems(grpc: str, http: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_text(CONFIG.format(grpc=grpc, http=http), FACTORIES, env={})
    return list(err.value.problems)


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CertAuthority, str, str]:
    ca = CertAuthority(tmp_path)
    s = ca.issue("server")
    return ca, str(s.cert), str(s.key)


def test_good_files_load(pki: tuple[CertAuthority, str, str]) -> None:
    ca, cert, key = pki
    tls = f"{{cert_file: {cert}, key_file: {key}, client_ca_file: {ca.path}}}"
    cfg = load_text(CONFIG.format(grpc=tls, http=tls.replace("}", ", min_version: '1.3'}")),
                    FACTORIES, env={})
    assert cfg.service.admin.tls.min_version == "1.3"
    assert cfg.receivers["otlp"].protocols.grpc.tls.client_ca_file == str(ca.path)


def test_each_problem_names_its_key(pki: tuple[CertAuthority, str, str],
                                    tmp_path: Path) -> None:
    ca, cert, key = pki
    other = ca.issue("other")
    got = problems(grpc=f"{{cert_file: {cert}, min_version: '1.3'}}",
                   http=f"{{cert_file: {cert}, key_file: {other.key}}}")
    text = "\n".join(got)
    assert "receivers.otlp.protocols.grpc.tls.key_file: required when tls is set" in text
    # the key of another certificate: refused when loaded, under each listener's key
    for where in ("receivers.otlp.protocols.http.tls", "receivers.pyroscope.tls",
                  "service.admin.tls"):
        assert any(p.startswith(f"{where}: cannot use {cert}") for p in got), got
    missing = tmp_path / "nope.pem"
    got = problems(grpc=f"{{cert_file: {cert}, key_file: {key}, min_version: '1.3'}}",
                   http=f"{{cert_file: {cert}, key_file: {key}, client_ca_file: {missing}}}")
    text = "\n".join(got)
    assert "receivers.otlp.protocols.grpc.tls.min_version: the gRPC listener cannot " \
           "refuse TLS 1.2" in text
    assert f"service.admin.tls.client_ca_file: cannot read {missing}" in text


def test_a_file_that_is_not_pem(pki: tuple[CertAuthority, str, str], tmp_path: Path) -> None:
    _, cert, _ = pki
    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    got = problems(grpc=f"{{cert_file: {cert}, key_file: {junk}}}",
                   http=f"{{cert_file: {junk}, key_file: {junk}}}")
    assert any(p.startswith("receivers.otlp.protocols.grpc.tls: cannot use") for p in got)
    assert any(p.startswith("receivers.pyroscope.tls: cannot use") for p in got)


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def info(self, event: str, **kw: object) -> None:
        self.events.append(event)

    warning = info


def test_a_reload_that_fails_keeps_the_served_certificate(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path)
    s = ca.issue("server")
    log = Log()
    tls = ServerTls(TlsConfig(cert_file=str(s.cert), key_file=str(s.key)), "x.tls", log)
    first = tls._current
    assert not tls.reload_if_changed()  # nothing changed
    renewed = ca.issue("renewed")
    s.cert.write_bytes(renewed.cert.read_bytes())  # the key is not there yet: mismatch
    assert not tls.reload_if_changed()
    assert tls._current is first and tls.take_update() is None
    assert log.events == ["tls_reload_failed"]
    s.key.write_bytes(renewed.key.read_bytes())
    assert tls.reload_if_changed()
    assert tls._current is not first
    key, cert, ca_bytes = tls.take_update() or (b"", b"", None)
    assert cert == renewed.cert.read_bytes() and ca_bytes is None
    assert tls.take_update() is None  # gRPC's fetcher gets it once
    assert log.events == ["tls_reload_failed", "tls_reloaded"]

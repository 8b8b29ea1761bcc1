"""The Kafka client's tls: and auth: keys (issue #17): each problem names its key, the
password never shows in an error, and what aiokafka is given for each combination."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from pipeline.config import load_text
from pipeline.config.tls import ClientTls
from pipeline.errors import ConfigError
from pipeline.kafka.security import KafkaAuth, Sasl, client_settings
from pipeline.log import redact
from pipeline.registry import default_factories
from tests.certs import CertAuthority

FACTORIES = default_factories()
CONFIG = """
receivers:
  otlp: {protocols: {grpc: {endpoint: "127.0.0.1:0"}}}
exporters:
  kafka:
    brokers: ["127.0.0.1:9093"]
    %s
service:
  pipelines:
    traces: {receivers: [otlp], exporters: [kafka]}
"""


def problems(security: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_text(CONFIG % security, FACTORIES, env={})
    return [redact(p) for p in err.value.problems]


def test_each_problem_names_its_key(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path)
    client = ca.issue("client", server=False)
    assert problems(f"tls: {{cert_file: {client.cert}}}") == [
        "exporters.kafka.tls: cert_file and key_file go together"]
    assert problems(f"tls: {{ca_file: {tmp_path / 'none.pem'}}}") == [
        f"exporters.kafka.tls.ca_file: cannot read {tmp_path / 'none.pem'}"]
    got = problems('auth: {sasl: {username: u, password: "", mechanism: PLAIN}}')
    assert got == ["exporters.kafka.auth.sasl: username and password are required"]
    got = problems('auth: {sasl: {username: u, password: "pw-kafka-123", mechanism: MD5}}')
    assert any(p.startswith("exporters.kafka.auth.sasl.mechanism") for p in got), got
    assert all("pw-kafka-123" not in p for p in got)


def test_what_aiokafka_is_given(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path)
    sasl = KafkaAuth(Sasl("u", "p", "SCRAM-SHA-512"))
    assert client_settings(None, None) == {}
    plain_sasl = client_settings(None, sasl)
    assert plain_sasl["security_protocol"] == "SASL_PLAINTEXT"
    assert plain_sasl["sasl_mechanism"] == "SCRAM-SHA-512"
    both = client_settings(ClientTls(ca_file=str(ca.path)), sasl)
    assert both["security_protocol"] == "SASL_SSL"
    assert both["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    skip = client_settings(ClientTls(insecure_skip_verify=True), None)
    assert skip["security_protocol"] == "SSL"
    assert skip["ssl_context"].verify_mode == ssl.CERT_NONE

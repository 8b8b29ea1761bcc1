"""Secrets never leave (issue #17): an auth token, the ClickHouse password and a Kafka SASL
password given in a config are not in `spanprof validate`'s output (a config with errors
beside them, and a good one), nor, once running, in /metrics, /health, the admin API's
answers (a 401 included) or the logs, even after a client sent a wrong token."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, SpanprofProcess

pytestmark = pytest.mark.e2e
TOKEN = "tok-secret-inline-c0ffee1234"
CH_PASSWORD = "ch-secret-pw-5e6f7a"
KAFKA_PASSWORD = "kafka-secret-pw-9b8c"
WRONG = "tok-wrong-but-plausible-778899"

CONFIG = """
extensions:
  tenantauth: {{tokens: {{"${{env:SP_TOKEN}}": team-a}}, admin_tenants: [team-a]}}
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{grpc_port}", auth: {{authenticator: tenantauth}}}}
exporters:
  clickhouse: {{endpoint: "chdb://{data}", password: "${{env:SP_CH_PW}}"}}
  kafka:
    brokers: ["127.0.0.1:1"]
    auth: {{sasl: {{username: u, password: "${{env:SP_KAFKA_PW}}"}}}}
service:
  extensions: [tenantauth]
  admin: {{endpoint: "127.0.0.1:{admin_port}", auth: {{authenticator: tenantauth}}}}
  telemetry: {{logs: {{encoding: json}}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [clickhouse%s]}}
"""
SECRETS = (TOKEN, CH_PASSWORD, KAFKA_PASSWORD)


def env() -> dict[str, str]:
    return dict(os.environ, SP_TOKEN=TOKEN, SP_CH_PW=CH_PASSWORD, SP_KAFKA_PW=KAFKA_PASSWORD)


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", "-c", str(path)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)


def fetch(url: str, token: str | None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                 if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(resp.read().decode()) + str(resp.headers)
    except urllib.error.HTTPError as err:
        return f"{err.code} {err.read().decode()} {err.headers}"


def test_no_secret_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = SpanprofProcess(tmp_path / "sp", config_text=CONFIG % "")
    out = validate(good.config)
    assert out.returncode == 0, out.stderr
    # errors beside the secrets: a bad key next to each, a wrong tenant name
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.config.read_text().replace("team-a", "team a!").replace(
        "brokers:", "bogus: 1\n    brokers:") + "\n")
    out2 = validate(bad)
    assert out2.returncode == 2 and "exporters.kafka.bogus: unknown key" in out2.stderr
    for s in SECRETS:
        assert s not in out.stdout + out.stderr + out2.stdout + out2.stderr

    for k, v in env().items():
        monkeypatch.setenv(k, v)  # the process inherits them
    good.start()
    seen = "".join([fetch(good.admin + "/health", None),
                    fetch(good.admin + "/api/v1/spans", WRONG),
                    fetch(good.admin + "/api/v1/spans?limit=5", TOKEN),
                    fetch(good.admin + "/metrics", TOKEN)])
    assert "spanprof_admin_unauthenticated_requests_total 1" in seen
    assert good.stop() == 0
    for s in (*SECRETS, WRONG):
        assert s not in seen + good.logs(), s

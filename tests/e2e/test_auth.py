"""Tokens on every door of a running ``spanprof run`` (issue #17): the ``tenantauth``
extension named by the OTLP gRPC and HTTP receivers, Pyroscope and the admin API. The real
Python SDK app (OpenTelemetry exporters with a bearer header, the Pyroscope SDK with basic
auth) is stored with its token and refused without it or with a wrong one (nothing stored,
refusals counted); the admin API and the CLI want a token too (``/health`` stays open for
probes); a token added to the file is accepted once the file is reloaded; no token
appears in the logs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import ROOT, SpanprofProcess, side_by_side, wait_until

pytestmark = pytest.mark.e2e
APP = ROOT / "tests" / "e2e" / "sdk_app.py"
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
TEAM_A = "tok-team-a-3f9c2b7d81e4a6c0"
TEAM_B = "tok-team-b-8d1e5a2f0c7b9e34"
LATER = "tok-team-c-55aa1f0e9d2c7b61"

# SpanprofProcess fills the ports and data directory ({...}): literal braces doubled
CONFIG = """
extensions:
  tenantauth:
    tokens_file: TOKENS_FILE
    reload_interval: 100ms
    admin_tenants: [team-a]
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{grpc_port}
        auth: {{authenticator: tenantauth}}
      http:
        endpoint: 127.0.0.1:{http_port}
        auth: {{authenticator: tenantauth}}
  pyroscope:
    endpoint: 127.0.0.1:{pyroscope_port}
    auth: {{authenticator: tenantauth}}
connectors:
  spancorrelator:
    grace: 1s
    flush_interval: 200ms
exporters:
  clickhouse:
    endpoint: chdb://{data}
    flush_interval: 100ms
service:
  extensions: [tenantauth]
  admin:
    endpoint: 127.0.0.1:{admin_port}
    auth: {{authenticator: tenantauth}}
  telemetry:
    logs:
      encoding: json
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [clickhouse, spancorrelator]
    profiles:
      receivers: [otlp, pyroscope]
      exporters: [clickhouse, spancorrelator]
    attributions:
      receivers: [spancorrelator]
      exporters: [clickhouse]
"""


def admin_get(sp: SpanprofProcess, path: str, token: str | None) -> tuple[int, Any]:
    req = urllib.request.Request(sp.admin + path, headers={
        "Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if path.startswith("/api") else body.decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers


def counter(sp: SpanprofProcess, series: str) -> int:
    status, text = admin_get(sp, "/metrics", TEAM_A)
    assert status == 200
    return sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(series))


def run_app(sp: SpanprofProcess, protocol: str, service: str, token: str) -> str:
    endpoint = sp.http_url if protocol == "http" else sp.grpc_target
    proc = subprocess.run(
        [sys.executable, str(APP), protocol, endpoint, sp.pyroscope_url, service, "2",
         "--crunch-ms", "300", "--idle-ms", "50", "--upload-interval", "1",
         "--token", token], cwd=ROOT, capture_output=True, text=True, timeout=90)
    return proc.stdout + proc.stderr


def services(sp: SpanprofProcess, token: str = TEAM_A) -> dict[str, int]:
    """CPU per service of the token's tenant."""
    status, body = admin_get(sp, "/api/v1/spans?limit=1000&method=all&order=duration", token)
    assert status == 200
    out: dict[str, int] = {}
    for s in body["spans"]:
        out[s["service"]] = out.get(s["service"], 0) + s["cpu_ns"]
    return out


class TestAuth:
    def test_tokens_on_every_door(self, tmp_path: Path) -> None:
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(f"{TEAM_A}: team-a\n{TEAM_B}: team-b\n")
        # (the placeholders in braces are SpanprofProcess's, hence no flow-style braces)
        text = CONFIG.replace("TOKENS_FILE", str(tokens)).replace(
            "auth: {{authenticator: tenantauth}}", "auth:\n          authenticator: tenantauth")
        sp = SpanprofProcess(tmp_path / "sp", config_text=text)
        sp.start()  # its health check: /health needs no token

        # the admin API: 401 without a token or with a wrong one, answered with one
        for token in (None, "tok-not-a-known-one-0000"):
            status, headers = admin_get(sp, "/api/v1/spans", token)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert admin_get(sp, "/api/v1/spans", TEAM_B)[0] == 200

        # the real SDK app with its token: spans over gRPC and HTTP, samples by basic auth
        side_by_side(lambda: run_app(sp, "grpc", "svc-grpc", TEAM_A),
                      lambda: run_app(sp, "http", "svc-http", TEAM_B))
        wait_until(lambda: services(sp).get("svc-grpc", 0) > 0
                   and services(sp, TEAM_B).get("svc-http", 0) > 0, timeout=60)
        refused_before = counter(sp, "spanprof_receiver_unauthenticated_requests_total")

        # a wrong token and none: refused at every receiver, nothing stored
        side_by_side(*(lambda p=protocol, t=token: run_app(sp, p, f"svc-refused-{p}", t)
                        for protocol, token in (("grpc", "tok-wrong-wrong-wrong-1"),
                                                ("http", ""))))
        refused_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            grpc.insecure_channel(sp.grpc_target).unary_unary(TRACE_EXPORT)(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # the CLI: refused without a token, answered with SPANPROF_TOKEN or --token (run
        # meanwhile: it asserts below)
        cli = [sys.executable, "-m", "pipeline.cli", "top", "--admin", sp.admin,
               "--format", "json", "--method", "all"]
        with ThreadPoolExecutor(2) as pool:
            no_run = pool.submit(subprocess.run, cli, capture_output=True, text=True,
                                 timeout=60)
            yes_run = pool.submit(subprocess.run, [*cli, "--token", TEAM_A],
                                  capture_output=True, text=True, timeout=60)
            # anything let through would be stored a second after the apps ended
            time.sleep(max(0.0, refused_at + 1.0 - time.monotonic()))
            assert not [s for token in (TEAM_A, TEAM_B) for s in services(sp, token)
                        if s.startswith("svc-refused")]
            no, yes = no_run.result(), yes_run.result()
        # each app sent spans and at least one profile push, all refused and counted
        assert counter(sp, "spanprof_receiver_unauthenticated_requests_total") >= \
            refused_before + 5

        assert no.returncode != 0 and "401" in no.stderr
        assert yes.returncode == 0, yes.stderr
        assert {s["service"] for s in json.loads(yes.stdout)} == {"svc-grpc"}  # team-a's

        # a token added to the file works once it is reloaded; a removed one stops
        assert admin_get(sp, "/api/v1/spans", LATER)[0] == 401
        tokens.write_text(f"{TEAM_A}: team-a\n{LATER}: team-c\n")
        wait_until(lambda: admin_get(sp, "/api/v1/spans", LATER)[0] == 200, timeout=10)
        assert admin_get(sp, "/api/v1/spans", TEAM_B)[0] == 401

        assert sp.stop() == 0
        logs = sp.logs()
        for token in (TEAM_A, TEAM_B, LATER):
            assert token not in logs
        assert "auth_tokens_reloaded" in logs

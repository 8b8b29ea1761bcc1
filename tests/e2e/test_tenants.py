"""Tenants end to end on a running ``spanprof run`` (issue #17's acceptance): two teams run
the real Python SDK app (OpenTelemetry exporters with a bearer token, the Pyroscope SDK with
basic auth) with the SAME trace and span ids, each with its own token. Each sees exactly its
own spans and CPU through the admin API and the CLI; the other's samples never land on its
spans (the apps burn different amounts of CPU, so a mix would show); no query parameter,
header or SQL trick reads the other's rows; only the admin tenant reads /metrics, where
every tenant has its own label."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import ROOT, SpanprofProcess, wait_until
from tests.e2e.otlp_clients import profiles_stub, traces_stub
from tests.e2e.test_auth import APP, CONFIG, TEAM_A, TEAM_B

pytestmark = pytest.mark.e2e
OPS = "tok-ops-ops-77aa1f0e9d2c7b61"
SEED = 20261206


def get(sp: SpanprofProcess, path: str, token: str | None,
        headers: dict[str, str] | None = None) -> tuple[int, Any]:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(sp.admin + path, headers={**h, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if path.startswith("/api") else body.decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def run_app(sp: SpanprofProcess, protocol: str, service: str, token: str,
            crunch_ms: int) -> dict[str, Any]:
    endpoint = sp.http_url if protocol == "http" else sp.grpc_target
    proc = subprocess.run(
        [sys.executable, str(APP), protocol, endpoint, sp.pyroscope_url, service, "2",
         "--crunch-ms", str(crunch_ms), "--idle-ms", "50", "--upload-interval", "1",
         "--token", token, "--id-seed", str(SEED)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def spans(sp: SpanprofProcess, token: str, query: str = "") -> list[dict[str, Any]]:
    status, body = get(sp, f"/api/v1/spans?limit=1000&method=all&order=duration{query}",
                       token)
    assert status == 200, body
    return body["spans"]  # type: ignore[no-any-return]


def cli_top(sp: SpanprofProcess, *extra: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``spanprof top`` against ``sp``'s admin API, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "top", "--admin", sp.admin,
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def crunch_cpu(rows: list[dict[str, Any]], crunch: list[list[str]]) -> int:
    ids = {sid for _, sid in crunch}
    return sum(r["cpu_ns"] for r in rows if r["span_id"] in ids)


class TestTenants:
    def test_two_tenants_same_ids_see_their_own(self, tmp_path: Path) -> None:
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(f"{TEAM_A}: team-a\n{TEAM_B}: team-b\n{OPS}: ops\n")
        text = CONFIG.replace("TOKENS_FILE", str(tokens)).replace(
            "admin_tenants: [team-a]", "admin_tenants: [ops]").replace(
            "auth: {{authenticator: tenantauth}}", "auth:\n          authenticator: tenantauth")
        sp = SpanprofProcess(tmp_path / "sp", config_text=text)
        sp.start()
        try:
            self._check(sp)
        finally:
            sp.stop()

    def _check(self, sp: SpanprofProcess) -> None:
        a = run_app(sp, "grpc", "svc-a", TEAM_A, crunch_ms=400)
        b = run_app(sp, "http", "svc-b", TEAM_B, crunch_ms=100)
        assert a["crunch"] == b["crunch"] and a["idle"] == b["idle"]  # the very same ids
        wait_until(lambda: crunch_cpu(spans(sp, TEAM_A), a["crunch"]) > 0
                   and crunch_cpu(spans(sp, TEAM_B), b["crunch"]) > 0, timeout=90)

        # each sees its own service only, and CPU near what its own app burnt: the other
        # tenant's samples, labelled with the same span ids, never joined its spans
        rows_a, rows_b = spans(sp, TEAM_A), spans(sp, TEAM_B)
        assert {r["service"] for r in rows_a} == {"svc-a"}
        assert {r["service"] for r in rows_b} == {"svc-b"}
        burnt_a = sum(a["crunch_cpu_ns"]) + sum(a["crunch_wait_ns"])
        burnt_b = sum(b["crunch_cpu_ns"]) + sum(b["crunch_wait_ns"])
        cpu_a, cpu_b = crunch_cpu(rows_a, a["crunch"]), crunch_cpu(rows_b, b["crunch"])
        # b burnt a quarter of a's CPU: a's samples on b's spans would more than double
        # b's figure (a's own figure is checked loosely: the Python SDK's sampler may put
        # some of the app's warm-up burn, 200 ms outside any span, on the first span)
        assert cpu_b < burnt_b + burnt_a / 2, (cpu_a, cpu_b, burnt_a, burnt_b)
        assert burnt_a / 2 < cpu_a < burnt_a * 1.5 + 250_000_000, (cpu_a, cpu_b, burnt_a)

        # one trace, the same id for both: each reads its own spans of it
        tid = a["crunch"][0][0]
        for token, service in ((TEAM_A, "svc-a"), (TEAM_B, "svc-b")):
            status, body = get(sp, f"/api/v1/traces/{tid}", token)
            assert status == 200 and {s["service"] for s in body["spans"]} == {service}

        # tricks: a tenant in the query string is ignored, a filter on the other's service
        # finds nothing, X-Scope-OrgID beside a token naming another tenant is refused, and
        # SQL in a parameter or the header is data or refused, never SQL
        assert {r["service"] for r in spans(sp, TEAM_A, "&tenant=team-b")} == {"svc-a"}
        assert spans(sp, TEAM_A, "&service=svc-b") == []
        assert spans(sp, TEAM_A, "&service=x%27%20OR%201%3D1%20--") == []
        assert get(sp, "/api/v1/spans", TEAM_A, {"X-Scope-OrgID": "team-b"})[0] == 403
        assert get(sp, "/api/v1/spans", TEAM_A, {"X-Scope-OrgID": "x' OR 1=1 --"})[0] == 400
        assert get(sp, "/api/v1/spans", None, {"X-Scope-OrgID": "team-b"})[0] == 401
        status, body = get(sp, "/api/v1/spans", TEAM_A, {"X-Scope-OrgID": "team-a"})
        assert status == 200 and {r["service"] for r in body["spans"]} == {"svc-a"}

        # the CLI: the token's tenant
        for token, mine, theirs in ((TEAM_A, "svc-a", "svc-b"), (TEAM_B, "svc-b", "svc-a")):
            out = cli_top(sp, "--token", token, "--method", "all", "--limit", "100",
                          "--format", "json")
            assert out.returncode == 0, out.stderr
            services = {r["service"] for r in json.loads(out.stdout)}
            assert services == {mine}, (services, theirs)

        # /metrics: the admin tenant only; each tenant counted under its own label
        assert get(sp, "/metrics", TEAM_A)[0] == 403
        status, text = get(sp, "/metrics", OPS)
        assert status == 200
        for tenant in ("team-a", "team-b"):
            assert f'spanprof_tenant_accepted_spans_total{{tenant="{tenant}"}}' in text
        assert TEAM_A not in text and TEAM_B not in text


class TestOrgIdWithoutAuth:
    def test_x_scope_orgid_names_the_tenant(self, spanprof: SpanprofProcess) -> None:
        """Auth off (the embedded default): two tenants named by X-Scope-OrgID send the same
        trace and span ids with different CPU; the CLI's --tenant (SPANPROF_TENANT) reads
        each one's, and without it the default tenant, which has nothing."""
        spanprof.start()
        tid, sid = bytes(range(1, 17)), bytes(range(1, 9))
        t0 = (int(time.time()) - 60) * 1_000_000_000
        channel = grpc.insecure_channel(spanprof.grpc_target)
        for tenant, ms in (("team-x", 30), ("team-y", 7)):
            req = tps.ExportTraceServiceRequest()
            rs = req.resource_spans.add()
            rs.resource.attributes.append(KeyValue(key="service.name",
                                                   value=AnyValue(string_value=tenant)))
            rs.scope_spans.add().spans.add(trace_id=tid, span_id=sid, name="op",
                                           start_time_unix_nano=t0,
                                           end_time_unix_nano=t0 + 100_000_000)
            b = ProfileBuilder()
            b.sample(["work"], ms * 1_000_000, tid, sid, service=tenant)
            md = (("x-scope-orgid", tenant),)
            traces_stub(channel).Export(req, timeout=30, metadata=md)
            profiles_stub(channel).Export(b.build(), timeout=30, metadata=md)

        def top(*extra: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
            out = cli_top(spanprof, "--format", "json", *extra, env=env)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)  # type: ignore[no-any-return]

        wait_until(lambda: all(r["cpu_ns"] for t in ("team-x", "team-y")
                               for r in top("--tenant", t) or [{"cpu_ns": 0}]), timeout=60)
        (x,) = top("--tenant", "team-x")
        (y,) = top(env={"SPANPROF_TENANT": "team-y"})
        assert (x["service"], x["cpu_ns"]) == ("team-x", 30_000_000)
        assert (y["service"], y["cpu_ns"]) == ("team-y", 7_000_000)
        assert top() == []  # the default tenant sent nothing
        bad = cli_top(spanprof, "--tenant", "x' OR 1=1 --")
        assert bad.returncode != 0 and "400" in bad.stderr

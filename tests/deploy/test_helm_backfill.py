"""The chart's backfill Job and re-attribution CronJob (issue #15): rendered only when asked,
on the correlator's config, Secrets and ClickHouse password, one run at a time, refused on
the embedded engine; and the command line they render is one `spanprof backfill` accepts
(run with --dry-run on the rendered correlator config, its ClickHouse server swapped for the
embedded engine: no server runs here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_helm import helm_template, merged, pipeline_text, pod_spec, render
from tests.helm_tool import HelmUnavailable, helm_binary

ROOT = Path(__file__).resolve().parents[2]
TLS = {"admin": {"tls": {"enabled": True, "secretName": "admin-tls"}},
       "clickhouse": {"passwordSecret": {"name": "ch-password"}}}
CRON = {"backfill": {"cronJob": {"enabled": True}}}


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        return helm_binary()
    except HelmUnavailable as err:
        pytest.fail(str(err), pytrace=False)


def job_pods(docs: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """The pod spec of each backfill document, by kind."""
    out = {}
    for (kind, _), d in docs.items():
        if kind == "Job":
            out[kind] = d["spec"]["template"]["spec"]
        elif kind == "CronJob":
            out[kind] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return out


class TestBackfillTemplates:
    def test_nothing_by_default(self, helm: str, tmp_path: Path) -> None:
        docs = render(helm, tmp_path)
        assert not [k for k in docs if k[0] in ("Job", "CronJob")]

    def test_the_cronjob_reattributes_the_hour_before_last_one_run_at_a_time(
            self, helm: str, tmp_path: Path) -> None:
        docs = render(helm, tmp_path, CRON)
        cron = docs[("CronJob", "reattribute")]["spec"]
        assert cron["concurrencyPolicy"] == "Forbid"
        assert cron["schedule"] == "7 * * * *"
        pod = job_pods(docs)["CronJob"]
        assert pod["restartPolicy"] == "Never"
        (c,) = pod["containers"]
        assert c["args"] == ["backfill", "reattribute", "--range", "2h..1h", "-c",
                             "/etc/spanprof/pipeline.yaml", "--format", "json",
                             "--workers", "2"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True

    def test_the_correlators_config_secrets_and_password(self, helm: str,
                                                         tmp_path: Path) -> None:
        """The Job mounts what the correlator mounts: its ConfigMap, its Secrets (here the
        admin API's certificate, which its config names) at the same paths, and gets the
        ClickHouse password the same way."""
        values = merged(TLS, merged(CRON, {"backfill": {"job": {
            "enabled": True, "args": ["kafka", "--topic", "otlp_spans", "--since", "6h"]}}}))
        docs = render(helm, tmp_path, values)
        corr = pod_spec(docs, "correlator")
        (cc,) = corr["containers"]
        pods = job_pods(docs)
        assert set(pods) == {"Job", "CronJob"}
        for pod in pods.values():
            (c,) = pod["containers"]
            assert c["env"] == cc["env"]
            assert any(e["name"] == "CLICKHOUSE_PASSWORD" for e in c["env"])
            assert c["volumeMounts"] == cc["volumeMounts"]
            assert pod["volumes"] == corr["volumes"]
            assert any("secret" in v for v in pod["volumes"])  # the admin certificate
            assert c["image"] == cc["image"]
            assert pod["securityContext"] == corr["securityContext"]
        assert pods["Job"]["containers"][0]["args"][:6] == \
            ["backfill", "kafka", "--topic", "otlp_spans", "--since", "6h"]

    def test_a_job_is_named_after_its_arguments(self, helm: str, tmp_path: Path) -> None:
        def name(args: list[str]) -> str:
            docs = render(helm, tmp_path, {"backfill": {"job": {"enabled": True,
                                                               "args": args}}})
            (got,) = [k[1] for k in docs if k[0] == "Job"]
            return got

        a = name(["reattribute", "--range", "2h..1h"])
        assert a == name(["reattribute", "--range", "2h..1h"])
        assert a != name(["reattribute", "--range", "3h..2h"])
        assert a.startswith("backfill-")

    def test_refused(self, helm: str, tmp_path: Path) -> None:
        """No arguments; the embedded engine; no correlator: each a clear error."""
        for values, words in (
                ({"backfill": {"job": {"enabled": True}}}, "backfill.job.args"),
                (merged(CRON, {"correlator": {"enabled": False},
                               "clickhouse": {"endpoint": "chdb:///data"}}),
                 "backfill: clickhouse.endpoint"),
                (merged(CRON, {"correlator": {"enabled": False}}), "correlator.enabled")):
            res = helm_template(helm, tmp_path, values, tokens_secret="spanprof-tokens")
            assert res.returncode != 0, values
            assert words in res.stderr, res.stderr

    def test_the_rendered_command_runs(self, helm: str, tmp_path: Path) -> None:
        """The CronJob's argv, on the rendered correlator config (its ClickHouse server
        swapped for the embedded engine), is accepted by spanprof backfill: a dry run
        plans an empty store and prints its JSON summary."""
        docs = render(helm, tmp_path, CRON)
        cfg = yaml.safe_load(pipeline_text(docs, "correlator"))
        for ex in cfg["exporters"].values():
            if isinstance(ex, dict) and "endpoint" in ex and \
                    str(ex["endpoint"]).startswith("http://clickhouse"):
                ex["endpoint"] = f"chdb://{tmp_path}/ch"
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump(cfg))
        (c,) = job_pods(docs)["CronJob"]["containers"]
        argv = [str(path) if a == "/etc/spanprof/pipeline.yaml" else a for a in c["args"]]
        res = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv, "--dry-run"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "CLICKHOUSE_PASSWORD": ""})
        assert res.returncode == 0, res.stderr[-3000:]
        summary = json.loads(res.stdout)
        assert summary["dry_run"] is True

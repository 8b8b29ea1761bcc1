"""The chart's backfill Job and re-attribution CronJob (issue #15): rendered only when asked,
on the correlator's config, Secrets and ClickHouse password (the same helpers render both,
and the other templates' output is the same with them on), one run at a time, named within
Kubernetes' limits so that an upgrade never patches a Job's pod, each run its own job in the
ledger (a retried pod resumes it), refused on the embedded engine; and the command lines they
render are ones `spanprof backfill` accepts and runs as they are: a dry run of each, and a
real files Job, CronJob re-attribution and their reruns, on the rendered correlator config
with its ClickHouse server swapped for the embedded engine (no server runs here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_helm import (
    CHART,
    container,
    helm_template,
    merged,
    pipeline_text,
    pod_spec,
    render,
)
from tests.helm_tool import HelmUnavailable, helm_binary

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "/etc/spanprof/pipeline.yaml"  # where the pods mount the correlator's ConfigMap
TLS = {"admin": {"tls": {"enabled": True, "secretName": "admin-tls"}},
       "clickhouse": {"passwordSecret": {"name": "ch-password"}}}
CRON = {"backfill": {"cronJob": {"enabled": True}}}
JOB_ARGS = ["kafka", "--topic", "otlp_spans", "--since", "6h"]
JOB = {"backfill": {"job": {"enabled": True, "args": JOB_ARGS}}}
# the downward API's value for the CronJob's pods: the Job a scheduled run created
CRON_RUN = "rel-spanprof-reattribute-29412367"


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


def backfill_container(docs: dict[tuple[str, str], Any], kind: str) -> Any:
    (c,) = job_pods(docs)[kind]["containers"]
    return c


def job_name(docs: dict[tuple[str, str], Any]) -> str:
    (name,) = [n for kind, n in docs if kind == "Job"]
    return name


def option(args: list[str], name: str) -> list[str]:
    """Every value given to the option ``name`` in an argv."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def kubelet_argv(c: Any, labels: dict[str, str], env: dict[str, str]) -> list[str]:
    """The container's argv as the kubelet runs it: ``$(VAR)`` of a variable of the
    container's env replaced by its value (a Secret's from ``env``, a pod label's from
    ``labels``), ``$$`` an escaped ``$``, anything else left as written."""
    values: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            values[e["name"]] = env[e["name"]]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
            assert m, path
            values[e["name"]] = labels.get(m[1], "")

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return values.get(m[1], m[0])

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, a) for a in c["args"]]


def local_config(docs: dict[tuple[str, str], Any], tmp: Path) -> Path:
    """The rendered correlator config with its ClickHouse server swapped for the embedded
    engine under ``tmp`` (the one edit: no server runs here)."""
    cfg = yaml.safe_load(pipeline_text(docs, "correlator"))
    swapped = 0
    for ex in cfg["exporters"].values():
        if isinstance(ex, dict) and str(ex.get("endpoint", "")).startswith("http://clickhouse"):
            ex["endpoint"] = f"chdb://{tmp}/ch"
            swapped += 1
    assert swapped == 1
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_pod(c: Any, config: Path, job: str, *extra: str) -> dict[str, Any]:
    """The container's command line, as the kubelet would run it in a pod of the Job
    ``job``, with the config mounted at ``config``: its JSON summary (it must succeed)."""
    argv = [str(config) if a == CONFIG else a
            for a in kubelet_argv(c, {"job-name": job}, {"CLICKHOUSE_PASSWORD": ""})]
    assert argv[0] == "backfill"
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv, *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CLICKHOUSE_PASSWORD": ""})
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(json.loads(res.stdout))


class TestBackfillTemplates:
    def test_nothing_by_default(self, helm: str, tmp_path: Path) -> None:
        """Both are off by default: no Job, no CronJob."""
        docs = render(helm, tmp_path)
        assert not [k for k in docs if k[0] in ("Job", "CronJob")]

    def test_the_other_templates_render_the_same(self, helm: str, tmp_path: Path) -> None:
        """With the Secrets, the password and admin auth on, turning both on adds the Job and
        the CronJob and changes nothing else (the correlator's pod wiring is their shared
        helpers)."""
        base = merged(TLS, {"admin": {"auth": {"enabled": True,
                                               "tokensSecret": {"name": "admin-tokens"}}},
                            "imagePullSecrets": [{"name": "registry"}]})
        without = render(helm, tmp_path, base)
        with_both = render(helm, tmp_path, merged(merged(base, CRON), JOB))
        assert {k: d for k, d in with_both.items() if k[0] not in ("Job", "CronJob")} == without
        assert sorted(k[0] for k in set(with_both) - set(without)) == ["CronJob", "Job"]

    def test_lint_strict_with_both(self, helm: str, tmp_path: Path) -> None:
        """helm lint --strict, both on: no error, no warning beyond the defaults' own."""
        f = tmp_path / "values.yaml"
        f.write_text(yaml.safe_dump(merged(merged(CRON, JOB), {"gateway": {"auth": {
            "tokensSecret": {"name": "spanprof-tokens"}}}})))
        res = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(f)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "WARN" not in res.stdout + res.stderr

    def test_the_cronjob_reattributes_the_hour_before_last_one_run_at_a_time(
            self, helm: str, tmp_path: Path) -> None:
        """Hourly at :07, the hour before last, concurrencyPolicy Forbid; each run's ledger
        job is the Job the run created (its pods' job-name label)."""
        docs = render(helm, tmp_path, CRON)
        cron = docs[("CronJob", "reattribute")]["spec"]
        assert cron["concurrencyPolicy"] == "Forbid"
        assert cron["schedule"] == "7 * * * *"
        assert (cron["startingDeadlineSeconds"], cron["successfulJobsHistoryLimit"],
                cron["failedJobsHistoryLimit"]) == (600, 3, 3)
        assert (cron["jobTemplate"]["spec"]["backoffLimit"],
                cron["jobTemplate"]["spec"]["activeDeadlineSeconds"]) == (2, 3300)
        pod = job_pods(docs)["CronJob"]
        assert pod["restartPolicy"] == "Never"
        c = backfill_container(docs, "CronJob")
        assert c["args"] == ["backfill", "reattribute", "--range", "2h..1h",
                             "--job", "$(SPANPROF_JOB)", "-c", CONFIG, "--format", "json",
                             "--workers", "2"]
        assert c["env"] == [{"name": "SPANPROF_JOB", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['job-name']"}}}]
        assert kubelet_argv(c, {"job-name": CRON_RUN}, {})[5] == CRON_RUN
        assert c["securityContext"]["readOnlyRootFilesystem"] is True

    def test_the_job_runs_its_args_once(self, helm: str, tmp_path: Path) -> None:
        """backfill.job: its args, a ledger job id of its own given with --job (the same
        in every pod the Job retries), its limits; no deadline unless one is given."""
        docs = render(helm, tmp_path, merged(JOB, {"backfill": {"workers": 3}}))
        job = docs[("Job", job_name(docs))]["spec"]
        assert (job["backoffLimit"], job["ttlSecondsAfterFinished"]) == (2, 86400)
        assert "activeDeadlineSeconds" not in job
        c = backfill_container(docs, "Job")
        (jid,) = option(c["args"], "--job")
        assert c["args"] == ["backfill", *JOB_ARGS, "--job", jid, "-c", CONFIG,
                             "--format", "json", "--workers", "3"]
        assert re.fullmatch(r"rel-spanprof-backfill-[0-9a-f]{10}", jid)
        assert "env" not in c  # no password Secret, no downward API
        docs = render(helm, tmp_path, merged(JOB, {"backfill": {"job": {
            "activeDeadlineSeconds": 7200}}}))
        assert docs[("Job", job_name(docs))]["spec"]["activeDeadlineSeconds"] == 7200

    def test_the_correlators_config_secrets_and_password(self, helm: str,
                                                         tmp_path: Path) -> None:
        """Both pods mount what the correlator mounts: its ConfigMap, its Secrets (here the
        admin API's certificate, which its config names) at the same paths, and get the
        ClickHouse password the same way; same image, pull Secrets and security contexts."""
        values = merged(merged(TLS, merged(CRON, JOB)), {
            "imagePullSecrets": [{"name": "registry"}], "image": {"tag": "1.2.3"}})
        docs = render(helm, tmp_path, values)
        corr = pod_spec(docs, "correlator")
        cc = container(docs, "correlator")
        pods = job_pods(docs)
        assert set(pods) == {"Job", "CronJob"}
        for kind, pod in pods.items():
            (c,) = pod["containers"]
            password = [e for e in c["env"] if e["name"] == "CLICKHOUSE_PASSWORD"]
            assert password == cc["env"] == [{"name": "CLICKHOUSE_PASSWORD", "valueFrom": {
                "secretKeyRef": {"name": "ch-password", "key": "password"}}}], kind
            assert c["volumeMounts"] == cc["volumeMounts"]
            assert {m["mountPath"] for m in c["volumeMounts"]} >= {
                "/etc/spanprof", "/var/run/secrets/spanprof/admin-tls"}
            assert pod["volumes"] == corr["volumes"]
            assert {"name": "config", "configMap": {"name": "rel-spanprof-correlator"}} in \
                pod["volumes"]
            assert any("secret" in v for v in pod["volumes"])  # the admin certificate
            assert (c["image"], c["imagePullPolicy"]) == (cc["image"], cc["imagePullPolicy"])
            assert c["image"] == "spanprof:1.2.3"
            assert c["securityContext"] == cc["securityContext"]
            assert pod["securityContext"] == corr["securityContext"]
            assert pod["imagePullSecrets"] == corr["imagePullSecrets"] == [{"name": "registry"}]
            assert "serviceAccountName" not in pod and "serviceAccountName" not in corr
        assert backfill_container(docs, "Job")["args"][:6] == ["backfill", *JOB_ARGS]

    def test_scheduling_and_resources_are_the_backfills_own(self, helm: str,
                                                            tmp_path: Path) -> None:
        """backfill.resources, nodeSelector, tolerations, affinity go to both pods (and not
        to the correlator's, nor the correlator's to them)."""
        own = {"resources": {"limits": {"cpu": "2", "memory": "2Gi"}},
               "nodeSelector": {"pool": "batch"},
               "tolerations": [{"key": "batch", "operator": "Exists"}],
               "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                   "nodeSelectorTerms": [{"matchExpressions": [
                       {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}}
        docs = render(helm, tmp_path, merged(merged(CRON, JOB), {
            "backfill": own, "correlator": {"nodeSelector": {"pool": "stream"}}}))
        for pod in job_pods(docs).values():
            assert pod["containers"][0]["resources"] == own["resources"]
            assert (pod["nodeSelector"], pod["tolerations"], pod["affinity"]) == (
                own["nodeSelector"], own["tolerations"], own["affinity"])
        assert pod_spec(docs, "correlator")["nodeSelector"] == {"pool": "stream"}
        assert "resources" not in container(docs, "correlator")

    def test_a_job_is_named_after_its_pod_and_its_ledger_job_after_its_args(
            self, helm: str, tmp_path: Path) -> None:
        """A Job's pod template cannot change: whatever changes it (arguments, image,
        workers, resources) is a Job of another name, what does not (the correlator's
        config) keeps the name. The ledger's job id follows the arguments alone, so a Job
        recreated with a new image finds its work done."""
        def job(values: dict[str, Any]) -> tuple[str, str]:
            docs = render(helm, tmp_path, merged(JOB, values))
            (jid,) = option(backfill_container(docs, "Job")["args"], "--job")
            return job_name(docs), jid

        name, jid = job({})
        assert re.fullmatch(r"backfill-[0-9a-f]{10}", name)  # rel-spanprof- removed
        assert job({}) == (name, jid)
        assert job({"correlator": {"grace": "9s"}}) == (name, jid)
        for change in ({"image": {"tag": "9.9.9"}}, {"backfill": {"workers": 4}},
                       {"backfill": {"resources": {"limits": {"cpu": "1"}}}}):
            other, other_jid = job(change)
            assert other != name and other_jid == jid, change
        other, other_jid = job({"backfill": {"job": {"args": ["reattribute", "--range",
                                                               "3h..2h"]}}})
        assert other != name and other_jid != jid

    def test_a_job_id_in_the_args_is_theirs(self, helm: str, tmp_path: Path) -> None:
        """Args naming the ledger's job (--job X, --job=X) are left alone: no second
        --job, no downward API."""
        docs = render(helm, tmp_path, {"backfill": {
            "job": {"enabled": True, "args": ["reattribute", "--range", "2h..1h",
                                              "--job", "again-1"]},
            "cronJob": {"enabled": True, "args": ["reattribute", "--range", "3h..2h",
                                                  "--job=hourly"]}}})
        job, cron = backfill_container(docs, "Job"), backfill_container(docs, "CronJob")
        assert option(job["args"], "--job") == ["again-1"]
        assert option(cron["args"], "--job") == [] and "--job=hourly" in cron["args"]
        assert "env" not in job and "env" not in cron

    def test_names_fit_kubernetes_limits(self, helm: str, tmp_path: Path) -> None:
        """A long release name: the Job's name fits a label value (63, its pods' job-name
        label) and the CronJob's 52 (the controller appends 11 for each run's Job)."""
        release = "observability-platform-spanprof-production-eu-west"  # 50 characters
        f = tmp_path / "values.yaml"
        f.write_text(yaml.safe_dump(merged(merged(CRON, JOB), {"gateway": {"auth": {
            "tokensSecret": {"name": "spanprof-tokens"}}}})))
        res = subprocess.run([helm, "template", release, str(CHART), "-f", str(f)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        names = {d["kind"]: d["metadata"]["name"] for d in yaml.safe_load_all(res.stdout)
                 if d and d["kind"] in ("Job", "CronJob")}
        label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
        assert len(names["Job"]) <= 63 and re.fullmatch(label, names["Job"]), names
        assert len(names["CronJob"]) <= 52 and re.fullmatch(label, names["CronJob"]), names
        assert re.search(r"-[0-9a-f]{10}$", names["Job"])

    def test_refused(self, helm: str, tmp_path: Path) -> None:
        """No arguments; the embedded engine, or no ClickHouse server at all; no
        correlator: each a clear error naming the value."""
        alone = {"correlator": {"enabled": False}}  # (the correlator refuses chdb:// too)
        for values, words in (
                ({"backfill": {"job": {"enabled": True}}}, "backfill.job.args"),
                (merged(CRON, {**alone, "clickhouse": {"endpoint": "chdb:///data"}}),
                 "backfill: clickhouse.endpoint"),
                (merged(JOB, {**alone, "clickhouse": {"endpoint": ""}}),
                 "backfill: clickhouse.endpoint"),
                (merged(CRON, alone), "correlator.enabled")):
            res = helm_template(helm, tmp_path, values, tokens_secret="spanprof-tokens")
            assert res.returncode != 0, values
            assert words in res.stderr, res.stderr


class TestRenderedCommandRuns:
    def test_each_rendered_command_is_accepted(self, helm: str, tmp_path: Path) -> None:
        """The Job's and the CronJob's argv as the kubelet runs them, on the rendered
        correlator config, are accepted by spanprof backfill: a dry run plans an empty store
        and prints its JSON summary."""
        docs = render(helm, tmp_path, merged(CRON, {"backfill": {"job": {
            "enabled": True, "args": ["reattribute", "--range", "2026-01-01T00:00:00Z.."
                                      "2026-01-01T06:00:00Z", "--method", "thread,window"]}}}))
        config = local_config(docs, tmp_path)
        for kind, job in (("CronJob", CRON_RUN), ("Job", job_name(docs))):
            summary = run_pod(backfill_container(docs, kind), config, job, "--dry-run")
            assert summary == {"dry_run": True, "attribute_units": 0, "spans": 0,
                               "samples": 0, "bytes": 0}, kind

    @pytest.mark.e2e
    def test_the_rendered_jobs_backfill_and_resume(self, helm: str, tmp_path: Path) -> None:
        """Real runs of the rendered command lines (the embedded engine standing in for the
        server): a files Job loads and attributes a Collector file set, and run again (a
        retried pod, or the Job recreated) does nothing; the CronJob's run re-attributes the
        hour before last under its Job's name, its retried pod finds its units done, and
        the next scheduled run is a job of its own."""
        from tests.backfill.dataset import generate, write_files

        now = time.time_ns()
        data = generate(40, t0=now - 90 * 60 * 10**9)  # within 2h..1h ago
        files = tmp_path / "collector"
        write_files(data, files)
        docs = render(helm, tmp_path, merged(CRON, {"backfill": {"workers": 1, "job": {
            "enabled": True, "args": ["files", str(files)]}}}))
        config = local_config(docs, tmp_path)
        job = backfill_container(docs, "Job")
        (jid,) = option(job["args"], "--job")

        first = run_pod(job, config, job_name(docs))
        assert first["job"] == jid
        assert (first["spans"], first["samples"]) == (len(data.spans), len(data.samples))
        assert first["failed"] == [] and first["units"] == first["done"] > 0
        assert first["cpu_in_ns"] == first["cpu_attributed_ns"] + first["cpu_unattributed_ns"]
        again = run_pod(job, config, job_name(docs))
        assert (again["job"], again["done"], again["spans"]) == (jid, 0, 0)
        assert again["already_done"] == again["units"] == first["units"]

        cron = backfill_container(docs, "CronJob")
        run = run_pod(cron, config, CRON_RUN)
        assert run["job"] == CRON_RUN and run["failed"] == []
        assert run["units"] == run["done"] > 0 and run["cpu_in_ns"] > 0
        retried = run_pod(cron, config, CRON_RUN)
        assert (retried["job"], retried["done"]) == (CRON_RUN, 0)
        assert retried["already_done"] == retried["units"] == run["units"]
        following = f"rel-spanprof-reattribute-{uuid.uuid4().int % 10**8}"
        nxt = run_pod(cron, config, following)
        assert nxt["job"] == following and nxt["done"] == nxt["units"] > 0

"""The Helm chart under deploy/helm/spanprof: ``helm lint``, what ``helm template`` renders
(ports, probes, secrets, config roll-outs), and the pipelines it renders run as they are:
spanprof's own config loader accepts them, and a gateway and a correlator started from the
rendered configs carry spans and samples through the real Kafka broker into ClickHouse."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
import yaml

from pipeline.config import load_text
from pipeline.otlp.builder import ProfileBuilder
from pipeline.registry import default_factories
from pipeline.tenants import TenantsConfig
from tests.certs import CertAuthority
from tests.conftest import SpanprofProcess, clickhouse, free_port, wait_until
from tests.e2e.otlp_clients import profiles_stub, sdk_spans

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "spanprof"
# where the chart mounts Secrets (templates/_helpers.tpl, spanprof.secretsDir)
SECRETS_DIR = "/var/run/secrets/spanprof"
GATEWAY_TOKEN = "tok-gateway-4c8e1a9f27d35b60"
ADMIN_TOKEN = "tok-admin-91d0f3b7e25c48a6"
MS = 1_000_000
FACTORIES = default_factories()


@pytest.fixture(scope="session")
def helm() -> str:
    from tests.helm_tool import HelmUnavailable, helm_binary

    try:
        return helm_binary()
    except HelmUnavailable as err:
        pytest.fail(str(err), pytrace=False)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mappings merged key by key (as Helm merges values)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


def helm_template(helm: str, tmp: Path, values: dict[str, Any] | None,
                  tokens_secret: str | None) -> subprocess.CompletedProcess[str]:
    """Auth is on by default and the chart refuses to render without the tokens Secret's
    name: unless ``tokens_secret`` is None, that name is given under the values."""
    if tokens_secret is not None:
        values = merged({"gateway": {"auth": {"tokensSecret": {"name": tokens_secret}}}},
                        values or {})
    f = tmp / f"values-{uuid.uuid4().hex[:6]}.yaml"
    f.write_text(yaml.safe_dump(values or {}))
    return subprocess.run([helm, "template", "rel", str(CHART), "-f", str(f)],
                          capture_output=True, text=True, timeout=60)


def render(helm: str, tmp: Path, values: dict[str, Any] | None = None,
           tokens_secret: str | None = "spanprof-tokens") -> dict[tuple[str, str], Any]:
    """``helm template`` with these values: the documents by (kind, name suffix)."""
    res = helm_template(helm, tmp, values, tokens_secret)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    docs = {}
    for d in yaml.safe_load_all(out):
        if d:
            docs[(d["kind"], d["metadata"]["name"].removeprefix("rel-spanprof-"))] = d
    return docs


def container(docs: dict[tuple[str, str], Any], tier: str) -> Any:
    return docs[("Deployment", tier)]["spec"]["template"]["spec"]["containers"][0]


def pipeline_text(docs: dict[tuple[str, str], Any], tier: str) -> str:
    return docs[("ConfigMap", tier)]["data"]["pipeline.yaml"]  # type: ignore[no-any-return]


def pipeline_doc(docs: dict[tuple[str, str], Any], tier: str) -> Any:
    return yaml.safe_load(pipeline_text(docs, tier))


def pod_spec(docs: dict[tuple[str, str], Any], tier: str) -> Any:
    return docs[("Deployment", tier)]["spec"]["template"]["spec"]


def secret_volumes(docs: dict[tuple[str, str], Any], tier: str) -> dict[str, Any]:
    """Volume name -> (its Secret, {key: path}, where the container mounts it)."""
    mounts = {m["name"]: m for m in container(docs, tier)["volumeMounts"]}
    out = {}
    for v in pod_spec(docs, tier)["volumes"]:
        if "secret" in v:
            m = mounts[v["name"]]
            assert m["readOnly"] is True
            out[v["name"]] = (v["secret"]["secretName"],
                              {i["key"]: i["path"] for i in v["secret"]["items"]},
                              m["mountPath"])
    return out


def listeners(cfg: Any) -> dict[str, Any]:
    """The gateway's listeners in a parsed pipeline config, by key."""
    rx = cfg["receivers"]
    out = {f"receivers.otlp.protocols.{p}": c for p, c in rx["otlp"]["protocols"].items()}
    if "pyroscope" in rx:
        out["receivers.pyroscope"] = rx["pyroscope"]
    return out


class MountedSecrets:
    """What the chart's Secrets hold, written where the test remaps their mount paths:
    a CA and a server certificate (the kubernetes.io/tls Secrets, ca.crt included), the
    gateway's tokens file and the admin API's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = CertAuthority(root / "pki")
        server = self.ca.issue("server")
        for d in ("tls", "admin-tls"):
            (root / d).mkdir(parents=True)
            shutil.copy(server.cert, root / d / "tls.crt")
            shutil.copy(server.key, root / d / "tls.key")
            shutil.copy(self.ca.path, root / d / "ca.crt")
        for d, token, tenant in (("tokens", GATEWAY_TOKEN, "team-a"),
                                 ("admin-tokens", ADMIN_TOKEN, "ops")):
            (root / d).mkdir()
            (root / d / "tokens.yaml").write_text(f'"{token}": {tenant}\n')

    def remap(self, text: str) -> str:
        """A rendered pipeline with its Secrets' mount paths moved to these files."""
        return text.replace(f"{SECRETS_DIR}/", f"{self.root}/")


@pytest.fixture
def mounted(tmp_path: Path) -> MountedSecrets:
    return MountedSecrets(tmp_path / "secrets")


class TestChart:
    def test_lint_strict(self, helm: str) -> None:
        res = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr

    def test_defaults_render_both_tiers_with_probes_and_matching_ports(
            self, helm: str, tmp_path: Path, mounted: MountedSecrets) -> None:
        docs = render(helm, tmp_path)
        assert set(docs) == {("ConfigMap", "gateway"), ("ConfigMap", "correlator"),
                             ("Deployment", "gateway"), ("Deployment", "correlator"),
                             ("Service", "gateway")}
        for tier in ("gateway", "correlator"):
            c = container(docs, tier)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "admin"}
            assert ports["admin"] == 13133
            assert c["args"] == ["run", "-c", "/etc/spanprof/pipeline.yaml"]
            pod = docs[("Deployment", tier)]["spec"]["template"]
            assert pod["metadata"]["annotations"]["prometheus.io/port"] == "13133"
            vols = {v["name"]: v for v in pod["spec"]["volumes"]}
            assert vols["config"]["configMap"]["name"] == f"rel-spanprof-{tier}"
            # the config's own admin endpoint is what the probes hit
            cfg = load_text(mounted.remap(pipeline_text(docs, tier)), FACTORIES, env={})
            assert cfg.service.admin.endpoint == "0.0.0.0:13133"
        gw = {p["name"]: p["containerPort"] for p in container(docs, "gateway")["ports"]}
        svc = {p["name"]: p for p in docs[("Service", "gateway")]["spec"]["ports"]}
        assert {n: gw[p["targetPort"]] for n, p in svc.items()} == {
            "otlp-grpc": 4317, "otlp-http": 4318, "pyroscope": 4040}
        sel = docs[("Service", "gateway")]["spec"]["selector"]
        assert sel == docs[("Deployment", "gateway")]["spec"]["selector"]["matchLabels"]
        assert sel != docs[("Deployment", "correlator")]["spec"]["selector"]["matchLabels"]

    def test_rendered_pipelines_are_what_the_values_say(
            self, helm: str, tmp_path: Path, mounted: MountedSecrets) -> None:
        values = {"kafka": {"brokers": ["k-0:9092", "k-1:9092"], "partitioner": "sarama_compat",
                            "topics": {"spans": "s1", "profiles": "p1"}},
                  "clickhouse": {"endpoint": "https://ch.example:8443", "cluster": "prod",
                                 "passwordSecret": {"name": "ch-secret", "key": "pw"}},
                  "gateway": {"otlp": {"httpPort": 0}, "pyroscopePort": 0,
                              "memoryLimiter": {"limitPercentage": 70}},
                  "correlator": {"groupId": "g1", "grace": "3s", "replicas": 4}}
        docs = render(helm, tmp_path, values)
        gw = load_text(mounted.remap(pipeline_text(docs, "gateway")), FACTORIES, env={})
        kafka_out = gw.exporters["kafka"]
        assert kafka_out.brokers == ["k-0:9092", "k-1:9092"]  # type: ignore[attr-defined]
        assert kafka_out.partitioner == "sarama_compat"  # type: ignore[attr-defined]
        assert kafka_out.traces.topic == "s1"  # type: ignore[attr-defined]
        assert "pyroscope" not in gw.receivers
        assert gw.processors["memory_limiter"].limit_percentage == 70  # type: ignore[attr-defined]
        assert gw.service.pipelines["traces"].processors == ["memory_limiter"]
        assert not gw.receivers["otlp"].protocols.http  # type: ignore[attr-defined]
        assert [p["name"] for p in docs[("Service", "gateway")]["spec"]["ports"]] == [
            "otlp-grpc"]
        # the password is an environment variable from the Secret, never in the ConfigMap
        co = load_text(pipeline_text(docs, "correlator"),
                       FACTORIES, env={"CLICKHOUSE_PASSWORD": "123456"})  # a Secret's value, as is
        ch = co.exporters["clickhouse"]
        assert (ch.endpoint, ch.cluster, ch.password) == (  # type: ignore[attr-defined]
            "https://ch.example:8443", "prod", "123456")
        assert "123456" not in yaml.safe_dump(docs)
        env = container(docs, "correlator")["env"]
        assert env == [{"name": "CLICKHOUSE_PASSWORD", "valueFrom": {
            "secretKeyRef": {"name": "ch-secret", "key": "pw"}}}]
        rx = co.receivers["kafka"]
        assert (rx.group_id, rx.profiles.topic) == ("g1", "p1")  # type: ignore[attr-defined]
        assert co.connectors["spancorrelator"].grace == 3.0  # type: ignore[attr-defined]
        assert docs[("Deployment", "correlator")]["spec"]["replicas"] == 4

    def test_a_config_change_rolls_the_pods(self, helm: str, tmp_path: Path) -> None:
        def checksum(values: dict[str, Any], tier: str) -> str:
            d = render(helm, tmp_path, values)[("Deployment", tier)]
            return d["spec"]["template"]["metadata"]["annotations"][  # type: ignore[no-any-return]
                "checksum/config"]

        assert checksum({}, "correlator") != checksum({"correlator": {"grace": "5s"}},
                                                      "correlator")
        assert checksum({}, "gateway") == checksum({"correlator": {"grace": "5s"}}, "gateway")

    def test_the_embedded_engine_is_refused_for_the_correlator(self, helm: str,
                                                               tmp_path: Path) -> None:
        res = helm_template(helm, tmp_path, {"clickhouse": {"endpoint": "chdb:///data"}},
                            tokens_secret="spanprof-tokens")
        assert res.returncode != 0 and "clickhouse.endpoint" in res.stderr


# per-tenant limits (service.tenants) as a user writes them under a tier's values; a bytes
# rate over a million, which Helm 3's toYaml writes 1.6777216e+07 (the loader reads that
# as the integer)
GATEWAY_TENANTS = {"max_tenants": 200,
                   "limits": {"requests_per_second": 2.5, "bytes_per_second": 16777216},
                   "overrides": {"team-a": {"requests_per_second": 500}}}
CORRELATOR_TENANTS = {"limits": {"max_spans_held": 50000},
                      "overrides": {"team-a": {"max_spans_held": 150000}}}


class TestChartTenants:
    """gateway.tenants and correlator.tenants: each tier's service.tenants (#17)."""

    def test_no_tenants_block_by_default(self, helm: str, tmp_path: Path) -> None:
        """The defaults ({}) render no service.tenants: the pipeline's own defaults."""
        docs = render(helm, tmp_path)
        for tier in ("gateway", "correlator"):
            assert "tenants" not in pipeline_doc(docs, tier)["service"], tier

    @pytest.mark.parametrize(("tier", "other", "tenants"), [
        ("gateway", "correlator", GATEWAY_TENANTS),
        ("correlator", "gateway", CORRELATOR_TENANTS)])
    def test_a_tiers_tenants_are_its_service_tenants_alone(
            self, helm: str, tmp_path: Path, mounted: MountedSecrets, tier: str, other: str,
            tenants: dict[str, Any]) -> None:
        """The values are rendered as they are under the tier's service.tenants, the other
        tier's pipeline is left without, and spanprof's loader reads them as given."""
        docs = render(helm, tmp_path, {tier: {"tenants": tenants}})
        assert pipeline_doc(docs, tier)["service"]["tenants"] == tenants
        assert "tenants" not in pipeline_doc(docs, other)["service"]
        cfg = load_text(mounted.remap(pipeline_text(docs, tier)), FACTORIES, env={})
        assert msgspec.to_builtins(cfg.service.tenants) == merged(
            msgspec.to_builtins(TenantsConfig()), tenants)


GATEWAY_TLS = {"gateway": {"tls": {"enabled": True, "secretName": "gw-tls"}}}
# "ops": the tenant of MountedSecrets' admin token, which has the admin role (/metrics)
ADMIN_ON = {"admin": {"tls": {"enabled": True, "secretName": "admin-tls"},
                      "auth": {"enabled": True, "tokensSecret": {"name": "admin-tokens"},
                               "adminTenants": ["ops"],
                               "scrapeTokenSecret": {"name": "scrape-token", "key": "t"}}}}
EVERYTHING = merged(merged(GATEWAY_TLS, {"gateway": {"tls": {"clientAuth": True}}}), ADMIN_ON)


def refused(res: subprocess.CompletedProcess[str], *words: str) -> None:
    """``helm template`` failed, with an error naming the key and what to do."""
    assert res.returncode != 0
    error = res.stderr.splitlines()[0] if res.stderr else ""
    assert all(w in error for w in words), res.stderr


class TestChartSecurity:
    """TLS from kubernetes.io/tls Secrets, tokens from a Secret, NetworkPolicies (#17)."""

    @pytest.mark.parametrize("values", sorted((CHART / "ci").glob("*-values.yaml")),
                             ids=lambda p: p.name)
    def test_lint_strict_with_the_ci_values(self, helm: str, values: Path) -> None:
        """Each ci/*-values.yaml (the least an install needs; every door closed) lints
        with no warning at all (the defaults alone warn that the tokens Secret is required)."""
        res = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(values)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "WARN" not in res.stdout + res.stderr

    def test_the_tls_secret_is_mounted_and_named_by_every_listener(
            self, helm: str, tmp_path: Path) -> None:
        """gateway.tls: the Secret's tls.crt and tls.key mounted read-only (no ca.crt
        without clientAuth) and each listener's tls: names those files; the admin API and
        the correlator are left as they were."""
        docs = render(helm, tmp_path, GATEWAY_TLS)
        secret, items, path = secret_volumes(docs, "gateway")["tls"]
        assert (secret, items) == ("gw-tls", {"tls.crt": "tls.crt", "tls.key": "tls.key"})
        cfg = pipeline_doc(docs, "gateway")
        assert set(listeners(cfg)) == {"receivers.otlp.protocols.grpc",
                                       "receivers.otlp.protocols.http", "receivers.pyroscope"}
        for key, listener in listeners(cfg).items():
            assert listener["tls"] == {"cert_file": f"{path}/tls.crt",
                                       "key_file": f"{path}/tls.key"}, key
        assert "tls" not in cfg["service"]["admin"]
        assert "tls" not in secret_volumes(docs, "correlator")
        assert "tls" not in pipeline_doc(docs, "correlator")["service"]["admin"]
        # a listener turned off gets nothing; one without a Secret named is refused
        off = pipeline_doc(render(helm, tmp_path, merged(GATEWAY_TLS, {"gateway": {
            "otlp": {"httpPort": 0}, "pyroscopePort": 0}})), "gateway")
        assert set(listeners(off)) == {"receivers.otlp.protocols.grpc"}
        refused(helm_template(helm, tmp_path, {"gateway": {"tls": {"enabled": True}}},
                              "spanprof-tokens"), "gateway.tls.secretName")

    def test_client_certificates_need_the_secrets_ca(self, helm: str, tmp_path: Path) -> None:
        """gateway.tls.clientAuth: ca.crt is mounted too and is every listener's
        client_ca_file (mutual TLS)."""
        docs = render(helm, tmp_path, merged(GATEWAY_TLS, {"gateway": {"tls": {
            "clientAuth": True}}}))
        _, items, path = secret_volumes(docs, "gateway")["tls"]
        assert items == {"tls.crt": "tls.crt", "tls.key": "tls.key", "ca.crt": "ca.crt"}
        for key, listener in listeners(pipeline_doc(docs, "gateway")).items():
            assert listener["tls"]["client_ca_file"] == f"{path}/ca.crt", key

    def test_auth_is_on_by_default_and_refused_without_a_tokens_secret(
            self, helm: str, tmp_path: Path) -> None:
        """With the defaults alone the chart does not render an open gateway: it fails,
        naming the value to set and how to turn auth off knowingly; off, no extension and
        no tokens volume."""
        refused(helm_template(helm, tmp_path, None, tokens_secret=None),
                "gateway.auth.tokensSecret.name", "gateway.auth.enabled=false")
        docs = render(helm, tmp_path, {"gateway": {"auth": {"enabled": False}}},
                      tokens_secret=None)
        cfg = pipeline_doc(docs, "gateway")
        assert "extensions" not in cfg and "extensions" not in cfg["service"]
        assert not any("auth" in c for c in listeners(cfg).values())
        assert secret_volumes(docs, "gateway") == {}

    def test_the_tokens_file_is_mounted_and_the_extension_rendered(
            self, helm: str, tmp_path: Path) -> None:
        """The tokens Secret's key is mounted as tokens.yaml (a whole-Secret mount, so the
        kubelet's updates arrive and the extension reloads them), the tenantauth extension
        reads it, is started, and every receiver listener names it."""
        docs = render(helm, tmp_path, {"gateway": {"auth": {"tokensSecret": {
            "key": "team-tokens"}}}}, tokens_secret="gw-tokens")
        secret, items, path = secret_volumes(docs, "gateway")["tokens"]
        assert (secret, items) == ("gw-tokens", {"team-tokens": "tokens.yaml"})
        assert not any("subPath" in m for m in container(docs, "gateway")["volumeMounts"])
        cfg = pipeline_doc(docs, "gateway")
        assert cfg["extensions"] == {"tenantauth": {"tokens_file": f"{path}/tokens.yaml"}}
        assert cfg["service"]["extensions"] == ["tenantauth"]
        for key, listener in listeners(cfg).items():
            assert listener["auth"] == {"authenticator": "tenantauth"}, key

    def test_admin_auth_is_off_by_default(self, helm: str, tmp_path: Path) -> None:
        """Probes and scraping use the admin API: by default it wants no token and no TLS
        on either tier, the correlator mounts no Secret, the scrape annotations are as
        before and there is no PodMonitor."""
        docs = render(helm, tmp_path)
        for tier in ("gateway", "correlator"):
            cfg = pipeline_doc(docs, tier)
            assert cfg["service"]["admin"] == {"endpoint": "0.0.0.0:13133"}
            ann = docs[("Deployment", tier)]["spec"]["template"]["metadata"]["annotations"]
            assert {k: v for k, v in ann.items() if k.startswith("prometheus.io/")} == {
                "prometheus.io/scrape": "true", "prometheus.io/port": "13133",
                "prometheus.io/path": "/metrics"}
        assert "extensions" not in pipeline_doc(docs, "correlator")
        assert secret_volumes(docs, "correlator") == {}
        assert not any(kind == "PodMonitor" for kind, _ in docs)

    def test_admin_tls_and_tokens_on_both_tiers_and_the_podmonitor(
            self, helm: str, tmp_path: Path) -> None:
        """admin.tls and admin.auth: both tiers mount the admin Secrets, serve HTTPS (probes
        and scrape annotations follow) and name tenantauth/admin, whose tokens are not the
        gateway's clients' and whose admin_tenants are admin.auth.adminTenants; the
        PodMonitor sends the scrape token from its Secret. Each Secret left unnamed is
        refused, and so is an empty adminTenants (the scrape token's tenant would get 403)."""
        docs = render(helm, tmp_path, merged(ADMIN_ON, {"podMonitor": {"enabled": True}}))
        for tier in ("gateway", "correlator"):
            vols = secret_volumes(docs, tier)
            _, tls_items, tls_path = vols["admin-tls"]
            secret, items, tokens_path = vols["admin-tokens"]
            assert tls_items == {"tls.crt": "tls.crt", "tls.key": "tls.key"}
            assert (secret, items) == ("admin-tokens", {"tokens.yaml": "tokens.yaml"})
            cfg = pipeline_doc(docs, tier)
            assert cfg["service"]["admin"] == {
                "endpoint": "0.0.0.0:13133",
                "tls": {"cert_file": f"{tls_path}/tls.crt", "key_file": f"{tls_path}/tls.key"},
                "auth": {"authenticator": "tenantauth/admin"}}
            assert cfg["extensions"]["tenantauth/admin"] == {
                "tokens_file": f"{tokens_path}/tokens.yaml", "admin_tenants": ["ops"]}
            assert "tenantauth/admin" in cfg["service"]["extensions"]
            c = container(docs, tier)
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "admin",
                                                      "scheme": "HTTPS"}
            pod = docs[("Deployment", tier)]["spec"]["template"]
            assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
        gw = pipeline_doc(docs, "gateway")
        assert gw["service"]["extensions"] == ["tenantauth", "tenantauth/admin"]
        assert gw["extensions"]["tenantauth"] != gw["extensions"]["tenantauth/admin"]
        assert "admin_tenants" not in gw["extensions"]["tenantauth"]  # the clients' tokens
        (endpoint,) = docs[("PodMonitor", "rel-spanprof")]["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "admin" and endpoint["scheme"] == "https"
        assert endpoint["authorization"] == {"type": "Bearer",
                                             "credentials": {"name": "scrape-token", "key": "t"}}
        for key, unnamed in (
                ("admin.tls.secretName", {"tls": {"secretName": ""}}),
                ("admin.auth.tokensSecret.name", {"auth": {"tokensSecret": {"name": ""}}}),
                ("admin.auth.scrapeTokenSecret.name",
                 {"auth": {"scrapeTokenSecret": {"name": ""}}}),
                ("admin.auth.adminTenants", {"auth": {"adminTenants": []}})):
            values = merged(ADMIN_ON, {"podMonitor": {"enabled": True}, "admin": unnamed})
            refused(helm_template(helm, tmp_path, values, "spanprof-tokens"), key)

    def test_admin_tenants_without_a_podmonitor(self, helm: str, tmp_path: Path) -> None:
        """With no PodMonitor an empty adminTenants renders (whatever scrapes is the user's
        to configure) and no admin_tenants key is written; listed tenants are written in
        both tiers' tenantauth/admin as given; the refusal says why."""
        values = merged(ADMIN_ON, {"admin": {"auth": {"adminTenants": []}}})
        docs = render(helm, tmp_path, values)
        for tier in ("gateway", "correlator"):
            assert "admin_tenants" not in pipeline_doc(docs, tier)["extensions"][
                "tenantauth/admin"], tier
        docs = render(helm, tmp_path, merged(values, {"admin": {"auth": {
            "adminTenants": ["ops", "monitoring"]}}}))
        for tier in ("gateway", "correlator"):
            assert pipeline_doc(docs, tier)["extensions"]["tenantauth/admin"][
                "admin_tenants"] == ["ops", "monitoring"], tier
        refused(helm_template(helm, tmp_path, merged(values, {"podMonitor": {"enabled": True}}),
                              "spanprof-tokens"),
                "admin.auth.adminTenants", "403", "admin.auth.scrapeTokenSecret")

    def test_no_secret_in_a_configmap_nor_in_the_defaults(self, helm: str,
                                                          tmp_path: Path) -> None:
        """With every door closed the ConfigMaps hold file paths under the Secrets' mounts
        and the ClickHouse password's environment variable, nothing else secret: no
        inline tokens, no PEM. values.yaml names no Secret and holds no secret value."""
        docs = render(helm, tmp_path, merged(EVERYTHING, {
            "clickhouse": {"passwordSecret": {"name": "ch"}}}))

        def walk(node: Any, key: str = "") -> Any:
            if isinstance(node, dict):
                for k, v in node.items():
                    yield from walk(v, f"{key}.{k}" if key else str(k))
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    yield from walk(v, f"{key}[{i}]")
            else:
                yield key, node

        files = 0
        for tier in ("gateway", "correlator"):
            text = pipeline_text(docs, tier)
            assert "BEGIN" not in text
            cfg = yaml.safe_load(text)
            for ext in cfg["extensions"].values():
                assert set(ext) <= {"tokens_file", "admin_tenants"}
            for key, value in walk(cfg):
                if key.endswith("_file"):
                    assert str(value).startswith(f"{SECRETS_DIR}/"), key
                    files += 1
                if key.endswith(".password"):
                    assert value == "${env:CLICKHOUSE_PASSWORD:-}"
        # 3 listeners' cert, key and CA; 2 admin APIs' cert and key; 3 tokens files
        assert files == 3 * 3 + 2 * 2 + 3
        defaults = yaml.safe_load((CHART / "values.yaml").read_text())
        named = [(k, v) for k, v in walk(defaults)
                 if k.endswith(("Secret.name", ".secretName")) or "secret" in k.lower()
                 and k.endswith(".name")]
        assert named and all(v == "" for _, v in named), named
        assert not {k.rsplit(".", 1)[-1] for k, _ in walk(defaults)} & {
            "password", "token", "tokens", "cert", "certificate", "tls.key", "privateKey"}

    def test_the_rendered_configs_with_tls_and_tokens_pass_validate(
            self, helm: str, tmp_path: Path, mounted: MountedSecrets) -> None:
        """Both tiers rendered with every door closed, their Secrets' mount paths remapped
        to generated certificates and tokens files, pass ``spanprof validate`` (which loads
        the certificates and reads the tokens), with admin tenants and each tier's tenants
        limits too; with nothing at the mount paths it fails naming each key."""
        docs = render(helm, tmp_path, merged(EVERYTHING, {
            "gateway": {"tenants": GATEWAY_TENANTS},
            "correlator": {"tenants": CORRELATOR_TENANTS}}))
        for tier in ("gateway", "correlator"):
            assert "tenants" in pipeline_doc(docs, tier)["service"]
        for tier in ("gateway", "correlator"):
            path = tmp_path / f"{tier}.yaml"
            path.write_text(mounted.remap(pipeline_text(docs, tier)))
            res = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", "-c",
                                  str(path)], capture_output=True, text=True, timeout=60)
            assert res.returncode == 0 and ": ok (" in res.stdout, res.stderr
            assert GATEWAY_TOKEN not in res.stdout + res.stderr
        path = tmp_path / "unmounted.yaml"
        path.write_text(pipeline_text(docs, "gateway"))
        res = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", "-c",
                              str(path)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2
        for key in ("extensions.tenantauth.tokens_file", "receivers.otlp.protocols.grpc.tls",
                    "receivers.pyroscope.tls", "service.admin.tls"):
            assert key in res.stderr, res.stderr

    def test_network_policies(self, helm: str, tmp_path: Path) -> None:
        """networkPolicy: off by default. On: the gateway's receiver ports from the sources
        given (any when none), its admin port and the correlator's (all a worker serves)
        from the monitoring sources only; each policy selects its own tier's pods."""
        assert not any(kind == "NetworkPolicy" for kind, _ in render(helm, tmp_path))
        senders = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}},
                   {"podSelector": {"matchLabels": {"app": "batch"}}}]
        monitoring = [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}},
                       "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
        docs = render(helm, tmp_path, {"networkPolicy": {
            "enabled": True, "receivers": {"from": senders}, "admin": {"from": monitoring}},
            "gateway": {"otlp": {"grpcPort": 14317}}})

        def ports(rule: Any) -> set[int]:
            assert all(p["protocol"] == "TCP" for p in rule["ports"])
            return {p["port"] for p in rule["ports"]}

        for tier in ("gateway", "correlator"):
            spec = docs[("NetworkPolicy", tier)]["spec"]
            assert spec["podSelector"]["matchLabels"] == \
                docs[("Deployment", tier)]["spec"]["selector"]["matchLabels"]
            assert spec["policyTypes"] == ["Ingress"]
        gw = docs[("NetworkPolicy", "gateway")]["spec"]["ingress"]
        assert [(ports(r), r["from"]) for r in gw] == [
            ({14317, 4318, 4040}, senders), ({13133}, monitoring)]
        co = docs[("NetworkPolicy", "correlator")]["spec"]["ingress"]
        assert [(ports(r), r["from"]) for r in co] == [({13133}, monitoring)]
        # no sources given: receivers from anywhere, the admin ports from no pod
        docs = render(helm, tmp_path, {"networkPolicy": {"enabled": True},
                                       "gateway": {"pyroscopePort": 0}})
        gw = docs[("NetworkPolicy", "gateway")]["spec"]["ingress"]
        assert [(ports(r), "from" in r) for r in gw] == [({4317, 4318}, False)]
        assert docs[("NetworkPolicy", "correlator")]["spec"]["ingress"] == []

@pytest.mark.e2e
class TestRenderedPipelinesRun:
    def test_gateway_and_correlator_from_the_chart_through_kafka(
            self, helm: str, tmp_path: Path, kafka_broker: Any,
            mounted: MountedSecrets) -> None:
        """The chart's two pipelines, rendered for the test broker, run as spanprof
        processes: SDK spans and linked samples sent to the gateway, over TLS with a token
        (auth is on by default), come out of the correlator attributed; a request without
        the token is refused. The edits: the Secrets' mount paths become generated files,
        and the correlator's ClickHouse server becomes the embedded engine (no server can
        run here; the chart refuses chdb:// itself)."""
        import asyncio

        from tests.kafka_broker import create_topics

        topics = {"spans": f"s{uuid.uuid4().hex[:6]}", "profiles": f"p{uuid.uuid4().hex[:6]}"}
        asyncio.run(create_topics(kafka_broker.bootstrap, *topics.values()))
        ports = {"grpc": free_port(), "http": free_port(), "pyro": free_port()}
        common = {"kafka": {"brokers": [kafka_broker.bootstrap], "topics": topics},
                  "logs": {"encoding": "json"}}
        gw_docs = render(helm, tmp_path, merged(GATEWAY_TLS, {
            **common, "admin": {"port": "{admin_port}"},
            "gateway": {"otlp": {"grpcPort": ports["grpc"], "httpPort": ports["http"]},
                        "pyroscopePort": ports["pyro"]}}))
        co_docs = render(helm, tmp_path, {**common, "admin": {"port": "{admin_port}"},
                                          "correlator": {"groupId": f"g{uuid.uuid4().hex[:6]}",
                                                         "grace": "1s"}})

        def as_template(text: str) -> str:  # SpanprofProcess fills {admin_port}, {data}
            return (text.replace("{", "{{").replace("}", "}}")
                    .replace("{{admin_port}}", "{admin_port}"))

        co_text = as_template(pipeline_text(co_docs, "correlator")).replace(
            '"http://clickhouse:8123"', '"chdb://{data}"')
        gateway = SpanprofProcess(tmp_path / "gw", config_text=as_template(
            mounted.remap(pipeline_text(gw_docs, "gateway"))))
        correlator = SpanprofProcess(tmp_path / "co", config_text=co_text)
        # (a test that fails half-way has its processes killed by conftest's fixture)
        gateway.start()
        correlator.start()
        target = f"127.0.0.1:{ports['grpc']}"
        credentials = grpc.ssl_channel_credentials(mounted.ca.path.read_bytes())
        bearer = f"Bearer {GATEWAY_TOKEN}"
        stub = profiles_stub(grpc.secure_channel(target, credentials))
        with pytest.raises(grpc.RpcError) as no_token:
            stub.Export(ProfileBuilder().build(), timeout=30)
        assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
        keys = sdk_spans(target, "checkout", 10, credentials, {"authorization": bearer})
        truth: dict[tuple[bytes, bytes], int] = defaultdict(int)
        b = ProfileBuilder()
        for j, (tid, sid) in enumerate(keys):
            truth[(tid, sid)] += (j + 1) * MS
            b.sample([f"fn{j}", "main"], (j + 1) * MS, tid, sid, service="checkout")
        assert not stub.Export(b.build(), timeout=30, metadata=(("authorization", bearer),)
                               ).HasField("partial_success")

        def attributed() -> dict[tuple[str, str], int]:
            return {(s["trace_id"], s["span_id"]): s["cpu_ns"] for s in
                    correlator.get("/api/v1/spans?limit=100",
                                   {"X-Scope-OrgID": "team-a"})["spans"]}  # the token's
        want = {(t.hex(), s.hex()): v for (t, s), v in truth.items()}
        wait_until(lambda: attributed() == want, timeout=60)
        assert gateway.stop() == 0
        assert correlator.stop() == 0
        with clickhouse(correlator.data) as ch:
            got = ch.query("SELECT tenant, count() FROM spanprof.otel_traces GROUP BY tenant")
            assert got.result_rows == [("team-a", 10)]  # the gateway token's tenant, via Kafka

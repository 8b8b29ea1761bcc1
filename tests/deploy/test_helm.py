"""The Helm chart under deploy/helm/spanprof: ``helm lint``, what ``helm template`` renders
(ports, probes, secrets, config roll-outs), and the pipelines it renders run as they are:
spanprof's own config loader accepts them, and a gateway and a correlator started from the
rendered configs carry spans and samples through the real Kafka broker into ClickHouse."""

from __future__ import annotations

import subprocess
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from pipeline.config import load_text
from pipeline.otlp.builder import ProfileBuilder
from pipeline.registry import default_factories
from tests.conftest import SpanprofProcess, clickhouse, free_port, wait_until
from tests.e2e.otlp_clients import profiles_stub, sdk_spans

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "spanprof"
MS = 1_000_000
FACTORIES = default_factories()


@pytest.fixture(scope="session")
def helm() -> str:
    from tests.helm_tool import HelmUnavailable, helm_binary

    try:
        return helm_binary()
    except HelmUnavailable as err:
        pytest.fail(str(err), pytrace=False)


def render(helm: str, tmp: Path, values: dict[str, Any] | None = None
           ) -> dict[tuple[str, str], Any]:
    """``helm template`` with these values: the documents by (kind, name suffix)."""
    f = tmp / f"values-{uuid.uuid4().hex[:6]}.yaml"
    f.write_text(yaml.safe_dump(values or {}))
    out = subprocess.run([helm, "template", "rel", str(CHART), "-f", str(f)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    docs = {}
    for d in yaml.safe_load_all(out):
        if d:
            docs[(d["kind"], d["metadata"]["name"].removeprefix("rel-spanprof-"))] = d
    return docs


def container(docs: dict[tuple[str, str], Any], tier: str) -> Any:
    return docs[("Deployment", tier)]["spec"]["template"]["spec"]["containers"][0]


def pipeline_text(docs: dict[tuple[str, str], Any], tier: str) -> str:
    return docs[("ConfigMap", tier)]["data"]["pipeline.yaml"]  # type: ignore[no-any-return]


class TestChart:
    def test_lint_strict(self, helm: str) -> None:
        res = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr

    def test_defaults_render_both_tiers_with_probes_and_matching_ports(
            self, helm: str, tmp_path: Path) -> None:
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
            cfg = load_text(pipeline_text(docs, tier), FACTORIES, env={})
            assert cfg.service.admin.endpoint == "0.0.0.0:13133"
        gw = {p["name"]: p["containerPort"] for p in container(docs, "gateway")["ports"]}
        svc = {p["name"]: p for p in docs[("Service", "gateway")]["spec"]["ports"]}
        assert {n: gw[p["targetPort"]] for n, p in svc.items()} == {
            "otlp-grpc": 4317, "otlp-http": 4318, "pyroscope": 4040}
        sel = docs[("Service", "gateway")]["spec"]["selector"]
        assert sel == docs[("Deployment", "gateway")]["spec"]["selector"]["matchLabels"]
        assert sel != docs[("Deployment", "correlator")]["spec"]["selector"]["matchLabels"]

    def test_rendered_pipelines_are_what_the_values_say(self, helm: str,
                                                        tmp_path: Path) -> None:
        values = {"kafka": {"brokers": ["k-0:9092", "k-1:9092"], "partitioner": "sarama_compat",
                            "topics": {"spans": "s1", "profiles": "p1"}},
                  "clickhouse": {"endpoint": "https://ch.example:8443", "cluster": "prod",
                                 "passwordSecret": {"name": "ch-secret", "key": "pw"}},
                  "gateway": {"otlp": {"httpPort": 0}, "pyroscopePort": 0,
                              "memoryLimiter": {"limitPercentage": 70}},
                  "correlator": {"groupId": "g1", "grace": "3s", "replicas": 4}}
        docs = render(helm, tmp_path, values)
        gw = load_text(pipeline_text(docs, "gateway"), FACTORIES, env={})
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
        f = tmp_path / "v.yaml"
        f.write_text(yaml.safe_dump({"clickhouse": {"endpoint": "chdb:///data"}}))
        res = subprocess.run([helm, "template", "rel", str(CHART), "-f", str(f)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "clickhouse.endpoint" in res.stderr


@pytest.mark.e2e
class TestRenderedPipelinesRun:
    def test_gateway_and_correlator_from_the_chart_through_kafka(
            self, helm: str, tmp_path: Path, kafka_broker: Any) -> None:
        """The chart's two pipelines, rendered for the test broker, run as spanprof
        processes: SDK spans and linked samples sent to the gateway come out of the
        correlator attributed. The one edit: the correlator's ClickHouse server becomes
        the embedded engine (no server can run here; the chart refuses chdb:// itself)."""
        import asyncio

        from tests.kafka_broker import create_topics

        topics = {"spans": f"s{uuid.uuid4().hex[:6]}", "profiles": f"p{uuid.uuid4().hex[:6]}"}
        asyncio.run(create_topics(kafka_broker.bootstrap, *topics.values()))
        ports = {"grpc": free_port(), "http": free_port(), "pyro": free_port()}
        common = {"kafka": {"brokers": [kafka_broker.bootstrap], "topics": topics},
                  "logs": {"encoding": "json"}}
        gw_docs = render(helm, tmp_path, {**common, "admin": {"port": "{admin_port}"},
                                          "gateway": {"otlp": {"grpcPort": ports["grpc"],
                                                               "httpPort": ports["http"]},
                                                      "pyroscopePort": ports["pyro"]}})
        co_docs = render(helm, tmp_path, {**common, "admin": {"port": "{admin_port}"},
                                          "correlator": {"groupId": f"g{uuid.uuid4().hex[:6]}",
                                                         "grace": "1s"}})

        def as_template(text: str) -> str:  # SpanprofProcess fills {admin_port}, {data}
            return (text.replace("{", "{{").replace("}", "}}")
                    .replace("{{admin_port}}", "{admin_port}"))

        co_text = as_template(pipeline_text(co_docs, "correlator")).replace(
            '"http://clickhouse:8123"', '"chdb://{data}"')
        gateway = SpanprofProcess(tmp_path / "gw",
                                  config_text=as_template(pipeline_text(gw_docs, "gateway")))
        correlator = SpanprofProcess(tmp_path / "co", config_text=co_text)
        # (a test that fails half-way has its processes killed by conftest's fixture)
        gateway.start()
        correlator.start()
        target = f"127.0.0.1:{ports['grpc']}"
        keys = sdk_spans(target, "checkout", 10)
        truth: dict[tuple[bytes, bytes], int] = defaultdict(int)
        b = ProfileBuilder()
        for j, (tid, sid) in enumerate(keys):
            truth[(tid, sid)] += (j + 1) * MS
            b.sample([f"fn{j}", "main"], (j + 1) * MS, tid, sid, service="checkout")
        stub = profiles_stub(grpc.insecure_channel(target))
        assert not stub.Export(b.build(), timeout=30).HasField("partial_success")

        def attributed() -> dict[tuple[str, str], int]:
            return {(s["trace_id"], s["span_id"]): s["cpu_ns"] for s in
                    correlator.get("/api/v1/spans?limit=100")["spans"]}
        want = {(t.hex(), s.hex()): v for (t, s), v in truth.items()}
        wait_until(lambda: attributed() == want, timeout=60)
        assert gateway.stop() == 0
        assert correlator.stop() == 0
        with clickhouse(correlator.data) as ch:
            assert ch.query("SELECT count() FROM spanprof.otel_traces").result_rows[0][0] == 10

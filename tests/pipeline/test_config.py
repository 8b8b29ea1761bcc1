"""Configuration: typed decoding, key-path errors, env expansion, and `spanprof validate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pipeline.config import Duration, load_file, load_text
from pipeline.errors import ConfigError
from pipeline.registry import default_factories

FACTORIES = default_factories()
TESTDATA = Path(__file__).parent / "testdata"
INVALID = sorted(p for p in TESTDATA.glob("*.yaml") if p.name != "base.yaml")
ROOT = Path(__file__).resolve().parents[2]


def expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), path
    return first[len("# expect: "):]


class TestInvalidConfigs:
    @pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
    def test_message_names_the_key_path(self, path: Path) -> None:
        """Each invalid case is reported with the exact message, key path first."""
        with pytest.raises(ConfigError) as err:
            load_file(str(path), FACTORIES, env={})
        assert expected(path) in err.value.problems, err.value.problems

    def test_all_problems_reported_together(self) -> None:
        """Several mistakes in one file are all reported, not just the first."""
        text = (TESTDATA / "base.yaml").read_text().replace(
            "  clickhouse:\n", "  clickhouse:\n    batch_rows: x\n    bogus: 1\n")
        with pytest.raises(ConfigError) as err:
            load_text(text + "processors:\n  nope:\n", FACTORIES, env={})
        problems = err.value.problems
        assert "processors.nope: unknown processor type 'nope' (known: batch, " \
            "memory_limiter)" in problems
        assert "exporters.clickhouse.batch_rows: expected int, got str" in problems
        assert "exporters.clickhouse.bogus: unknown key" in problems

    def test_not_yaml(self) -> None:
        """A file that is not YAML names the file."""
        with pytest.raises(ConfigError, match=r"^x.yaml: not valid YAML"):
            load_text("a: [1, 2", FACTORIES, source="x.yaml")


class TestValidConfigs:
    def test_example_configs_load(self) -> None:
        """Every shipped example pipeline validates."""
        for path in sorted((ROOT / "config").glob("*.yaml")):
            cfg = load_file(str(path), FACTORIES, env={})
            assert cfg.service.pipelines, path

    def test_env_expansion_with_default_and_typed_value(self) -> None:
        """${env:X} is replaced, ${env:X:-d} falls back to d, a whole-value reference
        becomes the field's type, and $$ is a literal dollar."""
        text = (TESTDATA / "base.yaml").read_text().replace(
            "  clickhouse:\n",
            "  clickhouse:\n    batch_rows: ${env:ROWS}\n"
            "    database: ${env:DB:-spanprof_test}\n    password: a$$b${env:PW}\n")
        cfg = load_text(text, FACTORIES, env={"ROWS": "1234", "PW": "secret"})
        ch = cfg.exporters["clickhouse"]
        assert ch.batch_rows == 1234
        assert ch.database == "spanprof_test"
        assert ch.password == "a$bsecret"

    def test_a_whole_value_reference_keeps_a_string_a_string(self) -> None:
        """A password that YAML would read as a number, a bool or a comment is the
        password (a Kubernetes Secret injected as ${env:CLICKHOUSE_PASSWORD})."""
        text = (TESTDATA / "base.yaml").read_text().replace(
            "  clickhouse:\n", "  clickhouse:\n    password: ${env:PW}\n"
            "    batch_rows: ${env:ROWS}\n")
        for pw in ("123456", "true", "#hash", "null", "1.5e3", "- x"):
            ch = load_text(text, FACTORIES, env={"PW": pw, "ROWS": "77"}).exporters["clickhouse"]
            assert (ch.password, ch.batch_rows) == (pw, 77)  # type: ignore[attr-defined]

    def test_named_instances_and_fanout(self) -> None:
        """type/name ids are instances of the type; a pipeline may fan out to several."""
        text = (TESTDATA / "base.yaml").read_text().replace(
            "exporters:\n", "exporters:\n  debug/one:\n  debug/two:\n    verbosity: detailed\n"
        ).replace("exporters: [clickhouse]", "exporters: [clickhouse, debug/one, debug/two]")
        cfg = load_text(text, FACTORIES, env={})
        assert cfg.exporters["debug/two"].verbosity == "detailed"
        assert cfg.exporters["debug/one"].verbosity == "basic"

    @pytest.mark.parametrize("protocols,grpc,http", [
        ("", "127.0.0.1:4317", None),
        ("    protocols:\n      grpc:\n      http:\n", "127.0.0.1:4317", "127.0.0.1:4318"),
        ("    protocols:\n      http:\n        endpoint: 0.0.0.0:9\n", None, "0.0.0.0:9"),
        ("    protocols:\n      grpc: {max_spans_per_request: 5}\n", "127.0.0.1:4317", None),
    ])
    def test_otlp_protocols_as_in_the_collector(self, protocols: str, grpc: str | None,
                                                http: str | None) -> None:
        """A protocol runs when its key is present, even with no value (Collector style);
        no protocols at all means gRPC alone."""
        text = (TESTDATA / "base.yaml").read_text().replace("  otlp:\n",
                                                            "  otlp:\n" + protocols)
        g, h = load_text(text, FACTORIES, env={}).receivers["otlp"].protocols.enabled()
        assert (g and g.endpoint, h and h.endpoint) == (grpc, http)

    def test_otlp_without_any_protocol_is_an_error(self) -> None:
        text = (TESTDATA / "base.yaml").read_text().replace("  otlp:\n",
                                                            "  otlp:\n    protocols: {}\n")
        with pytest.raises(ConfigError) as err:
            load_text(text, FACTORIES, env={})
        assert any("receivers.otlp.protocols: enable at least one protocol" in p
                   for p in err.value.problems), err.value.problems

    @pytest.mark.parametrize("kind,type_", [(k, t) for k, fs in FACTORIES.items()
                                            for t in fs])
    def test_empty_section_decodes_to_defaults(self, kind: str, type_: str) -> None:
        """`{}` (or an empty YAML section) is a complete, valid config for every component
        but the auth extension, which has no tokens to check without being given some."""
        f = FACTORIES[kind][type_]  # type: ignore[index]
        cfg = msgspec.convert({}, f.config)
        if type_ == "tenantauth":
            with pytest.raises(ConfigError, match="tokens_file: give tokens_file"):
                cfg.validate()
        elif hasattr(cfg, "validate"):
            cfg.validate()


class TestDuration:
    @pytest.mark.parametrize("text,seconds", [("250ms", 0.25), ("10s", 10.0), ("5m", 300.0),
                                              ("1h", 3600.0), ("7d", 604800.0), (3, 3.0),
                                              ("1.5s", 1.5), ("20", 20.0)])
    def test_parses(self, text: object, seconds: float) -> None:
        """Durations are numbers of seconds or strings with a unit."""
        assert Duration.parse(text) == pytest.approx(seconds)

    @pytest.mark.parametrize("bad", ["", "soon", "-1s", -1, True, "10 years"])
    def test_rejects(self, bad: object) -> None:
        """Anything else is an error, not a silent zero."""
        with pytest.raises(ValueError):
            Duration.parse(bad)


class TestValidateCommand:
    def _run(self, path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", "-c", str(path)],
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"}, cwd=ROOT)

    @pytest.mark.parametrize("name", ["unknown_type", "unknown_key", "wrong_type"])
    def test_exits_2_with_key_path(self, name: str) -> None:
        """`spanprof validate` rejects an unknown component type, an unknown key and a wrong
        type, printing the key path, and exits 2."""
        path = TESTDATA / f"{name}.yaml"
        res = self._run(path)
        assert res.returncode == 2, res
        assert f"error: {expected(path)}" in res.stderr.splitlines()

    def test_ok(self) -> None:
        """A good file validates with exit code 0 and starts nothing."""
        res = self._run(ROOT / "config" / "local.yaml")
        assert res.returncode == 0, res.stderr
        assert "ok (3 pipelines)" in res.stdout

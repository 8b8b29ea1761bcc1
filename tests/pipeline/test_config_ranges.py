"""Hostile configuration: values out of range, every problem in one run, no traceback for
any operator mistake, secrets redacted, and ports that cannot be bound."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import check_endpoint, load_text
from pipeline.errors import ConfigError
from pipeline.graph import build
from pipeline.log import forget_secrets, redact, redact_event, remember_secret
from pipeline.registry import default_factories

FACTORIES = default_factories()
TESTDATA = Path(__file__).parent / "testdata"
ROOT = Path(__file__).resolve().parents[2]
BASE = (TESTDATA / "base.yaml").read_text()


def with_exporter(lines: str) -> str:
    return BASE.replace("  clickhouse:\n", "  clickhouse:\n" + lines)


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_text(text, FACTORIES, env={})
    return err.value.problems


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd=ROOT)


@pytest.fixture(autouse=True)
def _no_remembered_secrets() -> Iterator[None]:
    forget_secrets()
    yield
    forget_secrets()


class TestRanges:
    @pytest.mark.parametrize("lines,expected", [
        ("    flush_interval: .nan\n", "flush_interval: expected a finite duration, got nan"),
        ("    flush_interval: .inf\n", "flush_interval: expected a finite duration, got inf"),
        ("    flush_interval: 0\n", "flush_interval: must be greater than 0 (e.g. 500ms, 10s)"),
        ("    flush_interval: 0s\n", "flush_interval: must be greater than 0 (e.g. 500ms, 10s)"),
        ("    timeout: -1\n", "timeout: a duration cannot be negative"),
        ("    timeout: 5000000000\n", "timeout: must be at most 100 years, got 5000000000"),
        ("    batch_rows: 0\n", "batch_rows: expected int >= 1"),
        ("    max_pending_rows: -5\n", "max_pending_rows: expected int >= 1"),
        (f"    batch_rows: {10**30}\n", "batch_rows: expected int <= 9223372036854775807"),
        ("    retry_on_failure: {max_interval: 0}\n",
         "retry_on_failure.max_interval: must be greater than 0 (e.g. 500ms, 10s)"),
    ])
    def test_out_of_range_is_refused_with_its_key(self, lines: str, expected: str) -> None:
        """NaN, infinity, 0, negative and absurdly large durations and sizes are errors
        naming the key, not a busy loop, a hang or an overflow later."""
        assert f"exporters.clickhouse.{expected}" in problems_of(with_exporter(lines))

    @pytest.mark.parametrize("section,lines,expected", [
        ("receivers", "  otlp:\n    protocols:\n      http:\n        max_request_bytes: -5\n",
         "receivers.otlp.protocols.http.max_request_bytes: expected int >= 1"),
        ("receivers", "  otlp:\n    protocols:\n      grpc:\n        max_recv_msg_size_mib: 4096\n",
         "receivers.otlp.protocols.grpc.max_recv_msg_size_mib: expected int <= 2047"),
        ("receivers", "  otlp:\n    protocols:\n      grpc:\n        max_concurrent_streams: 0\n",
         "receivers.otlp.protocols.grpc.max_concurrent_streams: expected int >= 1"),
        ("processors", "  batch:\n    send_batch_size: 0\n",
         "processors.batch.send_batch_size: expected int >= 1"),
    ])
    def test_component_sizes(self, section: str, lines: str, expected: str) -> None:
        """Receiver limits and processor sizes use the same range-checked types."""
        text = BASE.replace("  otlp:\n", "") if section == "receivers" else BASE
        text = text.replace(f"{section}:\n", f"{section}:\n{lines}") if f"{section}:" in text \
            else text + f"{section}:\n{lines}"
        assert expected in problems_of(text)

    def test_zero_means_off_where_documented(self) -> None:
        """ttl: 0 keeps data forever and batch timeout: 0 sends at once: both load."""
        text = with_exporter("    ttl: 0\n") + "processors:\n  batch:\n    timeout: 0\n"
        cfg = load_text(text.replace("exporters: [clickhouse]",
                                     "processors: [batch]\n      exporters: [clickhouse]"),
                        FACTORIES, env={})
        assert cfg.exporters["clickhouse"].ttl == 0
        assert cfg.processors["batch"].timeout == 0


class TestEndpoints:
    @pytest.mark.parametrize("endpoint,message", [
        ("127.0.0.1:99999", "port must be 1-65535 (0: any free port), got 99999"),
        ("127.0.0.1:-1", "expected HOST:PORT, got '127.0.0.1:-1'"),
        ("127.0.0.1:http", "expected HOST:PORT, got '127.0.0.1:http'"),
        (":4317", "expected HOST:PORT, got ':4317'"),
        ("4317", "expected HOST:PORT, got '4317'"),
        ("host:", "expected HOST:PORT, got 'host:'"),
        ("host :4317", "expected HOST:PORT, got 'host :4317'"),
        ("h:\u0664\u0663\u0661\u0667", "expected HOST:PORT, got 'h:\u0664\u0663\u0661\u0667'"),
    ])
    def test_refused(self, endpoint: str, message: str) -> None:
        """Out-of-range, negative, named or non-ASCII ports and empty hosts are refused."""
        with pytest.raises(ConfigError) as err:
            check_endpoint(endpoint, "k")
        assert err.value.problems == [f"k: {message}"]

    @pytest.mark.parametrize("endpoint,port", [("127.0.0.1:0", 0), ("0.0.0.0:65535", 65535),
                                               ("[::1]:4317", 4317), ("localhost:1", 1)])
    def test_accepted(self, endpoint: str, port: int) -> None:
        """1-65535, and 0 for "any free port" (how the tests start pipelines)."""
        assert check_endpoint(endpoint)[1] == port

    def test_admin_endpoint_checked_only_when_enabled(self) -> None:
        """A disabled admin API's endpoint is not used, so it is not checked."""
        bad = BASE.replace("service:\n", "service:\n  admin: {endpoint: 'h:70000'}\n")
        assert "service.admin.endpoint: port must be 1-65535 (0: any free port), got 70000" \
            in problems_of(bad)
        off = BASE.replace("service:\n", "service:\n  admin: {enabled: false, endpoint: x}\n")
        assert load_text(off, FACTORIES, env={}).service.admin.enabled is False


BROKEN = """\
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:99999", max_concurrent_streams: 0}
  bogus:
processors:
  batch: {timeout: .nan, send_batch_size: 0}
exporters:
  clickhouse: {ttl: 0, timeout: -1, cluster: "a b"}
  debug: {verbosity: 7}
  1: x
connectors: [spancorrelator]
service:
  telemetry: {logs: {level: loud}}
  admin: {endpoint: "localhost:http"}
  pipelines:
    traces:
      receivers: [otlp, otlp]
      processors: [batch, nope]
      exporters: [debug, kafka]
    traces/2: []
    logs: {receivers: [otlp], exporters: [debug]}
"""


class TestEveryProblemAtOnce:
    def test_one_run_reports_everything_with_key_paths(self) -> None:
        """Wrong types, bad values, unknown types, bad ids, a list where a mapping belongs
        and pipelines naming missing components: all in one run, each with its path."""
        problems = problems_of(BROKEN)
        for expected in [
            "receivers.otlp.protocols.grpc.max_concurrent_streams: expected int >= 1",
            "receivers.otlp.protocols.grpc.endpoint: port must be 1-65535 (0: any free port),"
            " got 99999",
            "receivers.bogus: unknown receiver type 'bogus' (known: kafka, otlp, pyroscope)",
            "processors.batch.timeout: expected a finite duration, got nan",
            "processors.batch.send_batch_size: expected int >= 1",
            "exporters.clickhouse.timeout: a duration cannot be negative",
            "exporters.clickhouse.cluster: must be letters, digits and _, got 'a b'",
            "exporters.debug.verbosity: expected str, got int",
            "exporters.1: expected a component id, type or type/name (e.g. otlp, batch/traces)",
            "connectors: expected a mapping of component ids, got list",
            "service.telemetry.logs.level: invalid enum value 'loud'",
            "service.admin.endpoint: expected HOST:PORT, got 'localhost:http'",
            "service.pipelines.traces/2: expected object, got array",
            "service.pipelines.traces.receivers[1]: 'otlp' is listed twice",
            "service.pipelines.traces.processors[1]: 'nope' is not defined in processors:",
            "service.pipelines.traces.exporters[1]: 'kafka' is not defined in exporters:",
            "service.pipelines.logs: unknown signal 'logs' (known: traces, profiles, "
            "attributions)",
        ]:
            assert expected in problems, (expected, problems)

    def test_both_otlp_protocols_are_checked_in_one_run(self) -> None:
        """A bad gRPC endpoint does not hide a bad HTTP one, nor an OTLP sample limit over
        what a request's values may sum to (2^21 records)."""
        problems = problems_of("""
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "x:99999", max_samples_per_request: 3000000}
      http: {endpoint: ":1"}
exporters: {debug: {}}
service: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}
""")
        assert problems == [
            "receivers.otlp.protocols.grpc.max_samples_per_request: expected int <= 2097152",
            "receivers.otlp.protocols.grpc.endpoint: port must be 1-65535 (0: any free port),"
            " got 99999",
            "receivers.otlp.protocols.http.endpoint: expected HOST:PORT, got ':1'",
        ]

    def test_missing_service_does_not_stop_the_check(self) -> None:
        """No service: section is one problem among the others, not the only one."""
        problems = problems_of("receivers:\n  otlpx:\nexporters:\n  debug: {verbosity: 7}\n")
        assert problems == [
            "receivers.otlpx: unknown receiver type 'otlpx' (known: kafka, otlp, pyroscope)",
            "exporters.debug.verbosity: expected str, got int",
            "service: required key is missing",
        ]

    @pytest.mark.parametrize("text,expected", [
        ("[1, 2]", "<config>: the top level must be a mapping, got list"),
        ("'just a string'", "<config>: the top level must be a mapping, got str"),
        ("service:\n", "service: expected a mapping with pipelines:, got nothing"),
        ("service: [pipelines]\n", "service: expected a mapping with pipelines:, got list"),
        ("service: {}\n", "service.pipelines: required key is missing"),
        ("service: {pipelines: {}}\n", "service.pipelines: at least one pipeline is required"),
        ("service: {pipelines: {traces: {receivers: [otlp], exporters: [1]}}}\n",
         "service.pipelines.traces.exporters[0]: expected str, got int"),
        ("service: {pipelines: {1: {receivers: [otlp]}}}\n",
         "service.pipelines.1: keys must be strings, got int"),
        ("processors: {'batch/': {}}\nservice: {pipelines: {}}\n",
         "processors.batch/: expected a component id, type or type/name "
         "(e.g. otlp, batch/traces)"),
        ("receivers: {otlp: [1]}\nservice: {pipelines: {}}\n",
         "receivers.otlp: expected object, got array"),
        ("receivers: {otlp: {protocols: {grpc: {endpoint: '${env:NOPE}'}}}}\n",
         "receivers.otlp.protocols.grpc.endpoint: environment variable NOPE is not set and "
         "has no default"),
        ("\u00fcber: 1\nservice: {pipelines: {}}\n", "\u00fcber: unknown key"),
        ("? [a, b]\n: 1\n", "<config>: not valid YAML"),
        ("[" * 5000, "<config>: not valid YAML"),
    ])
    def test_shapes(self, text: str, expected: str) -> None:
        """Every wrong shape at every level is a problem with a key path."""
        problems = problems_of(text)
        assert any(p.startswith(expected) for p in problems), problems

    def test_corpus_never_raises_anything_but_config_error(self) -> None:
        """Every value of config/local.yaml replaced, one at a time, by a wrong type, a null,
        a huge number, NaN, unicode or a missing env reference: each load ends in a
        ConfigError (or a valid config that builds), never another exception."""
        base = yaml.safe_load((ROOT / "config" / "local.yaml").read_text())
        bad: list[Any] = [None, [], {}, [1, "x"], {"a": 1}, 0, -1, 10**30, 1e400,
                          float("nan"), True, "", "\u00fcn\u00efcode\u2603", "${env:NOPE}",
                          {1: 2}, {None: 1}, "1e999"]
        # libyaml's emitter where PyYAML has it: the same documents, written ~5x faster
        # than by the pure Python one (only a top-level scalar lacks the "..." end mark)
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        count = 0
        for path in _paths(base):
            for value in bad:
                doc = _replace(copy.deepcopy(base), path, value)
                text = yaml.dump(doc, Dumper=dumper, allow_unicode=True)
                count += 1
                try:
                    build(load_text(text, FACTORIES, env={}), FACTORIES)
                except ConfigError as err:
                    assert err.problems and all(p for p in err.problems)
        assert count > 500


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


class TestRedaction:
    def test_redact_text(self) -> None:
        """URL passwords, password=/token: pairs and remembered values are masked; key
        paths in config problems stay readable."""
        remember_secret("hunter22")
        assert redact("http://alice:s3cret@db:8123/x") == "http://alice:***@db:8123/x"
        assert redact("failed: password=abc&user=x") == "failed: password=***&user=x"
        assert redact('{"token": "xyz"}') == '{"token": "***"}'
        assert redact("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
        assert redact("pw is hunter22!") == "pw is ***!"
        assert redact("Code: 516. db_password=abc1 clickhouse_password: 'x'") == \
            "Code: 516. db_password=*** clickhouse_password: '***'"
        assert redact("exporters.clickhouse.password: expected str, got int") == \
            "exporters.clickhouse.password: expected str, got int"

    def test_log_processor(self) -> None:
        """Secret-named fields are masked whatever their value; other fields are scanned."""
        out = redact_event(None, "info", {
            "event": "connected", "password": "pw", "db_password": 123,
            "endpoint": "https://u:p4ss@h:8443", "headers": {"Authorization": "Basic x"},
            "exception": "Traceback ... password=topsecret"})
        assert out == {"event": "connected", "password": "***", "db_password": "***",
                       "endpoint": "https://u:***@h:8443", "headers": {"Authorization": "***"},
                       "exception": "Traceback ... password=***"}

    def test_loading_remembers_the_config_secrets(self) -> None:
        """After a load, the password and the URL password are masked in any text."""
        text = with_exporter("    endpoint: http://alice:url%40pass1@db:8123\n"
                             "    password: ${env:PW}\n")
        load_text(text, FACTORIES, env={"PW": "envpass1"})
        # the URL password as written and as the client is given it (percent-decoded)
        assert redact("x envpass1 url%40pass1 url@pass1 y") == "x *** *** *** y"

    def test_validate_output_has_no_secret(self, tmp_path: Path) -> None:
        """`spanprof validate` masks secrets that a problem message quotes."""
        path = tmp_path / "c.yaml"
        path.write_text(with_exporter("    endpoint: tcp://alice:urlpass1@db:9000\n"
                                      "    password: pw_plain_1\n"
                                      "    cluster: 'x pw_plain_1'\n"))
        res = cli("validate", "-c", str(path))
        assert res.returncode == 2, res
        assert "urlpass1" not in res.stderr and "pw_plain_1" not in res.stderr
        assert "error: exporters.clickhouse.endpoint: expected chdb://PATH, http://HOST:PORT " \
               "or https://HOST:PORT, got 'tcp://alice:***@db:9000'" in res.stderr.splitlines()

    async def test_clickhouse_start_error_has_no_secret(self) -> None:
        """A ClickHouse that cannot be reached: the error names the key and the endpoint,
        without the URL's password (clickhouse-connect's text quotes what it was given)."""
        from pipeline.config import Duration
        from pipeline.exporters.clickhouse.exporter import ClickHouseExporter
        from pipeline.exporters.clickhouse.exporter import Config as CHConfig
        from pipeline.registry import Context

        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ex = ClickHouseExporter(CHConfig(endpoint=f"http://alice:urlpass1@127.0.0.1:{port}",
                                         password="pw_plain_1", timeout=Duration(2)),
                                Context("clickhouse", ["traces"]))
        with pytest.raises(ConfigError) as err:
            await ex.start()
        await ex.shutdown()
        message = str(err.value)
        assert message.startswith(f"exporters.clickhouse.endpoint: cannot use ClickHouse at "
                                  f"http://alice:***@127.0.0.1:{port}: ")
        assert "urlpass1" not in message and "pw_plain_1" not in message


LISTENERS = """\
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{g}"}}
      http: {{endpoint: "127.0.0.1:{h}"}}
  pyroscope: {{endpoint: "127.0.0.1:{p}"}}
exporters:
  debug:
service:
  admin: {{endpoint: "127.0.0.1:{a}"}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [debug]}}
    profiles: {{receivers: [pyroscope], exporters: [debug]}}
"""


class TestTakenPort:
    @pytest.mark.parametrize("which,key", [
        ("g", "receivers.otlp.protocols.grpc.endpoint"),
        ("h", "receivers.otlp.protocols.http.endpoint"),
        ("p", "receivers.pyroscope.endpoint"),
        ("a", "service.admin.endpoint"),
    ])
    def test_one_line_naming_the_key_exit_2(self, which: str, key: str,
                                            tmp_path: Path) -> None:
        """Every listener: a port already taken ends `spanprof run` with exit 2 and one
        error line naming the config key and the endpoint, no traceback."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            ports = {k: 0 for k in "ghpa"} | {which: port}
            path = tmp_path / "c.yaml"
            path.write_text(LISTENERS.format(**ports))
            res = cli("run", "-c", str(path))
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, res.stderr
        assert errors[0].startswith(f"error: {key}: cannot listen on 127.0.0.1:{port}: ")


class TestSchemaCommand:
    def test_config_schema_is_json(self) -> None:
        """`spanprof schema config` still prints a JSON Schema of the document."""
        res = cli("schema", "config")
        assert res.returncode == 0, res.stderr
        schema = json.loads(res.stdout)
        assert "ServiceConfig" in schema["$defs"]

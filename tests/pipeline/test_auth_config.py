"""Extensions in the config (issue #17): ``extensions:`` defines them, ``service.extensions``
starts them, a listener's ``auth: {authenticator: ID}`` must name a started one; an inline
token never appears in an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_text
from pipeline.errors import ConfigError
from pipeline.log import redact
from pipeline.registry import default_factories

FACTORIES = default_factories()
TOKEN = "tok-inline-secret-8f2a9c1d"

BASE = """
extensions:
  tenantauth: {tokens: {"%s": team-a}}
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0", auth: {authenticator: %s}}
  pyroscope: {endpoint: "127.0.0.1:0", auth: {authenticator: tenantauth}}
exporters:
  debug: {}
service:
  extensions: [%s]
  admin: {endpoint: "127.0.0.1:0", auth: {authenticator: tenantauth}}
  pipelines:
    traces: {receivers: [otlp], exporters: [debug]}
    profiles: {receivers: [otlp, pyroscope], exporters: [debug]}
"""


def test_a_started_extension_named_by_every_listener_loads() -> None:
    cfg = load_text(BASE % (TOKEN, "tenantauth", "tenantauth"), FACTORIES, env={})
    assert cfg.service.extensions == ["tenantauth"]
    assert cfg.extensions["tenantauth"].tokens == {TOKEN: "team-a"}
    assert cfg.receivers["otlp"].protocols.grpc.auth.authenticator == "tenantauth"


def test_undefined_or_not_started_extensions_are_named() -> None:
    with pytest.raises(ConfigError) as err:
        load_text(BASE % (TOKEN, "nope", "ghost"), FACTORIES, env={})
    problems = err.value.problems
    assert "service.extensions[0]: 'ghost' is not defined in extensions:" in problems
    for key in ("receivers.otlp.protocols.grpc", "receivers.pyroscope", "service.admin"):
        assert any(p.startswith(f"{key}.auth.authenticator: ") for p in problems), problems
    assert "receivers.otlp.protocols.grpc.auth.authenticator: 'nope' is not an extension " \
           "started by service.extensions" in problems


def test_an_inline_token_is_redacted_from_errors(tmp_path: Path) -> None:
    bad = BASE.replace('{"%s": team-a}', '{"%s": "bad tenant!"}')
    with pytest.raises(ConfigError) as err:
        load_text(bad % (TOKEN, "tenantauth", "tenantauth"), FACTORIES, env={})
    shown = "\n".join(redact(p) for p in err.value.problems)
    assert "extensions.tenantauth" in shown
    assert TOKEN not in shown


def test_validate_accepts_listeners_naming_a_started_extension(tmp_path: Path) -> None:
    """``spanprof validate`` builds the graph as ``run`` does, extensions included: a
    listener naming ``tenantauth`` is not refused as naming an extension not started."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(BASE % (TOKEN, "tenantauth", "tenantauth"))
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert TOKEN not in res.stdout + res.stderr

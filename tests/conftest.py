"""Shared fixtures: free ports, a real ``spanprof run`` process, the embedded ClickHouse."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


_ISSUED: set[int] = set()


def free_port() -> int:
    """A free loopback port never handed out before in this session: ports are released
    before the process that will use them binds them, so two processes set up one after
    the other could otherwise be given the same one (seen: a correlator's admin port equal
    to its gateway's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port


def pipeline_yaml(grpc_port: int, admin_port: int, data: Path, grace: str = "1s",
                  extra_connector: str = "", exporter_extra: str = "", http_port: int = 0,
                  pyroscope_port: int = 0, receiver_extra: str = "") -> str:
    """The embedded pipeline of config/local.yaml on free ports (the OTLP/HTTP and
    Pyroscope receivers only when given a port); ``receiver_extra``: more keys of the
    ``otlp`` receiver (e.g. its ``intake``)."""
    http = f"""
      http:
        endpoint: 127.0.0.1:{http_port}""" if http_port else ""
    pyroscope = f"""
  pyroscope:
    endpoint: 127.0.0.1:{pyroscope_port}""" if pyroscope_port else ""
    return f"""
receivers:
  otlp:
    {receiver_extra}
    protocols:
      grpc:
        endpoint: 127.0.0.1:{grpc_port}{http}{pyroscope}
processors:
  batch:
    timeout: 50ms
connectors:
  spancorrelator:
    grace: {grace}
    flush_interval: 200ms
    {extra_connector}
exporters:
  clickhouse:
    endpoint: chdb://{data}
    flush_interval: 200ms
    {exporter_extra}
service:
  admin:
    endpoint: 127.0.0.1:{admin_port}
  telemetry:
    logs:
      encoding: json
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [clickhouse, spancorrelator]
    profiles:
      receivers: [otlp{", pyroscope" if pyroscope_port else ""}]
      exporters: [clickhouse, spancorrelator]
    attributions:
      receivers: [spancorrelator]
      exporters: [clickhouse]
"""


class SpanprofProcess:
    """``spanprof run`` in a child process, as a user runs it."""

    def __init__(self, tmp: Path, config_text: str | None = None, **yaml_kw: Any) -> None:
        """``config_text`` may use {grpc_port}, {http_port}, {pyroscope_port},
        {admin_port} and {data} placeholders; without it the default pipeline also runs
        OTLP/HTTP and Pyroscope receivers."""
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.pyroscope_port = free_port()
        self.admin_port = free_port()
        self.data = tmp / "data"
        self.config = tmp / "pipeline.yaml"
        text = pipeline_yaml(self.grpc_port, self.admin_port, self.data,
                             http_port=self.http_port, pyroscope_port=self.pyroscope_port,
                             **yaml_kw) \
            if config_text is None else config_text.format(
                grpc_port=self.grpc_port, admin_port=self.admin_port, data=self.data,
                http_port=self.http_port, pyroscope_port=self.pyroscope_port)
        self.config.write_text(text)
        self.log_path = tmp / "spanprof.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # set when the admin API is served over TLS: https, verified with this context
        self.admin_ssl: ssl.SSLContext | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pyroscope_url(self) -> str:
        return f"http://127.0.0.1:{self.pyroscope_port}"

    @property
    def admin(self) -> str:
        scheme = "https" if self.admin_ssl is not None else "http"
        return f"{scheme}://127.0.0.1:{self.admin_port}"

    def start(self, timeout: float = 60.0) -> None:
        _STARTED.append(self)
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="268435456")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "run", "-c", str(self.config)],
            cwd=self.tmp, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"spanprof exited {self.proc.returncode}:\n{self.logs()}")
            try:
                health = self.get("/health")
                if health["status"] == "ok":
                    # the answer must come from this process, not another on that port
                    assert health["pid"] == self.proc.pid, "admin port taken by another process"
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"spanprof did not become healthy:\n{self.logs()}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> Any:
        req = urllib.request.Request(self.admin + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=10, context=self.admin_ssl) as resp:
            return json.loads(resp.read())

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()
        return rc


_STARTED: list[SpanprofProcess] = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    """A test that fails half-way leaves no `spanprof run` behind (it would hold ports,
    CPU and the embedded engine's files for the rest of the session)."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)


@pytest.fixture
def spanprof(tmp_path: Path) -> Iterator[SpanprofProcess]:
    p = SpanprofProcess(tmp_path)
    yield p
    if p.proc is not None and p.proc.poll() is None:
        p.stop(signal.SIGKILL)


@contextlib.contextmanager
def clickhouse(path: Path) -> Iterator[Any]:
    """The embedded engine on ``path`` (only once no other process has it open)."""
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
    try:
        yield client
    finally:
        client.close()


def wait_until(fn: Any, timeout: float = 30.0, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met in {timeout}s; last value: {last!r}")


def side_by_side(*calls: Any) -> list[Any]:
    """Run the calls at once (processes starting or stopping, clients), each to its end:
    their results in order, or the first error."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real Kafka broker for the whole session (jars fetched with Maven and cached)."""
    from tests.kafka_broker import KafkaBroker, KafkaUnavailable

    try:
        broker = KafkaBroker(tmp_path_factory.mktemp("kafka"))
        broker.start()
    except KafkaUnavailable as err:
        pytest.fail(str(err), pytrace=False)
    yield broker
    broker.stop()

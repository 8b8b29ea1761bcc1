"""Files the real Collector wrote, read back: an OTLP receiver and the contrib file
exporter (``tests/backfill/collector``: v0.165.1, built once into ``~/.cache/spanprof``)
fed spans by the OpenTelemetry Python SDK and a profiles request over OTLP/gRPC; every
exporter format (json, proto, and zstd around each), with the default per-message zstd
and with the ``exporter.file.nativeCompression`` gate, traces and profiles in one file
as one exporter in two pipelines writes them.

The build needs Go and, the first time, the Go module proxy (about two minutes).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from pipeline.backfill import files
from pipeline.backfill.file_pieces import Piece
from pipeline.otlp.profiles import decode_profiles
from tests.backfill import collector_files as C
from tests.cachelock import cache_lock
from tests.conftest import free_port

SRC = Path(__file__).resolve().parent / "collector"
EXPORTERS = {  # name -> (file, its config)
    "json": ("out.jsonl", {}),
    "proto": ("out.bin", {"format": "proto"}),
    "json_zstd": ("out.json.zst", {"compression": "zstd"}),
    "proto_zstd": ("out.bin.zst", {"format": "proto", "compression": "zstd"}),
}


def cache_root() -> Path:
    return Path(os.environ.get("SPANPROF_CACHE", Path.home() / ".cache" / "spanprof"))


@pytest.fixture(scope="session")
def otelcol() -> Path:
    """The Collector of tests/backfill/collector, built once per content of its sources."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK):
        pytest.fail("go is not on PATH: this test builds a Collector", pytrace=False)
    digest = hashlib.sha256(b"".join((SRC / n).read_bytes()
                                     for n in ("main.go", "go.mod", "go.sum"))).hexdigest()
    out = cache_root() / f"otelcol-file-{digest[:16]}" / "otelcol"
    with cache_lock("otelcol-file"):
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        go_cache = cache_root() / "go"
        env = dict(os.environ, GOMODCACHE=str(go_cache / "mod"), GOCACHE=str(go_cache / "build"),
                   GOTOOLCHAIN="local", CGO_ENABLED="0",
                   GOFLAGS="-mod=readonly -modcacherw -buildvcs=false")
        try:
            proc = subprocess.run([go, "build", "-trimpath", "-o", f"{out}.partial", "."],
                                  cwd=SRC, env=env, capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired:
            pytest.fail(f"go build of {SRC} took over 1200 s", pytrace=False)
        if proc.returncode != 0:
            pytest.fail(f"go build of {SRC} failed:\n{proc.stderr[-4000:]}", pytrace=False)
        os.replace(f"{out}.partial", out)
    return out


def config(tmp: Path, port: int) -> str:
    lines = ["receivers:", "  otlp:", "    protocols:", "      grpc:",
             f"        endpoint: 127.0.0.1:{port}", "exporters:"]
    for name, (path, cfg) in EXPORTERS.items():
        lines += [f"  file/{name}:", f"    path: {tmp / path}"]
        lines += [f"    {k}: {v}" for k, v in cfg.items()]
    names = ", ".join(f"file/{n}" for n in EXPORTERS)
    lines += ["service:", "  telemetry:", "    metrics:", "      level: none",
              "  pipelines:", "    traces:", "      receivers: [otlp]",
              f"      exporters: [{names}]", "    profiles:", "      receivers: [otlp]",
              f"      exporters: [{names}]"]
    return "\n".join(lines) + "\n"


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the Collector exited {proc.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"the Collector did not listen within 30 s:\n{log.read_text()[-3000:]}")


class Written(NamedTuple):
    dir: Path
    spans: list[Any]  # as the SDK made them
    profiles: Any  # the ExportProfilesServiceRequest sent
    native: bool  # exporter.file.nativeCompression on


@pytest.fixture(params=["per-message zstd", "nativeCompression"])
def written(request: Any, otelcol: Path, tmp_path: Path) -> Iterator[Written]:
    """The Collector's files after it received two span batches (SDK) and a profiles
    request, and was stopped (which flushes them); with the spans and request sent."""
    port = free_port()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config(tmp_path, port))
    gates = "service.profilesSupport" + (
        ",exporter.file.nativeCompression" if request.param == "nativeCompression" else "")
    log = tmp_path / "otelcol.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(otelcol), f"--config={cfg}", f"--feature-gates={gates}"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc, log)
        provider = TracerProvider(resource=Resource.create({"service.name": "backfill"}))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)))
        tracer = provider.get_tracer("backfill-test")
        sent = []
        for name in ("a", "b", "c"):
            with tracer.start_as_current_span(name) as span:
                sent.append(span)
        provider.shutdown()
        req = C.profiles(7)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            profiles_service_pb2_grpc.ProfilesServiceStub(ch).Export(req, timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        yield Written(tmp_path, sent, req, request.param == "nativeCompression")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class TestCollectorFiles:
    @pytest.mark.parametrize("exporter", list(EXPORTERS))
    def test_reads_what_the_collector_wrote(self, written: Written, exporter: str) -> None:
        """Every span the SDK sent and every sample of the profiles request (its thread
        attributes too), from each
        exporter's file, with nothing refused and no error. The framing is the one
        otlp_files.py's docstring gives: json lines; length prefixes for proto, and for zstd by
        default (a frame per message, json too); one zstd stream with the gate."""
        sent, req = written.spans, written.profiles
        path = written.dir / EXPORTERS[exporter][0]
        kind = files.detect(path, path.read_bytes()[:files.HEAD_BYTES])
        zstd = exporter.endswith("zstd")
        assert kind.compression == ("zstd" if zstd and written.native else "")
        assert kind.format == ("otlp-json" if exporter == "json" or zstd and written.native
                               and exporter.startswith("json") else "otlp-proto")
        got = list(files.read(path))
        assert got and all(isinstance(it, Piece) and it.rejected == 0 for it in got), got
        spans = [s for it in got if it.batch.signal == "traces" for s in it.batch.spans]
        assert sorted((s.trace_id, s.span_id, s.name) for s in spans) == sorted(
            (s.context.trace_id.to_bytes(16, "big"), s.context.span_id.to_bytes(8, "big"),
             s.name) for s in sent)
        assert {s.service for s in spans} == {"backfill"}
        samples = [s for it in got if it.batch.signal == "profiles" for s in it.batch.samples]
        want = decode_profiles(req).batch.samples
        assert sorted(map(_key, samples)) == sorted(map(_key, want))


def _key(s: Any) -> tuple[bytes, bytes, str, int, int, int, str]:
    return s.trace_id, s.span_id, s.service, s.value, s.time_ns, s.thread_id, s.thread_name

"""What TLS and tokens cost per request: the same `spanprof run` (OTLP gRPC and HTTP into
the `debug` exporter, so that the door is most of the work) started twice, plain and with
TLS on every listener and the `tenantauth` extension named by each, given the same
requests in one run. Reported per case: the server's CPU per request (from
/proc/PID/stat) and the client's p50 latency, and the ratio TLS+auth / plain.

Cases: gRPC on one channel (TLS costs only its record encryption and the token check),
HTTP with keep-alive, and HTTP with a new connection per request (a TLS handshake each:
what a client that does not reuse connections costs).

    make bench   # or: python bench/bench_security.py --requests 2000
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_latency import free_port  # noqa: E402
from bench.bench_pipeline import TRACE, trace_requests  # noqa: E402
from tests.certs import CertAuthority  # noqa: E402

TOKEN = "tok-bench-security-5d3c1a9e7f"

CONFIG = """
extensions:
  tenantauth: {{tokens: {{"{token}": bench}}}}
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{grpc}"{sec}}}
      http: {{endpoint: "127.0.0.1:{http}"{sec}}}
exporters:
  debug: {{}}
service:
  extensions: [{ext}]
  admin: {{endpoint: "127.0.0.1:{admin}"}}
  telemetry: {{logs: {{level: warning, encoding: json}}}}
  pipelines:
    traces: {{receivers: [otlp], exporters: [debug]}}
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, tmp: Path, secure: bool, ca: CertAuthority) -> None:
        self.ports = {k: free_port() for k in ("grpc", "http", "admin")}
        sec = ""
        if secure:
            srv = ca.issue(f"server-{self.ports['grpc']}")
            sec = (f", tls: {{cert_file: {srv.cert}, key_file: {srv.key}}}, "
                   "auth: {authenticator: tenantauth}")
        cfg = tmp / f"{'secure' if secure else 'plain'}.yaml"
        cfg.write_text(CONFIG.format(token=TOKEN, sec=sec, ext="tenantauth" if secure else "",
                                     **self.ports))
        self.log = open(cfg.with_suffix(".log"), "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "-c",
                                      str(cfg)], cwd=tmp, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.ports['admin']}/health",
                                       timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit(f"spanprof did not start: {cfg.with_suffix('.log').read_text()}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.log.close()


def measure(server: Server, send: object, n: int) -> tuple[float, float]:
    """(server CPU microseconds per request, client p50 milliseconds)."""
    lat = []
    c0 = cpu_seconds(server.proc.pid)
    for i in range(n):
        t0 = time.perf_counter()
        send(i)  # type: ignore[operator]
        lat.append(time.perf_counter() - t0)
    time.sleep(0.2)  # what the last request left the server to do
    cpu = cpu_seconds(server.proc.pid) - c0
    return cpu / n * 1e6, sorted(lat)[len(lat) // 2] * 1000


def cases(server: Server, secure: bool, ca: CertAuthority, body: bytes,
          n: int) -> dict[str, tuple[float, float]]:
    headers = {"Content-Type": "application/x-protobuf"}
    meta: list[tuple[str, str]] = []
    ctx = None
    if secure:
        headers["Authorization"] = f"Bearer {TOKEN}"
        meta = [("authorization", f"Bearer {TOKEN}")]
        ctx = ssl.create_default_context(cafile=str(ca.path))
    target = f"127.0.0.1:{server.ports['grpc']}"
    channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
        ca.path.read_bytes())) if secure else grpc.insecure_channel(target)
    call = channel.unary_unary(TRACE, request_serializer=None, response_deserializer=None)
    out: dict[str, tuple[float, float]] = {}
    out["grpc, one channel"] = measure(server, lambda i: call(body, metadata=meta,
                                                              timeout=10), n)
    channel.close()
    port = server.ports["http"]

    def connection() -> http.client.HTTPConnection:
        return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10) \
            if secure else http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    kept = connection()

    def keep_alive(i: int) -> None:
        kept.request("POST", "/v1/traces", body=body, headers=headers)
        assert kept.getresponse().read() is not None

    out["http, keep-alive"] = measure(server, keep_alive, n)
    kept.close()

    def fresh(i: int) -> None:
        c = connection()
        c.request("POST", "/v1/traces", body=body, headers=headers)
        resp = c.getresponse()
        resp.read()
        assert resp.status == 200, resp.status
        c.close()

    out["http, new connection"] = measure(server, fresh, max(n // 4, 50))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--spans", type=int, default=10, help="spans per request")
    args = ap.parse_args()
    reqs, _ = trace_requests(args.spans, args.spans)
    body = reqs[0]
    with tempfile.TemporaryDirectory(prefix="spanprof-security-") as d:
        tmp = Path(d)
        ca = CertAuthority(tmp / "pki")
        results = {}
        for secure in (False, True):
            server = Server(tmp, secure, ca)
            try:
                results[secure] = cases(server, secure, ca, body, args.requests)
            finally:
                server.stop()
    print(f"\nTLS + tokens per request ({args.spans} spans each, {args.requests} requests, "
          f"{os.cpu_count()} cores): server CPU us/request and client p50 ms")
    print(f"  {'case':<24} {'plain':>16} {'tls+auth':>16} {'cpu ratio':>10}")
    for case, (cpu, p50) in results[False].items():
        cpu2, p502 = results[True][case]
        print(f"  {case:<24} {cpu:7.0f} {p50:6.2f} ms {cpu2:7.0f} {p502:6.2f} ms "
              f"{cpu2 / cpu:9.2f}x")


if __name__ == "__main__":
    main()

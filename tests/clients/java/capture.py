"""Captures what the Pyroscope Java agent really uploads: tests/testdata/jfr/.

    .venv/bin/python tests/clients/java/capture.py [--out DIR] [--seconds N] [--keep N]

Builds the app beside this file (javaapp.py: ``mvn -q package``, Maven's local repository
under ``~/.cache/spanprof/m2``; the agents come from Maven Central through
``dependency:copy``, pinned in pom.xml), then runs it once per scenario under the Pyroscope
Java agent, the OpenTelemetry Java agent and the Pyroscope OTel extension, with
``PYROSCOPE_SERVER_ADDRESS`` pointing at a small HTTP server in this process. The server
answers 200 to everything and keeps each request; afterwards, for the first ``--keep``
``/ingest`` requests of each scenario, it writes the multipart parts byte for byte as sent
(``SCENARIO-N.jfr.gz``, ``SCENARIO-N.labels.gz``: the agent gzips both) and, in
``requests.json``, the path, query string, headers and part names of each; the root spans
the app made (its stdout: names, ids, thread, start and end in Unix ns) go to
``spans.json``.

Scenarios (``PYROSCOPE_*`` settings of the agent):

* ``itimer``: the agent's default CPU engine (``setitimer``), 100 Hz; allocation
  sampling every 1 MiB (``PYROSCOPE_PROFILER_ALLOC``), lock contention over 1 ms
  (``PYROSCOPE_PROFILER_LOCK``);
* ``wall``: wall-clock sampling (``PYROSCOPE_PROFILER_EVENT=wall``), 100 Hz.

Uploads every 3 s (``PYROSCOPE_UPLOAD_INTERVAL``); the agent does not upload on exit.
The OpenTelemetry agent takes seconds to start, and the first uploads hold mostly its
start-up, so the last ``--keep`` (2) uploads of a 12 s run are kept, and the root spans
that overlap them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: the repo
from tests.clients.java.javaapp import HERE, BuildFailed, build, command  # noqa: E402

REPO = HERE.parents[2]
COMMON = {
    "PYROSCOPE_APPLICATION_NAME": "capture-app",
    "PYROSCOPE_LABELS": "env=test",
    "PYROSCOPE_UPLOAD_INTERVAL": "3s",
    "PYROSCOPE_FORMAT": "jfr",
    "PYROSCOPE_LOG_LEVEL": "info",
    "OTEL_SERVICE_NAME": "capture-app",
    # spans are made and labelled, not exported: the capture is about the profiles
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_LOGS_EXPORTER": "none",
}
SCENARIOS: dict[str, dict[str, str]] = {
    "itimer": {"PYROSCOPE_PROFILER_EVENT": "itimer", "PYROSCOPE_PROFILER_ALLOC": "1m",
               "PYROSCOPE_PROFILER_LOCK": "1ms"},
    "wall": {"PYROSCOPE_PROFILER_EVENT": "wall"},
}


class Recorder(BaseHTTPRequestHandler):
    """Answers 200 to every request and keeps it in ``server.requests``."""

    def do_POST(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = self._chunked()  # okhttp streams the gzipped parts: no Content-Length
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path, _, query = self.path.partition("?")
        self.server.requests.append(  # type: ignore[attr-defined]
            {"method": "POST", "path": path, "query": query,
             "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def parts(body: bytes, content_type: str) -> list[tuple[str, dict[str, str], bytes]]:
    """(name, headers, bytes) of each part of a multipart form."""
    msg = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    out = []
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition") or ""
        payload = part.get_payload(decode=True)
        out.append((str(name), {k.lower(): str(v) for k, v in part.items()},
                    payload if isinstance(payload, bytes) else b""))
    return out


def run(scenario: str, seconds: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Runs the app under the agents; returns the requests it sent and its root spans."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {**os.environ, **COMMON, **SCENARIOS[scenario],
           "PYROSCOPE_SERVER_ADDRESS": f"http://127.0.0.1:{server.server_address[1]}"}
    cmd = command(str(seconds))
    try:
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                             timeout=seconds + 120)
    except subprocess.CalledProcessError as err:
        sys.stderr.write(err.stderr)
        raise
    finally:
        server.shutdown()
        server.server_close()
    sys.stderr.write(f"--- {scenario}: the agents' log, last lines\n"
                     + "\n".join(out.stderr.splitlines()[-15:]) + "\n")
    spans = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return server.requests, spans  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "testdata" / "jfr")
    ap.add_argument("--seconds", type=int, default=12)
    ap.add_argument("--keep", type=int, default=2, help="/ingest requests kept per scenario")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="only these (default: all)")
    args = ap.parse_args()
    try:
        build()
    except BuildFailed as err:
        sys.exit(f"capture.py: {err}")
    args.out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    all_spans: dict[str, Any] = {}
    for scenario in args.scenario or list(SCENARIOS):
        requests, spans = run(scenario, args.seconds)
        ingest = [r for r in requests if r["path"] == "/ingest"]
        others = sorted({r["path"] for r in requests if r["path"] != "/ingest"})
        if others:
            sys.stderr.write(f"{scenario}: also sent {others}\n")
        if not ingest:
            sys.exit(f"{scenario}: the agent sent no /ingest request")
        kept = ingest[-args.keep:]
        for n, req in enumerate(kept, 1):
            entry = {k: req[k] for k in ("method", "path", "query")}
            entry["headers"] = {k: v for k, v in req["headers"].items()
                                if k in ("content-type", "user-agent", "content-encoding")}
            entry["parts"] = {}
            for name, headers, payload in parts(req["body"], req["headers"]["content-type"]):
                file = f"{scenario}-{n}.{name}.gz"
                (args.out / file).write_bytes(payload)
                entry["parts"][name] = {"file": file, "bytes": len(payload), **headers}
            index[f"{scenario}-{n}"] = entry
        # the spans that overlap the kept uploads (from/until: Unix seconds)
        first, last = (int(parse_qs(r["query"])[k][0]) for r, k in ((kept[0], "from"),
                                                                       (kept[-1], "until")))
        all_spans[scenario] = [s for s in spans if s["end"] >= (first - 1) * 10**9
                               and s["start"] <= (last + 1) * 10**9]
        sys.stderr.write(f"{scenario}: {len(ingest)} uploads, kept the last {len(kept)}; "
                         f"{len(all_spans[scenario])} of {len(spans)} root spans\n")
    (args.out / "requests.json").write_text(json.dumps(index, indent=1) + "\n")
    (args.out / "spans.json").write_text("{\n" + ",\n".join(
        f" {json.dumps(name)}: [\n  " + ",\n  ".join(json.dumps(s) for s in spans) + "\n ]"
        for name, spans in all_spans.items()) + "\n}\n")
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"wrote {len(index)} requests to {args.out} ({total} bytes in all)")


if __name__ == "__main__":
    main()

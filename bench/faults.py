"""Scripted fault run (`make faults`): faults under load, then acknowledged vs stored vs
attributed, counted exactly.

A real `spanprof run` (embedded engine) takes a steady load from well-behaved OTLP/gRPC
clients (each retries a refused request after the delay the server asks for, as the SDKs
do) and a hostile one mixing poison values in. While they run:

1. **disk full** for ``--disk-full`` seconds: the data directory lives on its own small
   tmpfs, filled to the last byte by a filler file (needs root to mount; otherwise the
   phase is reported as not run);
2. **ClickHouse down** for ``--down`` seconds: every call to the engine fails as a refused
   connection would (the embedded engine cannot be stopped on its own, so this uses the
   exporter's fault hook, ``SPANPROF_FAILPOINTS``: a file ``clickhouse_down`` in that
   directory);
3. **SIGKILL** mid-load, then the same command started again on the same data.

Then SIGTERM, and the stored tables are read back. Each sample carries a unique value and
its own span, so a sample stored twice, a sample lost, and a span whose attributed CPU is
not exactly its sample's value are each counted. Printed last: acknowledged / stored /
attributed counts, duplicates, and the worst stall a well-behaved client saw (the longest
single call, from sending to an answer of any kind).

    python bench/faults.py                 # the full run (about 3 minutes)
    python bench/faults.py --quick         # shorter phases
    python bench/faults.py --queue         # with the exporter's sending queue (make run's)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2 as pps
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.otlp.builder import ProfileBuilder  # noqa: E402
from tests.conftest import SpanprofProcess, clickhouse  # noqa: E402

TRACE = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROFILES = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export"
SERVICE = "faults"
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}


@dataclass
class Tally:
    """What the clients know: acknowledged items, and the longest single call."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    spans: dict[tuple[bytes, bytes], int] = field(default_factory=dict)  # acked -> cpu
    samples: dict[tuple[bytes, bytes], int] = field(default_factory=dict)
    unlabelled: int = 0  # acknowledged samples without a span (unattributed CPU)
    unlabelled_cpu: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    worst_call: float = 0.0
    worst_call_at: str = ""
    calls: int = 0
    gave_up: int = 0
    poison_sent: int = 0
    poison_rejected: int = 0
    poison_refused: int = 0
    health: dict[str, set[int]] = field(default_factory=dict)  # phase -> /health statuses

    def call(self, seconds: float, where: str) -> None:
        with self.lock:
            self.calls += 1
            if seconds > self.worst_call:
                self.worst_call, self.worst_call_at = seconds, where

    def refuse(self, code: str) -> None:
        with self.lock:
            self.refused[code] = self.refused.get(code, 0) + 1


def retry_delay(err: grpc.RpcError) -> float:
    """The server's RetryInfo delay, as the OTLP exporters read it; 1 s otherwise."""
    for key, value in err.trailing_metadata() or ():
        if key == "google.rpc.retryinfo-bin":
            info = error_details_pb2.RetryInfo.FromString(value)
            return float(info.retry_delay.ToNanoseconds()) / 1e9
    return 1.0


class Phase:
    """The name of what is going on now, for the report of the worst stall."""

    name = "start"


def send(target: str, method: str, body: bytes, tally: Tally, stop: threading.Event,
         deadline_s: float = 600.0) -> bytes | None:
    """Send until acknowledged (retrying what the server says is retryable, and
    connection failures while it restarts); the response, or None if given up."""
    started = time.monotonic()
    t_end = started + deadline_s
    while time.monotonic() < t_end:
        with grpc.insecure_channel(target) as ch:
            call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            t0 = time.monotonic()
            where = (f"{Phase.name}: {method.split('.')[-1]} sent at "
                     f"{time.strftime('%H:%M:%S', time.gmtime())}")
            try:
                resp: bytes = call(body, timeout=30)
                tally.call(time.monotonic() - t0, where)
                return resp
            except grpc.RpcError as err:
                took = time.monotonic() - t0
                code = err.code()
                # a refused connection (process down) is not a stall of the server's making
                if "connect" not in (err.details() or "").lower():
                    tally.call(took, f"{where}, {code.name}")
                tally.refuse(code.name)
                if code not in RETRYABLE:
                    raise
                delay = retry_delay(err)
        if stop.is_set() and time.monotonic() - started > 120:  # draining: not for ever
            break
        time.sleep(min(delay, 5.0))
    tally.gave_up += 1
    return None


def good_client(n: int, target: str, tally: Tally, stop: threading.Event,
                spans_per_req: int) -> None:
    """One trace request, then one profile request with a sample per span."""
    i = 0
    while not stop.is_set():
        i += 1
        now = time.time_ns()
        req = tps.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = SERVICE
        ss = rs.scope_spans.add()
        keys = []
        for j in range(spans_per_req):
            tid, sid = os.urandom(16), os.urandom(8)
            ss.spans.add(trace_id=tid, span_id=sid, name=f"op{j % 7}", kind=2,
                         start_time_unix_nano=now - 50_000_000, end_time_unix_nano=now)
            keys.append((tid, sid))
        b = ProfileBuilder()
        values = {}
        for j, (tid, sid) in enumerate(keys):
            value = 10_000_000 + (n * 1_000_003 + i * 1_009 + j) % 1_000_000
            values[(tid, sid)] = value
            b.sample([f"fn{j % 13}", "handler", "main"], value, tid, sid, service=SERVICE,
                     time_unix_nano=now - 40_000_000)
        idle = 1_000_000 + (n * 7_919 + i) % 100_000  # and one without a span
        b.sample(["idle", "main"], idle, service=SERVICE, time_unix_nano=now - 40_000_000)
        if send(target, TRACE, req.SerializeToString(), tally, stop) is not None:
            with tally.lock:
                tally.spans.update(dict.fromkeys(keys, 0))
        resp = send(target, PROFILES, b.build().SerializeToString(), tally, stop)
        if resp is not None:
            r = pps.ExportProfilesServiceResponse.FromString(resp)
            assert not r.partial_success.rejected_profiles, r
            with tally.lock:
                tally.samples.update(values)
                tally.unlabelled += 1
                tally.unlabelled_cpu += idle
        time.sleep(0.05)


def poison_client(target: str, tally: Tally, stop: threading.Event) -> None:
    """Values no column can hold, mixed into the load: each must be refused at the door
    (or quarantined), and must not slow anyone else down."""
    while not stop.is_set():
        now = time.time_ns()
        tid, sid = os.urandom(16), os.urandom(8)
        b = ProfileBuilder()
        b.sample(["poison"], 2**63 - 1, tid, sid, service=SERVICE + "-poison")
        b.sample(["poison"], 10_000_000, tid, sid, service=SERVICE + "-poison",
                 time_unix_nano=7_000_000_000 * 10**9)  # year 2191
        b.sample(["poison"], 10_000_000, tid, sid, service=SERVICE + "-poison",
                 attributes={"thread.id": "\u00b2"}, resource={"process.pid": -5})
        req = tps.ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = SERVICE + "-poison"
        rs.scope_spans.add().spans.add(trace_id=tid, span_id=sid, name="poison",
                                       start_time_unix_nano=now,
                                       end_time_unix_nano=2**64 - 1)
        for method, body in ((PROFILES, b.build().SerializeToString()),
                             (TRACE, req.SerializeToString())):
            tally.poison_sent += 1
            try:
                resp = send(target, method, body, tally, stop, deadline_s=30)
            except grpc.RpcError:
                tally.poison_refused += 1
                continue
            if resp is None:
                continue
            r = (pps.ExportProfilesServiceResponse if method == PROFILES
                 else tps.ExportTraceServiceResponse).FromString(resp)
            ps = r.partial_success
            if getattr(ps, "rejected_profiles", 0) or getattr(ps, "rejected_spans", 0):
                tally.poison_rejected += 1
        time.sleep(0.5)


def health_watch(admin: str, seen: dict[str, set[int]], stop: threading.Event) -> None:
    """/health's status per phase: it must turn 503 while inserts keep failing (after the
    exporter's unhealthy_after) and back to 200 once they succeed."""
    import urllib.error
    import urllib.request

    while not stop.is_set():
        try:
            with urllib.request.urlopen(admin + "/health", timeout=5) as resp:
                code = resp.status
        except urllib.error.HTTPError as err:
            code = err.code
        except OSError:
            code = 0  # not listening (restarting)
        seen.setdefault(Phase.name, set()).add(code)
        time.sleep(0.5)


def mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return r.returncode == 0


def fill(path: Path) -> Path:
    """Write until the file system is full, to the last byte; the filler file (delete it
    to free the disk)."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 1 << 16, 4096, 512, 1):
            chunk = b"\0" * size
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases (about a minute)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--spans-per-request", type=int, default=50)
    ap.add_argument("--disk-full", type=float, default=30.0)
    ap.add_argument("--down", type=float, default=60.0)
    ap.add_argument("--steady", type=float, default=10.0)
    ap.add_argument("--server-log", type=Path, help="keep the server's log there")
    ap.add_argument("--queue", action="store_true",
                    help="the exporter's sending queue on (logged on the same small disk)")
    args = ap.parse_args()
    if args.quick:
        args.disk_full, args.down, args.steady = 10.0, 15.0, 5.0

    with tempfile.TemporaryDirectory(prefix="spanprof-faults-") as tmp_s:
        tmp = Path(tmp_s)
        disk = tmp / "disk"
        mounted = mount_tmpfs(disk, 768)
        failpoints = tmp / "failpoints"
        failpoints.mkdir()
        os.environ["SPANPROF_FAILPOINTS"] = str(failpoints)
        extra = "unhealthy_after: 5s"
        if args.queue:
            where = disk if mounted else tmp
            extra += f"\n    sending_queue: {{enabled: true, directory: {where / 'queue'}}}"
        p = SpanprofProcess(tmp, exporter_extra=extra)
        if mounted:  # the engine's files on the small file system
            p.data = disk / "data"
            p.config.write_text(p.config.read_text().replace(str(tmp / "data"), str(p.data)))
        p.start()
        tally = Tally()
        stop = threading.Event()
        threads = [threading.Thread(target=good_client, daemon=True,
                                    args=(n, p.grpc_target, tally, stop,
                                          args.spans_per_request))
                   for n in range(args.clients)]
        threads.append(threading.Thread(target=poison_client, daemon=True,
                                        args=(p.grpc_target, tally, stop)))
        threads.append(threading.Thread(target=health_watch, daemon=True,
                                        args=(p.admin, tally.health, stop)))
        for t in threads:
            t.start()
        ran: list[str] = []
        try:
            def phase(name: str, seconds: float) -> None:
                Phase.name = name
                print(f"  {time.strftime('%H:%M:%S', time.gmtime())} {name} ({seconds:.0f}s)",
                      flush=True)
                time.sleep(seconds)

            phase("steady (start)", args.steady)
            if mounted:
                Phase.name = "disk full"
                filler = fill(disk)
                phase("disk full", args.disk_full)
                filler.unlink()
                ran.append(f"disk full {args.disk_full:.0f}s")
            else:
                print("  disk full: NOT RUN (cannot mount a tmpfs here; needs root)")
            phase("steady (after disk full)", args.steady)
            (failpoints / "clickhouse_down").touch()
            phase("clickhouse down", args.down)
            (failpoints / "clickhouse_down").unlink()
            ran.append(f"clickhouse down {args.down:.0f}s")
            phase("steady (after clickhouse down)", args.steady)
            Phase.name = "sigkill"
            print(f"  {time.strftime('%H:%M:%S', time.gmtime())} SIGKILL, restart", flush=True)
            p.stop(signal.SIGKILL)
            p.start()
            ran.append("sigkill + restart")
            phase("steady (after restart)", args.steady)
            Phase.name = "draining"
            stop.set()
            for t in threads:
                t.join(timeout=300)
            rc = p.stop(signal.SIGTERM, timeout=300)
        except BaseException:
            if mounted:
                subprocess.run(["umount", "-l", str(disk)], check=False)
            raise
        finally:
            stop.set()
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
        if args.server_log:
            args.server_log.write_text(p.logs())
        try:
            report(p, tally, rc, ran)
        finally:
            if mounted:
                subprocess.run(["umount", "-l", str(disk)], check=False)


def report(p: SpanprofProcess, tally: Tally, rc: int, ran: list[str]) -> None:
    with clickhouse(p.data) as ch:
        def rows(sql: str) -> list[tuple[object, ...]]:
            return list(ch.query(sql, parameters={"s": SERVICE}).result_rows)

        stored_spans = {(bytes.fromhex(t), bytes.fromhex(s)) for t, s in rows(
            "SELECT TraceId, SpanId FROM spanprof.otel_traces WHERE ServiceName = {s:String}")}
        sample_rows = rows("SELECT trace_id, span_id, value FROM spanprof.profile_samples "
                           "WHERE service = {s:String} AND span_id != ''")
        unlabelled, unlabelled_cpu = rows(
            "SELECT count(), sum(value) FROM spanprof.profile_samples "
            "WHERE service = {s:String} AND span_id = ''")[0]
        unattributed = rows("SELECT sum(cpu_ns) FROM spanprof.unattributed_cpu FINAL "
                            "WHERE service = {s:String}")[0][0]
        # when each sample stored twice was stored (which phase made the duplicate)
        dup_at = rows("SELECT toString(ingested_at), count() FROM spanprof.profile_samples "
                      "WHERE service = {s:String} AND span_id != '' AND (trace_id, span_id) "
                      "IN (SELECT trace_id, span_id FROM spanprof.profile_samples "
                      "WHERE service = {s:String} "
                      "GROUP BY trace_id, span_id HAVING count() > 1) GROUP BY 1 ORDER BY 1")
        attributed = {(bytes.fromhex(t), bytes.fromhex(s)): int(c) for t, s, c in rows(
            "SELECT trace_id, span_id, sum(cpu_ns) FROM spanprof.span_attribution FINAL "
            "WHERE service = {s:String} GROUP BY trace_id, span_id")}
        try:
            quarantined = rows("SELECT count() FROM spanprof.quarantine")[0][0]
        except Exception:
            quarantined = "n/a"
        poison_stored = rows("SELECT count() FROM spanprof.profile_samples "
                             "WHERE service = 'faults-poison'")[0][0]
    samples: dict[tuple[bytes, bytes], int] = {}
    dup_samples = 0
    for t, s, v in sample_rows:
        key = (bytes.fromhex(str(t)), bytes.fromhex(str(s)))
        if key in samples:
            dup_samples += 1
        samples[key] = int(str(v))
    acked_s, acked_p = tally.spans, tally.samples
    lost_spans = len(acked_s.keys() - stored_spans)
    lost_samples = len(acked_p.keys() - samples.keys())
    exact = sum(1 for k, v in acked_p.items() if attributed.get(k) == v)
    over = sum(1 for k, v in acked_p.items() if attributed.get(k, 0) > v)
    under = sum(1 for k, v in acked_p.items() if attributed.get(k, 0) < v)
    print(f"\nfault run: {', '.join(ran)}; exit code after SIGTERM {rc}")
    print(f"  client calls {tally.calls}, refused with a retryable status "
          f"{sum(tally.refused.values())} {tally.refused}, given up {tally.gave_up}")
    print(f"  poison requests {tally.poison_sent}: rejected in partial_success "
          f"{tally.poison_rejected}, refused {tally.poison_refused}; poison samples stored "
          f"{poison_stored}; quarantined rows {quarantined}")
    print(f"  spans   acknowledged {len(acked_s)}  stored {len(acked_s.keys() & stored_spans)}"
          f"  lost {lost_spans}")
    print(f"  samples acknowledged {len(acked_p)}  stored {len(acked_p.keys() & samples.keys())}"
          f"  stored twice {dup_samples}  lost {lost_samples}")
    if dup_samples:
        print(f"  samples stored twice were stored at (UTC): {dup_at}")
    print(f"  attributed exactly {exact} of {len(acked_p)} (more: {over}, less: {under})")
    print(f"  samples without a span: acknowledged {tally.unlabelled} "
          f"({tally.unlabelled_cpu} ns), stored {unlabelled} ({unlabelled_cpu} ns), "
          f"unattributed CPU {unattributed} ns")
    print("  /health by phase: " + "; ".join(
        f"{name} {sorted(codes)}" for name, codes in tally.health.items()))
    print(f"  worst stall of a well-behaved client: {tally.worst_call:.2f}s "
          f"({tally.worst_call_at})")
    ok = (lost_spans == 0 and lost_samples == 0 and dup_samples == 0
          and exact == len(acked_p) and rc == 0 and unlabelled == tally.unlabelled
          and unlabelled_cpu == unattributed == tally.unlabelled_cpu)
    print("  check:", "ok" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

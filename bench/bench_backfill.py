"""Throughput of ``spanprof backfill``: files into an empty store, then re-attribution.

    make bench      # or: python bench/bench_backfill.py --traces 33400 --workers 2

The real command line, as a user runs it, on the embedded engine (chdb) in a fresh
directory, over a Collector-format file set of ``tests/backfill/dataset.py`` (3 spans and
about 5.1 samples a trace, every way a sample reaches a span; 16 700 traces: 50 100 spans,
85 k samples):

1. ``backfill files DIR``: load (decode, insert the raw tables), attribute (the replay,
   into empty attribution tables: no DELETE), aggregates (rebuild of the hours touched);
2. ``backfill reattribute --range`` over the same range, twice (two job ids, else the
   second would find the first's ledger done and run nothing): the rows exist, so each
   unit deletes them and inserts the replay's. Issue #15's goal is for this one: 1 M
   samples/s per worker.

The phases are timed from the job's progress lines on stderr (each phase's header line
to the next one's; planning a phase counts to the phase before it, start-up and the
store's shutdown are apart). "job" is the summary's own ``seconds``, "wall" the process
from exec to exit (interpreter, engine start, schema check included). Rates per worker
are the rate divided by ``--workers`` (units run concurrently in one process; the replay
holds the GIL). Each run's summary is checked: no failed unit, nothing refused, and CPU
in = on spans + unattributed = the generated CPU; a mismatch exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.backfill.dataset import Data, generate, write_files  # noqa: E402

GOAL = 1_000_000  # samples/s per worker, re-attribution (issue #15)
PHASES = ("load", "attribute", "aggregates")


class Run:
    """One ``spanprof backfill`` process: its summary, wall time and phase times."""

    def __init__(self, store: Path, args: list[str], workers: int) -> None:
        env = {**os.environ, "SPANPROF_CLICKHOUSE_ENDPOINT": f"chdb://{store}/ch"}
        cmd = [sys.executable, "-m", "pipeline.cli", "backfill", *args,
               "-c", str(ROOT / "config/local.yaml"), "--format", "json",
               "--workers", str(workers)]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        out: list[str] = []
        stdout = p.stdout
        assert stdout is not None and p.stderr is not None
        reader = threading.Thread(target=lambda: out.append(stdout.read()))
        reader.start()
        marks: list[tuple[str, float]] = []  # (phase, when its header line came)
        err: list[str] = []
        for line in p.stderr:
            now = time.perf_counter() - t0
            err.append(line)
            head = line.split(":", 1)[0]
            if head in PHASES and " units, " in line:
                marks.append((head, now))
        p.wait()
        reader.join()
        self.wall = time.perf_counter() - t0
        if p.returncode != 0 or not out or not out[0].strip():
            print(f"backfill {' '.join(args)}: exit {p.returncode}\n{''.join(err)[-3000:]}")
            sys.exit(1)
        self.summary: dict[str, Any] = json.loads(out[0])
        self.job = float(self.summary["seconds"])
        # a phase lasts from its header to the next header; the last to the job's end
        # (start-up before the first header, shutdown after the job, are apart)
        end = (marks[0][1] if marks else 0.0) + self.job
        self.phase = {name: (marks[i + 1][1] if i + 1 < len(marks) else end) - at
                      for i, (name, at) in enumerate(marks)}


def check(name: str, s: dict[str, Any], cpu: int) -> bool:
    problems = []
    if s["failed"]:
        problems.append(f"{len(s['failed'])} failed units: {s['failed'][:3]}")
    if s["refused"]:
        problems.append(f"refused: {s['refused'][:3]}")
    if s["cpu_in_ns"] != s["cpu_attributed_ns"] + s["cpu_unattributed_ns"]:
        problems.append(f"cpu in {s['cpu_in_ns']} != on spans {s['cpu_attributed_ns']} "
                        f"+ unattributed {s['cpu_unattributed_ns']}")
    if s["cpu_in_ns"] != cpu:
        problems.append(f"cpu in {s['cpu_in_ns']} != generated {cpu}")
    for p in problems:
        print(f"  {name}: MISMATCH {p}")
    return not problems


def iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=int, default=16_700,
                    help="generated traces (3 spans, ~5.1 samples each)")
    ap.add_argument("--workers", type=int, default=1, help="backfill --workers")
    ap.add_argument("--keep", action="store_true",
                    help="keep the files and the store (their directory is printed)")
    args = ap.parse_args()
    w = args.workers

    print(f"generating {args.traces} traces ...")
    data: Data = generate(args.traces)
    n_spans, n_samples = len(data.spans), len(data.samples)
    cpu = sum(s.value for s in data.samples if s.measure == "cpu")
    times = [s.start_ns for s in data.spans] + [s.time_ns for s in data.samples]
    # whole minutes around everything, as the files job's attribute phase covers
    lo, hi = min(times) - 60 * 10**9, max(times) + 120 * 10**9
    rng = f"{iso(lo)}..{iso(hi)}"

    tmp = Path(tempfile.mkdtemp(prefix="spanprof-bench-backfill-"))
    try:
        files = write_files(data, tmp / "files")
        size = sum(f.stat().st_size for f in files)
        store = tmp / "store"
        print(f"{n_spans} spans, {n_samples} samples, {len(files)} files "
              f"({size / 2**20:.1f} MiB); backfill files ...")
        loaded = Run(store, ["files", str(tmp / "files")], w)
        runs = [("files", loaded)]
        for i in (1, 2):
            print(f"backfill reattribute --range {rng} (run {i}) ...")
            runs.append((f"reattribute {i}", Run(
                store, ["reattribute", "--range", rng, "--job", f"bench-reattribute-{i}"], w)))
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)

    s = loaded.summary
    ok = s["spans"] == n_spans and s["samples"] == n_samples
    if not ok:
        print(f"  files: MISMATCH loaded {s['spans']} spans, {s['samples']} samples")
    for name, r in runs:
        ok = check(name, r.summary, cpu) and ok

    print(f"\nspanprof backfill, embedded engine (chdb), {os.cpu_count()} cores, "
          f"--workers {w}; {n_spans} spans, {n_samples} samples; rates per worker")
    print(f"  {'run / phase':<24} {'s':>7} {'spans/s':>10} {'samples/s':>10}  units")
    for name, r in runs:
        sm = r.summary
        print(f"  {name + ' (wall)':<24} {r.wall:7.2f} {n_spans / r.wall / w:>10,.0f} "
              f"{n_samples / r.wall / w:>10,.0f}  {sm['units']}, "
              f"start-up {r.wall - r.job:.1f}s")
        print(f"  {name + ' (job)':<24} {r.job:7.2f} {n_spans / r.job / w:>10,.0f} "
              f"{n_samples / r.job / w:>10,.0f}")
        for phase, t in r.phase.items():
            print(f"    {phase:<22} {t:7.2f} {n_spans / t / w:>10,.0f} "
                  f"{n_samples / t / w:>10,.0f}")
    for name, r in runs[1:]:
        t = r.phase.get("attribute", r.job)
        rate = n_samples / t / w
        print(f"  {name}: attribute phase {rate:,.0f} samples/s per worker = "
              f"{rate / GOAL:.3f} of the goal (1 M); whole job {n_samples / r.job / w:,.0f} "
              f"= {n_samples / r.job / w / GOAL:.3f}")
    print(f"  check (cpu in = on spans + unattributed = generated {cpu / 1e9:.2f}s, "
          "no failed unit):", "ok" if ok else "MISMATCH")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

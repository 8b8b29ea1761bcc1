"""``spanprof why`` on a real program (issue #21): tests/e2e/gremlin_app.py, traced by the
OpenTelemetry SDK and profiled by the Pyroscope SDK (``pyroscope-otel``), against a
running spanprof on the embedded engine; ``why`` asked as a user asks it, the CLI against
the admin API.

* ``burn``: 2% of the calls spend 300 ms more CPU in ``recompute_discounts`` and carry a
  large ``cart.size``: ``why`` names that function first, as explaining most of the tail's
  extra duration, says the tail is burning, and names ``cart.size`` first among the
  attributes.
* ``lock``: 2% of the calls wait 300 ms on a lock a background thread sleeps holding, with
  the CPU of the others: ``why`` says the tail is waiting, claims no function explains it,
  and (the Python SDK sends a CPU profile only: no wall or lock samples) says a CPU
  profile cannot say on what.

In both, the tail ``why`` takes (the slowest 2%) is exactly the program's slow calls.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SpanprofProcess
from tests.e2e.test_real_sdks import settled_spans

# the program's calls are told apart by their duration, the CPU in them by a sampler:
# alone, not beside other tests (as test_real_sdks.py)
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
CALLS = 400  # 8 slow ones (2%)
OPERATION = "place order"


def run_gremlin(sp: SpanprofProcess, mode: str, service: str) -> dict[str, Any]:
    """gremlin_app.py in ``mode`` against ``sp``; its JSON line. At a real-time priority
    where the test may (as test_real_sdks.run_app, for the same reason: a typical call
    should not wait for a core for as long as a slow one runs)."""
    rt = ["chrt", "--fifo", "1"] if os.geteuid() == 0 and shutil.which("chrt") else []
    t0 = time.monotonic()
    proc = subprocess.run(
        [*rt, sys.executable, "-m", "tests.e2e.gremlin_app", mode, sp.http_url,
         sp.pyroscope_url, service, "--calls", str(CALLS)],
        cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"gremlin_app exited {proc.returncode}:\n{proc.stderr}"
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["calls"]) == CALLS and len(out["slow"]) == round(CALLS * 0.02), out["slow"]
    print(f"{mode}: the program ran {CALLS} calls in {time.monotonic() - t0:.1f} s")
    return out


def why(sp: SpanprofProcess, service: str, fmt: str) -> str:
    """``spanprof why`` of the program's operation, the slowest 2%."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "why", "--service", service, "--operation",
         OPERATION, "--slowest", "2%", "--format", fmt, "--admin", sp.admin],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"spanprof why exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def settled(sp: SpanprofProcess, service: str, out: dict[str, Any]) -> dict[str, Any]:
    """The program's spans, by span id, once all are there and attributed (nothing changes
    for a while: the last profile is pushed at the program's exit)."""
    return settled_spans(sp, service, {sid for _, sid in out["calls"]}, timeout=60)


def check_tail(d: dict[str, Any], by_id: dict[str, Any], out: dict[str, Any],
               report: str) -> None:
    """The tail ``why`` compared is the program's slow calls: as many, and the calls at or
    above its threshold are those."""
    slow = {sid for _, sid in out["slow"]}
    assert d["calls"] == CALLS, report
    assert d["tail"]["calls"] == len(slow) and d["typical"]["calls"] == CALLS - len(slow), \
        report
    at_or_above = {sid for sid, s in by_id.items() if s["duration_ns"] >= d["threshold_ns"]}
    assert at_or_above == slow, (sorted(at_or_above), sorted(slow), report)


def summary(d: dict[str, Any]) -> str:
    t, g = d["tail"], d["typical"]
    fns = [(f["name"], round(f["delta_ns"] / 1e6, 1), f["explains"] and round(f["explains"], 2))
           for f in d["functions"][:5]]
    attrs = [(a["key"], round(a["separation"], 2)) for a in d["attributes"][:5]]
    return (f"verdict {d['verdict']}; per call tail/typical: duration "
            f"{t['duration']['per_call_ns'] / 1e6:.1f}/{g['duration']['per_call_ns'] / 1e6:.1f}"
            f" ms, CPU with children {t['inclusive_cpu']['per_call_ns'] / 1e6:.1f}/"
            f"{g['inclusive_cpu']['per_call_ns'] / 1e6:.1f} ms; extra {d['extra_ns'] / 1e6:.1f}"
            f" ms, of it CPU {d['extra_cpu_ns'] / 1e6:.1f} ms; samples "
            f"{t['samples']}/{g['samples']}; functions {fns}; attributes {attrs}; "
            f"notes {d['notes']}")


class TestWhyRealSdk:
    def test_burning_tail_names_its_function_and_attribute(self, tmp_path: Path) -> None:
        """2% of the calls burn 300 ms more in ``recompute_discounts`` with a large cart:
        ``why`` says burning, names ``recompute_discounts`` first (explaining over half of
        the extra duration) and ``cart.size`` first among the attributes."""
        sp = SpanprofProcess(tmp_path)
        sp.start()
        try:
            service = "gremlin-burn"
            out = run_gremlin(sp, "burn", service)
            by_id = settled(sp, service, out)
            d = json.loads(why(sp, service, "json"))
            report = summary(d)
            print(f"burn: {report}")
            check_tail(d, by_id, out, report)
            assert d["verdict"] == "burning", report
            top = d["functions"][0]
            assert top["name"] == "recompute_discounts", report
            assert top["explains"] > 0.5 and not top["few"], report
            assert d["attributes"][0]["key"] == "cart.size", report
            assert d["attributes"][0]["separation"] == 1.0, report  # every tail cart larger
            assert d["wall_functions"] == [], report  # a CPU profile only
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)

    def test_waiting_tail_is_waiting(self, tmp_path: Path) -> None:
        """2% of the calls wait 300 ms for a lock another thread sleeps holding, with the
        CPU of the others: ``why`` says waiting, its extra CPU a small part of the extra
        duration, no function explaining it, and (no wall profile from this SDK) that a CPU
        profile cannot say on what; the text answer says waiting too."""
        sp = SpanprofProcess(tmp_path)
        sp.start()
        try:
            service = "gremlin-lock"
            out = run_gremlin(sp, "lock", service)
            by_id = settled(sp, service, out)
            d = json.loads(why(sp, service, "json"))
            report = summary(d)
            print(f"lock: {report}")
            check_tail(d, by_id, out, report)
            assert d["verdict"] == "waiting", report
            assert d["extra_ns"] > 200e6, report  # the 300 ms wait, less what it overlaps
            assert abs(d["extra_cpu_ns"]) < 0.2 * d["extra_ns"], report
            assert d["extra_off_cpu_ns"] > 0.8 * d["extra_ns"], report
            assert all(f["explains"] is not None and abs(f["explains"]) < 0.2
                       for f in d["functions"]), report
            assert d["wall_functions"] == [], report
            assert any("cannot say on what" in n for n in d["notes"]), report

            text = why(sp, service, "text")
            print(text)
            assert ": waiting (CPU " in text, text
            assert "a CPU profile cannot say on what" in text, text
            assert sp.stop() == 0
        finally:
            if sp.proc is not None and sp.proc.poll() is None:
                sp.stop(signal.SIGKILL)

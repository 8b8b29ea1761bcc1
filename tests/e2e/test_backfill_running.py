"""``spanprof backfill`` while ``spanprof run`` holds the embedded store (issue #15): the
command cannot open the store, submits its job to the running pipeline's admin API,
follows it to the end and prints the same summary; the result is the live correlator's
per-span CPU for the same data, and a second submission of the same job does nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.backfill.dataset import generate, write_files
from tests.backfill.test_job import live, open_store, per_span
from tests.conftest import SpanprofProcess, clickhouse

pytestmark = pytest.mark.e2e
PER_SPAN = ("SELECT trace_id, span_id, method, sum(cpu_ns), sum(inclusive_cpu_ns), "
            "sum(sample_count) FROM {db}.span_attribution_totals WHERE tenant = 'default' "
            "GROUP BY trace_id, span_id, method")


def backfill(p: SpanprofProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "backfill", *args,
                           "-c", str(p.config), "--admin", p.admin, "--format", "json"],
                          cwd=p.tmp, capture_output=True, text=True, timeout=300)


def test_submitted_to_the_running_pipeline(tmp_path: Path) -> None:
    data = generate(400, seed=11)
    files = write_files(data, tmp_path / "files")

    async def live_per_span() -> Any:
        lv = await open_store(tmp_path / "live", "live")
        try:
            await live(lv, data)
            return await per_span(lv)
        finally:
            await lv.shutdown()

    # the live correlator's answer is computed in this process while the pipeline runs;
    # the embedded engine holds one store at a time here, so ``with`` waits for it before
    # ``p.data`` is opened below
    with ThreadPoolExecutor(1) as pool:
        expected = pool.submit(asyncio.run, live_per_span())
        p = SpanprofProcess(tmp_path / "run")
        p.start()
        done = backfill(p, "files", str(tmp_path / "files"), "--workers", "2")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "submitting to" in done.stderr
        summary: dict[str, Any] = json.loads(done.stdout)
        assert summary["spans"] == len(data.spans) and summary["samples"] == len(data.samples)
        assert summary["cpu_in_ns"] == sum(s.value for s in data.samples)
        again = backfill(p, "files", *map(str, files), "--workers", "2")  # the same files
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout)["done"] == 0  # the ledger: nothing left to do
        # a reattribute job goes the same way; a bad range is refused naming the field
        bad = backfill(p, "reattribute", "--range", "1h..2h")
        assert bad.returncode != 0 and "range" in bad.stderr
        assert p.stop() == 0

    with clickhouse(p.data) as ch:
        assert ch.query("SELECT count() FROM spanprof.otel_traces").result_rows[0][0] == \
            len(data.spans)
        rows = ch.query(PER_SPAN.format(db="spanprof")).result_rows
    mine = {(r[0], r[1], r[2]): (int(r[3]), int(r[4]), int(r[5])) for r in rows}
    assert mine == expected.result()

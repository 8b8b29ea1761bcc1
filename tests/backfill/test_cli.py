"""``spanprof backfill files`` as a user runs it (issue #15's acceptance): a Collector-format
file set of 50 k spans into an empty embedded store gives the same per-span CPU as the
live correlator on the same data; a second run leaves every table as it was; a run killed
with SIGKILL in the middle and started again ends with exactly the tables of an
uninterrupted run.

The 50 k spans are backfilled once (and the same job again: nothing to do); the runs that
redo a whole job (another job id) and the killed one use a smaller file set of the same
shape (every kind of sample, across a bucket boundary, several units to load and to
attribute), each compared with that set's own uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.backfill.dataset import Data, generate, write_files
from tests.backfill.test_job import TABLES, live, open_store, per_span, snapshot

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data() -> Data:
    return generate(16_700)  # 50 100 spans, 85 k samples


@pytest.fixture(scope="module")
def fileset(data: Data, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("collector-files")
    write_files(data, root)
    return root


@pytest.fixture(scope="module")
def small() -> Data:
    return generate(600)  # 1 800 spans over 4 s, across a 10-minute bucket boundary


@pytest.fixture(scope="module")
def small_fileset(small: Data, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("collector-files-small")
    write_files(small, root, per_message=200)  # two trace files, neither empty
    return root


def backfill(store: Path, *args: str, wait: bool = True) -> subprocess.Popen[str]:
    env = {**os.environ, "SPANPROF_CLICKHOUSE_ENDPOINT": f"chdb://{store}/ch"}
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "backfill", *args,
                          "-c", str(ROOT / "config/local.yaml"), "--format", "json"],
                         cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    if wait:
        p.wait(timeout=600)
    return p


def summary(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate()
    assert p.returncode == 0, err[-3000:]
    return dict(json.loads(out))


def tables(store: Path, also_live: Data | None = None, snap: bool = True
           ) -> tuple[dict[str, Any], Any, Any]:
    """Every table of the backfilled store (unless not ``snap``); its per-span CPU; and,
    given data, the live correlator's per-span CPU for it (another database of the same
    engine)."""

    async def read() -> tuple[dict[str, Any], Any, Any]:
        bf = await open_store(store, "spanprof")
        try:
            got = await snapshot(bf) if snap else {}
            mine = await per_span(bf)
        finally:
            await bf.shutdown()
        want = None
        if also_live is not None:
            lv = await open_store(store, "live")
            try:
                await live(lv, also_live)
                want = await per_span(lv)
            finally:
                await lv.shutdown()
        return got, mine, want

    return asyncio.run(read())


def test_files_like_live_twice_and_killed(data: Data, fileset: Path, small: Data,
                                          small_fileset: Path, tmp_path: Path) -> None:
    a = tmp_path / "a"
    first = summary(backfill(a, "files", str(fileset), "--workers", "2"))
    assert first["spans"] == len(data.spans) and first["samples"] == len(data.samples)
    assert not first["failed"] and not first["refused"]
    assert first["cpu_in_ns"] == sum(s.value for s in data.samples)
    assert first["cpu_in_ns"] == first["cpu_attributed_ns"] + first["cpu_unattributed_ns"]
    again = summary(backfill(a, "files", str(fileset)))  # the same job: nothing to do
    assert again["already_done"] == again["units"] == first["units"]
    _, mine, want = tables(a, also_live=data, snap=False)
    assert mine == want
    assert {m for _, _, m in mine} >= {"link", "link+time", "thread", "window"}

    # the smaller set: uninterrupted, then all over again under another job id
    ref = tmp_path / "ref"
    whole = summary(backfill(ref, "files", str(small_fileset)))
    assert whole["spans"] == len(small.spans) and whole["samples"] == len(small.samples)
    assert not whole["failed"] and not whole["refused"] and not whole["already_done"]
    once, mine, want = tables(ref, also_live=small)
    assert mine == want
    assert {m for _, _, m in mine} >= {"link", "link+time", "thread", "window"}
    redo = summary(backfill(ref, "files", str(small_fileset), "--job", "second-run"))
    assert redo["done"] == redo["units"] == whole["units"] and not redo["already_done"]
    assert tables(ref)[0] == once

    # killed in the middle of attribution (after its first unit; more follow), then
    # started again
    b = tmp_path / "b"
    p = backfill(b, "files", str(small_fileset), wait=False)
    assert p.stderr is not None
    for line in p.stderr:
        if "done unlabelled/" in line or "done labelled/" in line:
            p.send_signal(signal.SIGKILL)
            break
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    resumed = summary(backfill(b, "files", str(small_fileset)))
    assert 0 < resumed["already_done"] < resumed["units"] == whole["units"]
    killed, _, _ = tables(b)
    for t in TABLES:
        assert killed[t] == once[t], t


def test_dry_run_writes_nothing(fileset: Path, tmp_path: Path) -> None:
    out = summary(backfill(tmp_path / "c", "files", str(fileset), "--dry-run"))
    assert out["dry_run"] and out["load_units"] == 3
    assert out["bytes"] == sum(p.stat().st_size for p in fileset.iterdir())
    snap, mine, _ = tables(tmp_path / "c")
    assert not mine and not snap["otel_traces"] and not snap["profile_samples"]

"""The backfill ledger: what each unit of a job has done, in ClickHouse (migration 12).

A job (``job.py``) is split into units; before a unit runs its row says ``running``,
after, ``done`` or ``failed`` with the unit's figures. Every state change is a new row
(``ReplacingMergeTree(updated)``: the newest wins), written before the work it announces
and read back whole when a job starts, so that a job killed at any point (SIGKILL
included) and started again skips its done units and redoes the others. Redoing a unit is
safe because every unit replaces what it writes (``reattribute``) or inserts under
deduplication tokens (``load``).

The ledger lives in the store the job writes, so a server's ledger is shared by every
process that runs the job, and the embedded engine's stays with its data.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import msgspec

from pipeline.registry import Store

PLANNED, RUNNING, DONE, FAILED = "planned", "running", "done", "failed"
COLUMNS = ["job", "unit", "phase", "tenant", "spec", "state", "cpu_in", "cpu_attributed",
           "cpu_unattributed", "rows_read", "rows_written", "lo_ns", "hi_ns", "message",
           "updated"]


class Entry(msgspec.Struct, kw_only=True):
    """A unit's newest row."""

    unit: str
    phase: int
    tenant: str
    spec: str  # the unit's own description (JSON), enough to run it again
    state: str = PLANNED
    cpu_in: int = 0
    cpu_attributed: int = 0
    cpu_unattributed: int = 0
    rows_read: int = 0
    rows_written: int = 0
    lo_ns: int = 0  # the span starts it touched (aggregates to rebuild), 0 0: none
    hi_ns: int = 0
    message: str = ""


class Ledger:
    def __init__(self, store: Store, job: str) -> None:
        self.store = store
        self.job = job
        self._last = 0.0

    def _now(self) -> datetime:
        # strictly increasing within this process, so the newest row is the last written
        # even when two are written in the same microsecond
        t = max(time.time(), self._last + 1e-6)
        self._last = t
        return datetime.fromtimestamp(t, tz=UTC)

    async def write(self, *entries: Entry) -> None:
        """Record these units' states (one insert; durable when this returns)."""
        if not entries:
            return
        rows = [[self.job, e.unit, e.phase, e.tenant, e.spec, e.state, e.cpu_in,
                 e.cpu_attributed, e.cpu_unattributed, e.rows_read, e.rows_written, e.lo_ns,
                 e.hi_ns, e.message[:2000], self._now()] for e in entries]
        await self.store.insert("backfill_ledger", rows, COLUMNS)

    async def read(self) -> dict[str, Entry]:
        """Every unit of the job, its newest state."""
        _, rows = await self.store.query(
            f"SELECT {', '.join(COLUMNS[1:-1])} FROM {self.store.database}.backfill_ledger "
            "FINAL WHERE job = {job:String} ORDER BY phase, unit", {"job": self.job})
        out = {}
        for r in rows:
            e = Entry(unit=str(r[0]), phase=int(r[1]), tenant=str(r[2]), spec=str(r[3]),
                      state=str(r[4]), cpu_in=int(r[5]), cpu_attributed=int(r[6]),
                      cpu_unattributed=int(r[7]), rows_read=int(r[8]),
                      rows_written=int(r[9]), lo_ns=int(r[10]), hi_ns=int(r[11]),
                      message=str(r[12]))
            out[e.unit] = e
        return out

"""A backfill job: its units, run in three phases, each unit recorded in the ledger.

1. **load** (``files`` and ``kafka`` jobs): each source unit (a file; a partition's offset
   block) is decoded and its spans and samples inserted into the raw tables under
   deduplication tokens named by the source and the place in it, so that loading it again
   adds nothing (``insert_deduplication_token``).
2. **attribute**: the range the loaded data covers (or ``--range``) is split into
   ``reattribute`` units, each replacing the attribution rows it owns with a replay of the
   stored raw rows, with its conservation check.
3. **aggregates**: the aggregate tables are rebuilt for every hour whose spans got new
   rows (``aggregates.rebuild``).

A phase is planned once its predecessor is done, and its units written to the ledger
before any runs; a job started again with the same arguments (the same job id) reads the
ledger and runs what is not done, a finished job runs nothing. ``--workers`` units run at
once (their reads and inserts overlap; the replay is Python, one core per process).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO

import msgspec

from pipeline.backfill import aggregates, reattribute
from pipeline.backfill.ledger import DONE, FAILED, PLANNED, RUNNING, Entry, Ledger
from pipeline.backfill.reattribute import Figures, Labelled, Unbalanced, Unlabelled
from pipeline.records import AttributionBatch, Batch
from pipeline.registry import Store

HOUR_NS = 3600 * 10**9
ANY_TENANT = "*"  # a source unit of every tenant's data (a Kafka range)


class Aggregates(msgspec.Struct, tag="aggregates", kw_only=True):
    tenant: str
    lo_ns: int
    hi_ns: int

    @property
    def id(self) -> str:
        return f"aggregates/{self.tenant}/{self.lo_ns}"


class Loader(msgspec.Struct, kw_only=True):
    """One source unit of phase 1: what ``Source.load`` gets back to run it again."""

    id: str
    tenant: str
    spec: dict[str, Any]
    size: int = 0  # bytes (a file), for --dry-run
    messages: int = 0  # messages (a Kafka range; their bytes are not known unread)


class Loaded(msgspec.Struct):
    figures: Figures
    spans: int = 0
    samples: int = 0
    refused: list[str] = []  # where and why, for the summary


class Source:
    """What a ``files`` or ``kafka`` job reads (``reattribute`` jobs have none)."""

    _units: list[Loader] | None = None

    async def plan(self) -> list[Loader]:
        raise NotImplementedError

    async def units(self) -> list[Loader]:
        """The source's units, planned once (a topic's open end is where it was then)."""
        if self._units is None:
            self._units = await self.plan()
        return self._units

    async def load(self, unit: Loader, send: Callable[[Batch], Awaitable[None]]) -> Loaded:
        raise NotImplementedError


Unit = Labelled | Unlabelled | Aggregates
_decode_unit = msgspec.json.Decoder(Labelled | Unlabelled | Aggregates)


def job_id(kind: str, parts: Sequence[object]) -> str:
    """A job's id: its kind and a hash of what defines it (sources, range, methods)."""
    h = hashlib.blake2b(msgspec.json.encode([kind, *map(str, parts)]), digest_size=8)
    return f"{kind}-{h.hexdigest()}"


class Progress:
    """A bar with rate and ETA on a terminal (tqdm), a line per unit otherwise."""

    def __init__(self, out: TextIO | None, enabled: bool) -> None:
        self.out = out
        self.tty = enabled and out is not None and out.isatty()
        self.enabled = enabled
        self.bar: Any = None
        self.t0 = time.monotonic()
        self.done = self.total = 0
        self.items = 0

    def phase(self, name: str, total: int, done: int) -> None:
        self.close()
        self.t0, self.total, self.done, self.items = time.monotonic(), total, done, 0
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=name, unit="unit", file=self.out)
        elif self.enabled and self.out is not None:
            print(f"{name}: {total} units, {done} already done", file=self.out, flush=True)

    def step(self, unit: str, items: int, state: str) -> None:
        self.done += 1
        self.items += items
        rate = self.items / max(time.monotonic() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} rows/s")
            self.bar.update(1)
        elif self.enabled and self.out is not None:
            left = self.total - self.done
            eta = left * (time.monotonic() - self.t0) / max(self.done, 1)
            print(f"  {state} {unit} ({self.done}/{self.total}, {rate:,.0f} rows/s, "
                  f"eta {eta:,.0f}s)", file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Job:
    def __init__(self, store: Store, send: Callable[[Batch], Awaitable[None]], job: str,
                 *, methods: tuple[str, ...] = reattribute.METHODS, workers: int = 1,
                 progress: Progress | None = None, tenant: str | None = None) -> None:
        self.store = store
        self.send = send
        self.ledger = Ledger(store, job)
        self.job = job
        self.methods = methods
        self.workers = max(1, workers)
        self.progress = progress or Progress(sys.stderr, False)
        self.tenant = tenant
        self.summary: dict[str, Any] = {
            "job": job, "units": 0, "done": 0, "failed": [], "already_done": 0, "spans": 0,
            "samples": 0, "cpu_in_ns": 0, "cpu_attributed_ns": 0, "cpu_unattributed_ns": 0,
            "rows_written": 0, "refused": []}

    async def run(self, source: Source | None, span: tuple[int, int] | None = None
                  ) -> dict[str, Any]:
        """Every phase to the end (a failed unit does not stop the others; the phases after
        a failed one still run on what is done). ``span``: reattribute's range (ns)."""
        t0 = time.monotonic()
        entries = await self.ledger.read()
        if source is not None:
            if not any(e.phase == 1 for e in entries.values()):
                await self.ledger.write(*[
                    Entry(unit=u.id, phase=1, tenant=u.tenant, spec=msgspec.json.encode(
                        u).decode()) for u in await source.units()])
                entries = await self.ledger.read()
            await self._phase(entries, 1, lambda e: self._load(source, e))
        if not any(e.phase == 2 for e in entries.values()):
            units = []
            for tenant, lo, hi in self._ranges(entries, 1, span):
                units += await reattribute.plan(self.store, lo, hi, tenant)
            await self.ledger.write(*[self._entry(u, 2) for u in units])
            entries = await self.ledger.read()
        await self._phase(entries, 2, self._attribute)
        if not any(e.phase == 3 for e in entries.values()):
            aggs = [Aggregates(tenant=t, lo_ns=h, hi_ns=h + HOUR_NS)
                    for t, lo, hi in self._ranges(entries, 2, None)
                    for h in range(lo - lo % HOUR_NS, hi, HOUR_NS)]
            await self.ledger.write(*[self._entry(u, 3) for u in aggs])
            entries = await self.ledger.read()
        await self._phase(entries, 3, self._aggregates)
        self.progress.close()
        s = self.summary
        s["seconds"] = round(time.monotonic() - t0, 3)
        for k in ("spans", "samples"):
            s[f"{k}_per_s"] = round(s[k] / max(s["seconds"], 1e-9), 1)
        return s

    def _entry(self, u: Unit, phase: int) -> Entry:
        return Entry(unit=u.id, phase=phase, tenant=u.tenant,
                     spec=msgspec.json.encode(u).decode())

    def _ranges(self, entries: dict[str, Entry], phase: int, span: tuple[int, int] | None
                ) -> list[tuple[Any, int, int]]:
        """What the next phase covers: ``span`` for every tenant (or the job's), or per
        tenant the span starts and sample times the done units of ``phase`` touched."""
        if span is not None and phase == 1:
            return [(self.tenant, span[0], span[1])]
        got: dict[str, tuple[int, int]] = {}
        for e in entries.values():
            if e.phase == phase and e.state == DONE and e.hi_ns > e.lo_ns:
                lo, hi = got.get(e.tenant, (e.lo_ns, e.hi_ns))
                got[e.tenant] = (min(lo, e.lo_ns), max(hi, e.hi_ns))
        # a Kafka unit holds every tenant's messages ("*"): its range is every tenant's
        return [(None if t == ANY_TENANT else t, lo, hi) for t, (lo, hi) in sorted(got.items())]

    async def _phase(self, entries: dict[str, Entry], phase: int,
                     work: Callable[[Entry], Awaitable[Entry]]) -> None:
        mine = [e for e in entries.values() if e.phase == phase]
        todo = [e for e in mine if e.state != DONE]
        self.summary["units"] += len(mine)
        self.summary["already_done"] += len(mine) - len(todo)
        self.progress.phase(("load", "attribute", "aggregates")[phase - 1], len(mine),
                            len(mine) - len(todo))
        queue: asyncio.Queue[Entry] = asyncio.Queue()
        for e in todo:
            queue.put_nowait(e)

        async def worker() -> None:
            while not queue.empty():
                e = queue.get_nowait()
                await self.ledger.write(msgspec.structs.replace(e, state=RUNNING))
                try:
                    done = await work(e)
                except Unbalanced as err:
                    done = msgspec.structs.replace(e, state=FAILED, message=str(err))
                entries[e.unit] = done
                await self.ledger.write(done)
                self._count(done)
                self.progress.step(e.unit, done.rows_read, done.state)

        await asyncio.gather(*(worker() for _ in range(min(self.workers, len(todo)))))

    def _count(self, e: Entry) -> None:
        s = self.summary
        if e.state == FAILED:
            s["failed"].append({"unit": e.unit, "message": e.message})
            return
        s["done"] += 1
        if e.phase == 2:
            s["cpu_in_ns"] += e.cpu_in
            s["cpu_attributed_ns"] += e.cpu_attributed
            s["cpu_unattributed_ns"] += e.cpu_unattributed
        s["rows_written"] += e.rows_written

    async def _load(self, source: Source, e: Entry) -> Entry:
        unit = msgspec.json.decode(e.spec, type=Loader)
        got = await source.load(unit, self.send)
        self.summary["spans"] += got.spans
        self.summary["samples"] += got.samples
        self.summary["refused"] += got.refused
        f = got.figures
        return msgspec.structs.replace(
            e, state=DONE, cpu_in=f.cpu_in, rows_read=f.rows_read, rows_written=f.rows_written,
            lo_ns=f.lo_ns, hi_ns=f.hi_ns, message="; ".join(got.refused)[:2000])

    async def _attribute(self, e: Entry) -> Entry:
        unit = _decode_unit.decode(e.spec)
        assert not isinstance(unit, Aggregates)

        async def send(batch: AttributionBatch) -> None:
            await self.send(batch)

        f = await reattribute.run(self.store, unit, self.methods, send)
        return msgspec.structs.replace(
            e, state=DONE, cpu_in=f.cpu_in, cpu_attributed=f.cpu_attributed,
            cpu_unattributed=f.cpu_unattributed, rows_read=f.rows_read,
            rows_written=f.rows_written, lo_ns=f.lo_ns, hi_ns=f.hi_ns)

    async def _aggregates(self, e: Entry) -> Entry:
        unit = _decode_unit.decode(e.spec)
        assert isinstance(unit, Aggregates)
        await aggregates.rebuild(self.store, unit.tenant, unit.lo_ns // 10**9,
                                 unit.hi_ns // 10**9)
        return msgspec.structs.replace(e, state=DONE)


async def plan_only(store: Store, source: Source | None, span: tuple[int, int] | None,
                    tenant: str | None) -> dict[str, Any]:
    """``--dry-run``: the units and what they would read, nothing written."""
    out: dict[str, Any] = {"dry_run": True}
    if source is not None:
        units = await source.units()
        out.update(load_units=len(units), bytes=sum(u.size for u in units))
        if any(u.messages for u in units):
            out["messages"] = sum(u.messages for u in units)
        return out
    assert span is not None
    units_ = await reattribute.plan(store, span[0], span[1], tenant)
    lo, hi = span
    where = ("WHERE COL >= fromUnixTimestamp64Nano({lo:Int64}) AND "
             "COL < fromUnixTimestamp64Nano({hi:Int64})")
    p = {"lo": lo, "hi": hi}
    _, spans = await store.query(
        f"SELECT count(), sum(bytes) FROM (SELECT byteSize(*) AS bytes FROM "
        f"{store.database}.otel_traces {where.replace('COL', 'Timestamp')})", p)
    _, samples = await store.query(
        f"SELECT count(), sum(bytes) FROM (SELECT byteSize(*) AS bytes FROM "
        f"{store.database}.profile_samples {where.replace('COL', 'time')})", p)
    out.update(attribute_units=len(units_), spans=int(spans[0][0]),
               samples=int(samples[0][0]),
               bytes=int(spans[0][1] or 0) + int(samples[0][1] or 0))
    return out


__all__ = ["PLANNED", "Job", "Loaded", "Loader", "Progress", "Source", "job_id", "plan_only"]

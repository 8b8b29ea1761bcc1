"""The sending queue: batches acknowledged once they are in a local log, inserted behind.

Without it a client's request is acknowledged when its rows are in ClickHouse, so every
acknowledgement waits for an insert (tens of milliseconds even for a few rows: each insert
writes a part into every table and view) and inserts are as small as the traffic is thin.
With it (``sending_queue: {enabled: true}``) ``put`` appends the batch's rows to a log on
local disk and returns once an ``fsync`` covers them (one ``fsync`` for every batch that
came meanwhile: group commit); a drainer inserts what the log holds in large groups, in
order, through the writer (its retries, circuit breaker and quarantine).

Exactly once across crashes. Before it inserts a group, the drainer logs a *group* record
(its records' sequence numbers and a fresh random token) and fsyncs it; after the insert, a
*done* record. After a crash, the log is read back: the records of groups not done are
inserted again as the very same groups under the same tokens (ClickHouse drops a block it
already has under that token, ``insert_deduplication_token``), the records of no group
form new groups. ``open`` does all that before returning: the exporter starts before the
correlator, whose crash recovery reads what is stored (processors/correlate/recovery.py).

The log is a series of numbered segment files (``pipeline/disklog``: their framing, and
the writer that appends and fsyncs; ``queue_log.py`` has this queue's records,
``queue_replay.py`` reads them back at start). A
record that does not check out ends its segment (a torn write: it was never
acknowledged). Segments are deleted oldest first once every record and group in them is
done. ``max_mib`` bounds what is waiting: beyond it ``put`` refuses with a retryable
error (explicit backpressure), as it does when the disk refuses a write. Only
``memory_mib`` of what waits is also kept in memory, as the columns it came as; the rest
(a backlog while ClickHouse is slow or down, everything read back at start) is on disk
only and read again when its group is inserted.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.disklog.segments import PREFIX, Segment, delete_done, record
from pipeline.disklog.writer import LogWriter
from pipeline.errors import Retryable
from pipeline.exporters.clickhouse.queue_log import DATA, DONE, GROUP, Group, QueueError, Record
from pipeline.exporters.clickhouse.queue_replay import read_back, with_tables
from pipeline.exporters.clickhouse.rows import Columns, StackKey, extend

MAX_RECORD_BYTES = 1 << 30
MAX_GROUP_ROWS = 200_000  # rows per insert group (beyond, the next group takes the rest)
READ_TRIES = 8  # a group's read back failing this often (backing off to 30 s): given up
# waiting batches kept in memory as columns (their logged size): beyond, on disk only. A
# batch's columns take 1.5-5x its logged size in memory (traces 5x: a row's ints and
# strings are Python objects), so a full queue of max_mib held in memory took gigabytes
MEMORY_BYTES = 32 << 20


class SendingQueue:
    def __init__(self, directory: str, max_bytes: int, batch_rows: int,
                 flush_interval: float,
                 submit: Callable[[dict[str, Columns], int, set[StackKey], str], Any],
                 log: Any, metric: Callable[[str, int], None],
                 memory_bytes: int = MEMORY_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.memory_bytes = memory_bytes
        self.batch_rows = batch_rows
        self.flush_interval = flush_interval
        self._submit = submit
        self.log = log
        self.metric = metric
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-fsync")
        # reads what is on disk only (not the fsync thread: an acknowledgement would wait)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-read")
        self._records: dict[int, Record] = {}  # waiting, by sequence number (in order)
        self._groups: list[Group] = []  # logged, not done (from before a crash)
        self._relog: set[int] = set()  # groups whose record an fsync failed to cover
        self._group_of: dict[int, int] = {}  # seq -> gid, for logged groups
        self._segments: list[Segment] = []
        self._log = LogWriter(directory, self._segments, self._io)
        self._next_seq = 1
        self._next_gid = 1
        self._wake = asyncio.Event()
        self._emptied = asyncio.Event()
        self._progress = asyncio.Event()  # a group done (``wait_through``)
        self.replayed_upto = 0  # the last sequence number read back at start
        self._close_ev = asyncio.Event()  # wakes a drainer waiting to retry
        self._closing = False
        self._give_up_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.waiting_bytes = 0
        self.waiting_rows = 0
        self.resident_bytes = 0  # logged size of the records whose tables are in memory

    def __repr__(self) -> str:
        return (f"<SendingQueue {self.directory} records={len(self._records)} "
                f"bytes={self.waiting_bytes}>")

    # ---- start: read the log back --------------------------------------------------------

    async def open(self, replay_timeout: float) -> None:
        """Read the log; insert what it holds that is not done (the groups logged before a
        crash as they were), waiting up to ``replay_timeout`` for it; then take new
        batches."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            await asyncio.get_running_loop().run_in_executor(self._io, self._read_all)
            self._log.new_segment()
        except OSError as err:
            raise QueueError(f"cannot use {self.directory}: {err}") from err
        replayed = len(self._records)
        self._task = asyncio.create_task(self._drain(), name=f"queue-{self.directory}")
        if replayed:
            self.log.info("queue_replay", records=replayed, groups=len(self._groups),
                          bytes=self.waiting_bytes, directory=self.directory)
            try:
                await asyncio.wait_for(self.wait_empty(), timeout=replay_timeout)
                self.log.info("queue_replayed", records=replayed)
            except TimeoutError:
                # ClickHouse refuses for now: the drainer goes on; what the correlator's
                # crash recovery reads may lack these rows
                self.log.warning("queue_replay_incomplete", records=len(self._records),
                                 waited_s=replay_timeout)

    def _read_all(self) -> None:
        r = read_back(self.directory, self.log)
        self._segments[:] = r.segments  # the list the writer appends to
        self._records, self._groups = r.records, r.groups
        self._next_seq, self._next_gid = r.next_seq, r.next_gid
        self.replayed_upto = max(r.records, default=0)
        self._group_of = {s: g.gid for g in r.groups for s in g.seqs}
        self.waiting_bytes = sum(rec.size for rec in r.records.values())
        self.waiting_rows = sum(rec.rows for rec in r.records.values())
        self._wake.set()
        # segments that hold nothing waiting go at once
        delete_done(self._segments, False, self.log)

    def _forget(self, seq: int) -> None:
        r = self._records.pop(seq, None)
        if r is not None:
            self.waiting_bytes -= r.size
            self.waiting_rows -= r.rows
            if r.tables is not None:
                self.resident_bytes -= r.size
            self._segment(r.segment).pending -= 1
        self._group_of.pop(seq, None)

    def _segment(self, number: int) -> Segment:
        for s in self._segments:
            if s.number == number:
                return s
        raise KeyError(number)

    # ---- appending -----------------------------------------------------------------------

    async def put(self, tables: dict[str, Columns], rows: int, stacks: set[StackKey],
                  token: str | None) -> None:
        """Log a batch; return once it is on disk (then it will be inserted, even after a
        crash). ``Retryable`` when the queue is full or the disk refuses."""
        if self._closing:
            raise Retryable("clickhouse sending queue: shutting down")
        framed = record(DATA, [self._next_seq, token, rows, sorted(stacks), tables])
        if len(framed) - PREFIX > MAX_RECORD_BYTES:
            raise Retryable("clickhouse sending queue: batch too large to log", retry_after=1.0)
        if self._records and self.waiting_bytes + len(framed) - PREFIX > self.max_bytes:
            self.metric("queue_refused_rows", rows)
            raise Retryable(f"clickhouse sending queue is full ({self.waiting_bytes >> 20} MiB "
                            f"waiting, sending_queue.max_mib={self.max_bytes >> 20})",
                            retry_after=2.0)
        seq = self._next_seq
        try:
            size = self._log.append(framed, seq)
        except OSError as err:
            self.metric("queue_refused_rows", rows)
            raise Retryable(f"clickhouse sending queue: cannot write {self.directory}: "
                            f"{err}", retry_after=5.0) from err
        del framed
        self._next_seq += 1
        # beyond memory_mib the batch is on disk only, read again when its turn comes
        keep = self.resident_bytes + size <= self.memory_bytes
        rec = Record(seq, tables if keep else None, rows, stacks, token, size,
                     self._segments[-1].number, self._log.offset - size)
        if keep:
            self.resident_bytes += size
        else:
            self.metric("queue_spilled_rows", rows)
        self._records[seq] = rec
        self._segments[-1].pending += 1
        self.waiting_bytes += size
        self.waiting_rows += rows
        try:
            await self._log.sync()
        except OSError as err:
            # not acknowledged: forgotten, on disk too (the writer logged a FORGET record)
            self._forget(seq)
            raise Retryable(f"clickhouse sending queue: cannot fsync {self.directory}: "
                            f"{err}", retry_after=5.0) from err
        self.metric("queued_rows", rows)
        self._wake.set()

    # ---- draining ------------------------------------------------------------------------

    def _due(self) -> bool:
        if self._groups:
            return True
        if not self._records:
            return False
        first = next(iter(self._records.values()))
        return (self._closing or first.token is not None or self.waiting_rows >= self.batch_rows
                or time.monotonic() - first.at >= self.flush_interval)

    def _next_group(self) -> Group:
        if self._groups:
            return self._groups[0]
        seqs: list[int] = []
        rows = 0
        for seq, r in self._records.items():
            if r.token is not None:
                if not seqs:
                    seqs = [seq]
                break
            if seqs and rows + r.rows > MAX_GROUP_ROWS:
                break
            seqs.append(seq)
            rows += r.rows
        first = self._records[seqs[0]]
        token = first.token or f"q{os.urandom(8).hex()}-{self._next_gid}"
        self._log.append(record(GROUP, [self._next_gid, seqs, token]))
        g = Group(self._next_gid, seqs, token, self._segments[-1].number)
        self._next_gid += 1
        self._segments[-1].pending += 1
        self._groups.append(g)
        for s in seqs:
            self._group_of[s] = g.gid
        return g

    async def _drain(self) -> None:
        read_delay, read_failures = 0.125, 0
        while True:
            if not self._due():
                if self._closing and not self._records:
                    return
                self._wake.clear()
                timeout = self.flush_interval
                if self._records:
                    first = next(iter(self._records.values()))
                    timeout = max(0.0, self.flush_interval - (time.monotonic() - first.at))
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                except TimeoutError:
                    pass
                continue
            g: Group | None = None
            try:
                g = self._next_group()
                if g.gid in self._relog:
                    self._log.append(record(GROUP, [g.gid, g.seqs, g.token]))
                    self._relog.discard(g.gid)
                await self._log.sync()  # the group's record is on disk before its insert
            except OSError as err:
                if g is not None:  # its record may be lost with the failed fsync's pages
                    self._relog.add(g.gid)
                self.log.error("queue_write_failed", error=str(err), directory=self.directory)
                await asyncio.sleep(5.0)
                continue
            # a batch whose fsync failed was forgotten (its sender told to retry) even if
            # this group named it meanwhile
            g.seqs = [s for s in g.seqs if s in self._records]
            recs = [self._records[s] for s in g.seqs]
            if any(r.tables is None for r in recs):
                try:
                    # after READ_TRIES failures in a row the disk is not failing for now:
                    # what still cannot be read is lost, not a wedge of every batch behind
                    recs = await self._read_back(g, recs, final=read_failures >= READ_TRIES)
                except Exception as err:
                    # the disk failing for now (EMFILE, EIO...), or anything else: logged
                    # and tried again, never the drainer's end
                    self.log.error("queue_read_failed", error=str(err)[:300], group=g.gid,
                                   directory=self.directory)
                    read_failures += 1
                    read_delay = min(30.0, read_delay * 2)
                    if self._closing and self._give_up_at is not None and \
                            time.monotonic() + read_delay >= self._give_up_at:
                        return  # left in the log: inserted at the next start
                    try:  # close() cuts the wait short
                        await asyncio.wait_for(self._close_ev.wait(), timeout=read_delay)
                    except TimeoutError:
                        pass
                    continue
                read_delay, read_failures = 0.125, 0
            tables: dict[str, Columns] = {}
            for r in recs:
                assert r.tables is not None  # noqa: S101 - read back just above
                extend(tables, r.tables)
            rows = sum(r.rows for r in recs)
            stacks = set().union(*(r.stacks for r in recs))
            delay = 0.25
            while recs:  # none: every record of the group was lost (``_read_back``)
                try:
                    await self._submit(tables, rows, stacks, g.token)
                    break
                except Exception as err:
                    # ClickHouse failing: the writer's circuit breaker says when to come
                    # back. Anything else is a bug: logged, retried, never dropped
                    after = err.retry_after if isinstance(err, Retryable) else None
                    if not isinstance(err, Retryable):
                        self.log.error("queue_insert_failed", error=str(err)[:500],
                                       group=g.gid, rows=rows)
                    # the writer's circuit breaker says when its next attempt is due
                    delay = after if after else min(30.0, delay * 2)
                    if self._closing and self._give_up_at is not None and \
                            time.monotonic() + delay >= self._give_up_at:
                        return  # left in the log: inserted at the next start
                    if self._closing:
                        await asyncio.sleep(delay)
                        continue
                    try:  # close() cuts the wait short: one more attempt at once
                        await asyncio.wait_for(self._close_ev.wait(), timeout=delay)
                    except TimeoutError:
                        pass
            self._groups.pop(0)
            try:
                self._log.append(record(DONE, g.gid))
            except OSError as err:  # a lost DONE only costs a deduplicated insert later
                self.log.warning("queue_write_failed", error=str(err), directory=self.directory)
            self._segment(g.segment).pending -= 1
            for s in g.seqs:
                self._forget(s)
            self.metric("queue_inserted_rows", rows)
            delete_done(self._segments, True, self.log)
            self._progress.set()
            if not self._records:
                self._emptied.set()

    async def _read_back(self, g: Group, recs: list[Record], final: bool) -> list[Record]:
        """The group's records with their tables, those on disk only read again (off the
        event loop; held by the group alone, not the records, so that they go with it). A
        record that cannot be read any more (its file gone or changed since it was
        written) is logged as lost and left out, never retried forever; the disk failing
        to read (``OSError``) is raised, for the group to be tried again, unless ``final``
        (``READ_TRIES`` failures in a row): then what still fails is lost too."""
        paths = {s.number: s.path for s in self._segments}
        got = await asyncio.get_running_loop().run_in_executor(
            self._reader, with_tables, recs, paths, final)
        kept: list[Record] = []
        for r, x in zip(recs, got, strict=True):
            if isinstance(x, Record):
                kept.append(x)
                continue
            self.log.error("queue_record_lost", error=str(x), seq=r.seq, rows=r.rows,
                           group=g.gid, directory=self.directory)
            self.metric("queue_lost_rows", r.rows)
            g.seqs.remove(r.seq)
            self._forget(r.seq)
        return kept

    async def wait_empty(self) -> None:
        while self._records:
            self._emptied.clear()
            self._wake.set()
            await self._emptied.wait()

    async def wait_through(self, seq: int) -> None:
        """Return once every batch up to sequence number ``seq`` is inserted (whatever
        came after it)."""
        while self._records and next(iter(self._records)) <= seq:
            self._progress.clear()
            await self._progress.wait()

    async def close(self, within: float) -> None:
        """Insert what waits (for at most ``within`` seconds: what is left stays in the log
        for the next start), then stop."""
        self._closing = True
        self._give_up_at = time.monotonic() + within
        self._wake.set()
        self._close_ev.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=within + 1)
            except TimeoutError:
                self._task.cancel()
            if self._records:
                self.log.warning("queue_left_for_next_start", records=len(self._records),
                                 bytes=self.waiting_bytes, directory=self.directory)
        self._log.close()
        self._io.shutdown(wait=True)
        # a read of a group cut short by the cancel above ends on its own
        self._reader.shutdown(wait=False, cancel_futures=True)


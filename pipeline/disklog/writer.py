"""The writing end of a log (``segments.py``; the sending queue's, the intake's): appends
to numbered segment files, and ``fsync`` shared by every append that comes while one is
running (group commit).

An acknowledgement waits for its ``fsync`` (p50 1.5 ms on this machine's disk) and for the
event loop to come back to it. Handing the result from the ``fsync`` thread straight to
the waiters (``call_soon_threadsafe``) instead of through a task was tried (2026-12-07):
no better at half load, p99 worse in three alternated runs (the thread then wants the GIL
back while the loop is in the middle of a request).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from pipeline.disklog.segments import FORGET, Segment, record, segment_path

SEGMENT_BYTES = 64 << 20


class LogWriter:
    """Appends records to the last of ``segments`` (the list the queue keeps, shared),
    starting a new segment beyond ``SEGMENT_BYTES``.

    An ``fsync`` of the current file that fails fails every batch appended to it since the
    last one that succeeded (their senders are told to retry): the writer starts a new
    segment, so that whatever the failed writeback left in the old one (zeros where a
    record was, read back as a torn tail that would cut off what follows) is followed by
    nothing, and a ``FORGET`` record naming those batches goes before any later record, so
    that the ``fsync`` of a later acknowledgement covers it too. Linux reports a writeback
    error to one ``fsync`` of the file: the appends it concerns are kept as failed ranges,
    and a waiter in one raises whatever ``fsync`` ends later."""

    def __init__(self, directory: str, segments: list[Segment], io: ThreadPoolExecutor,
                 segment_bytes: int | None = None) -> None:
        self.directory = directory
        self.segments = segments
        self.segment_bytes = segment_bytes or SEGMENT_BYTES
        self._io = io  # the thread that runs fsync
        self._fd = -1  # -1 also after a new segment could not be created: the next append
        self.offset = 0  # the current segment's size
        self._written = 0  # appends so far, and how many of them an fsync covers
        self._synced = 0
        self._task: asyncio.Task[None] | None = None  # the fsync running
        # batches appended and not covered by an fsync yet: (append number, sequence)
        self._unsynced: list[tuple[int, int]] = []
        self._failed: list[tuple[int, int]] = []  # (lo, hi]: appends an fsync failed for
        self._forget: list[int] = []  # failed batches no FORGET record names yet
        # segments' files moved on from while an fsync of theirs may run: closed after it
        self._retired: list[int] = []

    def new_segment(self) -> None:
        """Close the current segment (synced) and begin the next; ``OSError`` if its
        fsync fails (then every batch not synced yet is failed) or the new file cannot be
        made (then the next append tries again)."""
        failed: OSError | None = None
        if self._fd >= 0:
            try:
                os.fsync(self._fd)  # what it holds stays covered when appends move on
            except OSError as err:
                failed = err
                self._mark_failed(self._written)
            if self._task is not None:
                self._retired.append(self._fd)  # never close a file an fsync is given
            else:
                os.close(self._fd)
            self._fd = -1
        number = self.segments[-1].number + 1 if self.segments else 1
        path = segment_path(self.directory, number)
        # O_APPEND: after a refused write is cut off (ftruncate), the next one goes at the
        # end of what is good, never past a hole
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self.offset = 0
        self.segments.append(Segment(number, path))
        self._write_forget()
        if failed is not None:
            raise failed

    def append(self, rec: bytearray, seq: int | None = None) -> int:
        """Write a record (``queue_log.record``), of batch ``seq`` if it is a batch's; its
        size. ``OSError`` when the disk refuses it: then nothing of it stays."""
        if self._fd < 0 or (self.offset + len(rec) > self.segment_bytes and self.offset > 0):
            self.new_segment()
        self._write_forget()
        self._write(rec)
        if seq is not None:
            self._unsynced.append((self._written, seq))
        return len(rec)

    def _write(self, rec: bytearray) -> None:
        try:
            n = os.write(self._fd, rec)
            if n != len(rec):
                raise OSError(f"short write ({n} of {len(rec)} bytes)")
        except OSError:
            os.ftruncate(self._fd, self.offset)  # no torn record after acknowledged ones
            raise
        self.offset += len(rec)
        self._written += 1

    def _mark_failed(self, upto: int) -> None:
        """Appends after the last good fsync up to ``upto`` are failed: their waiters
        raise, their batches are named in the next FORGET record."""
        if upto > self._synced:
            self._failed = [*self._failed[-15:], (self._synced, upto)]
        self._forget += [seq for n, seq in self._unsynced if n <= upto]
        self._unsynced = [(n, seq) for n, seq in self._unsynced if n > upto]

    def _write_forget(self) -> None:
        if self._forget and self._fd >= 0:
            # refused here too: kept for the next append (a restart before it may insert
            # them after all, beside their senders' resends; nothing is acknowledged first)
            self._write(record(FORGET, self._forget))
            self._forget = []

    def _is_failed(self, target: int) -> bool:
        return any(lo < target <= hi for lo, hi in self._failed)

    async def sync(self) -> None:
        """Return once an ``fsync`` covers every append made so far; ``OSError`` if one
        that should have failed (a later one proves nothing of those appends: the kernel
        may have dropped their pages)."""
        target = self._written
        while True:
            if self._is_failed(target):
                raise OSError(f"an fsync of {self.directory} failed")
            if self._synced >= target:
                return
            if self._task is None:
                self._task = asyncio.create_task(self._fsync())
            try:
                await asyncio.shield(self._task)
            except OSError:
                if self._is_failed(target):
                    raise
                # the fsync of an earlier file failed, not this append's: another one

    async def _fsync(self) -> None:
        upto, fd = self._written, self._fd
        try:
            await asyncio.get_running_loop().run_in_executor(self._io, os.fsync, fd)
            self._synced = max(self._synced, upto)
            self._unsynced = [(n, s) for n, s in self._unsynced if n > upto]
        except OSError:
            if fd == self._fd:
                # the hole is in the file written to: all it got since the last good
                # fsync is failed, and what follows goes to a new one
                self._mark_failed(self._written)
                try:
                    self.new_segment()
                except OSError:
                    pass  # marked failed what it had to; the next append tries again
            else:
                self._mark_failed(upto)  # a file moved on from: its appends only
            try:
                self._write_forget()
            except OSError:
                pass  # written before the next record, or not at all (see _write_forget)
            raise
        finally:
            self._task = None
            for old in self._retired:
                os.close(old)
            self._retired.clear()

    def close(self) -> None:
        """``fsync`` and close the current segment (no ``sync`` may be waiting)."""
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

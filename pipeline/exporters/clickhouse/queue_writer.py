"""The sending queue's writing end (``queue.py``): appends to numbered segment files, and
``fsync`` shared by every append that comes while one is running (group commit).

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

from pipeline.exporters.clickhouse.queue_log import Segment, segment_path

SEGMENT_BYTES = 64 << 20


class LogWriter:
    """Appends records to the last of ``segments`` (the list the queue keeps, shared),
    starting a new segment beyond ``SEGMENT_BYTES``."""

    def __init__(self, directory: str, segments: list[Segment], io: ThreadPoolExecutor,
                 segment_bytes: int | None = None) -> None:
        self.directory = directory
        self.segments = segments
        self.segment_bytes = segment_bytes or SEGMENT_BYTES
        self._io = io  # the thread that runs fsync
        self._fd = -1
        self.offset = 0  # the current segment's size
        self._written = 0  # appends so far, and how many of them an fsync covers
        self._synced = 0
        self._task: asyncio.Task[None] | None = None  # the fsync running
        # segments' files moved on from while an fsync of theirs may run: closed after it
        self._retired: list[int] = []

    def new_segment(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)  # what it holds stays covered when appends move on
            if self._task is not None:
                self._retired.append(self._fd)  # never close a file an fsync is given
            else:
                os.close(self._fd)
        number = self.segments[-1].number + 1 if self.segments else 1
        path = segment_path(self.directory, number)
        # O_APPEND: after a refused write is cut off (ftruncate), the next one goes at the
        # end of what is good, never past a hole
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self.offset = 0
        self.segments.append(Segment(number, path))

    def append(self, rec: bytearray) -> int:
        """Write a record (``queue_log.record``); its size. ``OSError`` when the disk
        refuses it: then nothing of it stays."""
        if self.offset + len(rec) > self.segment_bytes and self.offset > 0:
            self.new_segment()
        try:
            n = os.write(self._fd, rec)
            if n != len(rec):
                raise OSError(f"short write ({n} of {len(rec)} bytes)")
        except OSError:
            os.ftruncate(self._fd, self.offset)  # no torn record after acknowledged ones
            raise
        self.offset += len(rec)
        self._written += 1
        return len(rec)

    async def sync(self) -> None:
        """Return once an ``fsync`` covers every append made so far; ``OSError`` if the
        one that should failed (a later one proves nothing of those appends: the kernel
        may have dropped their pages)."""
        target = self._written
        while self._synced < target:
            if self._task is None:
                self._task = asyncio.create_task(self._fsync())
            await asyncio.shield(self._task)

    async def _fsync(self) -> None:
        upto, fd = self._written, self._fd
        try:
            await asyncio.get_running_loop().run_in_executor(self._io, os.fsync, fd)
            self._synced = max(self._synced, upto)
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

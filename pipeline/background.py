"""What the long-running helper tasks share (certificate and token reloads, the event-loop
lag probe): telling a changed file apart, and stopping a task."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any


def file_stamp(path: str) -> tuple[int, ...]:
    """What tells a changed file apart: a rename into place changes the inode, an edit in
    place the size or the mtime. A missing file is a stamp too (its errno)."""
    try:
        st = os.stat(path)
    except OSError as err:
        return (err.errno or -1,)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing) and wait for it to end."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""One builder at a time for a cache the test run shares (``pytest -n``: each worker is a
process of its own, and two first runs on a fresh machine would fill the same directory at
once). An advisory ``flock`` on a file beside the caches; the holder's exit releases it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    root = Path(os.environ.get("SPANPROF_CACHE", Path.home() / ".cache" / "spanprof"))
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

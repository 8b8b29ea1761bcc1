"""Time ranges as a user writes them (``2h..1h``, ``1h``, ``ISO..ISO``), read into unix
seconds that a ClickHouse ``DateTime`` holds: the query API's range parameters
(``params.time_range``) and a backfill's range (``spanprof backfill``, and the jobs its
admin API takes).
"""

from __future__ import annotations

from datetime import datetime

from pipeline.config import Duration

# ClickHouse ``DateTime`` is unsigned 32-bit seconds: 1970-01-01 .. 2106-02-07
MAX_TIME = 2**32 - 1


def parse_range(spec: str, now_s: float, name: str = "range") -> tuple[int, int]:
    """``2h..1h`` (ago), ``1h`` (the last hour) or ``ISO..ISO``: (from, to) unix seconds,
    both within what a ClickHouse DateTime holds. ``ValueError`` naming the parameter
    ``name`` for anything else: before 1970, after 2106, reversed, not a time."""
    if ".." in spec:
        a, b = spec.split("..", 1)
        lo, hi = _instant(a, now_s, name), _instant(b, now_s, name)
    else:
        lo, hi = _instant(spec, now_s, name), int(now_s)
    if lo >= hi:
        raise ValueError(f"{name}: range {spec[:80]!r} is empty: its start is not before "
                         "its end")
    return lo, hi


def _instant(text: str, now_s: float, name: str) -> int:
    x = text.strip()
    try:
        t = now_s - Duration.parse(x)
    except ValueError:
        try:
            t = datetime.fromisoformat(x).timestamp()
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"{name}: expected a duration ago (1h) or an ISO time, got "
                             f"{x[:40]!r}") from None
    if not 0 <= t <= MAX_TIME:
        raise ValueError(f"{name}: {x[:40]!r} is outside 1970-01-01..2106-02-07")
    return int(t)

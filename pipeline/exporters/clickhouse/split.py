"""One block into one table, whatever ClickHouse thinks of some of its values.

A block refused *permanently* (``faults.is_permanent``: a number beyond its column, a time
beyond ``DateTime``) is split in halves, recursively, under tokens derived from its own
(``TOKEN-table/0/1``), so the good rows go in and a retry of the split inserts nothing
twice; each single row still refused goes to the ``quarantine`` table with the reason
(``quarantined_rows``). A quarantine insert refused permanently too is logged with its
counts and dropped (``dropped_rows``) rather than wedging the writer. Retryable errors
propagate to the writer (``writer.py``), which retries the generation or refuses its
senders.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.exporters.clickhouse import faults, quarantine
from pipeline.exporters.clickhouse.quarantine import BadRow, row_count
from pipeline.exporters.clickhouse.rows import Columns

# insert(table, token, columns): one block under its insert_deduplication_token
Insert = Callable[[str, str, Columns], Awaitable[None]]


class Splitter:
    """Inserts blocks with ``insert``, splitting those with refused values; counts go to
    ``metric`` (``sent_rows``, ``inserts``, ``insert_ms``, ``quarantined_rows``, ``dropped_rows``
    per table), and the
    quarantine rows name ``component``."""

    def __init__(self, insert: Insert, metric: Callable[[str, int], None], log: Any,
                 component: str) -> None:
        self._insert = insert
        self.metric = metric
        self.log = log
        self.component = component

    async def insert_block(self, inserted: set[str], table: str, tok: str,
                           cols: Columns) -> None:
        """Insert one block, splitting it if ClickHouse refuses some of its values; the
        rows refused on their own are quarantined. Retryable errors propagate. ``inserted``
        holds the tokens of the blocks (and halves) stored: skipped, and added to."""
        if tok in inserted:
            return
        bad: list[BadRow] = []
        await self._insert_or_split(inserted, table, tok, cols, bad)
        if bad:
            await self._quarantine(table, tok, bad)
        inserted.add(tok)

    async def _insert_or_split(self, inserted: set[str], table: str, tok: str, cols: Columns,
                               bad: list[BadRow]) -> None:
        if tok in inserted:
            return
        started = time.monotonic()
        try:
            await self._insert(table, tok, cols)
        except Exception as err:
            if not faults.is_permanent(err):
                raise
            if row_count(cols) == 1:
                bad.append(BadRow(table, quarantine.row_json(table, cols),
                                  faults.reason(err), quarantine.tenant_of(cols)))
                return
            for i, half in enumerate(quarantine.halves(cols)):
                await self._insert_or_split(inserted, table, f"{tok}/{i}", half, bad)
            return
        inserted.add(tok)
        self.metric(f"sent_rows.{table}", row_count(cols))
        # where the store's time goes, per table (small inserts cost more per row)
        self.metric(f"inserts.{table}", 1)
        self.metric(f"insert_ms.{table}", round((time.monotonic() - started) * 1000))

    async def _quarantine(self, table: str, tok: str, bad: list[BadRow]) -> None:
        first = bad[0]
        fields = dict(table=table, rows=len(bad), reason=first.reason,
                      row_prefix=first.row[:quarantine.LOG_PREFIX])
        try:
            await self._insert(quarantine.TABLE, f"{tok}-quarantine",
                               quarantine.columns(self.component, bad))
        except Exception as err:
            if faults.is_transient(err) and not faults.is_permanent(err):
                raise  # ClickHouse is down or full: retried with the generation
            # the quarantine refused too (bad rows, or no quarantine table when the schema
            # is managed by hand: retrying would hold every client behind them): a log
            # line is all that is left of these rows
            self.metric(f"dropped_rows.{table}", len(bad))
            self.log.error("clickhouse_rows_dropped", error=faults.reason(err), **fields)
            return
        self.metric(f"quarantined_rows.{table}", len(bad))
        self.log.warning("clickhouse_rows_quarantined", **fields)

"""A generation: the rows the ClickHouse writer inserts together, and their senders' future.

Incoming batches join the current generation (``writer.py``): column lists per table for
rows without a token, one block per token for the rest (a Kafka block, or what the
correlator derived from one), and the stacks they reference. Its future resolves once
every block is in (or quarantined), or fails with ``Retryable``; ``inserted`` remembers the
blocks already stored, so that a retry of the generation skips them.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from pipeline.errors import Retryable
from pipeline.exporters.clickhouse.quarantine import row_count
from pipeline.exporters.clickhouse.rows import Columns, StackKey, extend


class Generation:
    """Rows inserted together, under tokens a retry keeps, and the future their senders
    wait on."""

    __slots__ = ("id", "tables", "rows", "done", "stacks", "opened", "inserted", "blocks",
                 "tokens", "uncertain")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.id = uuid.uuid4().hex
        self.tables: dict[str, Columns] = {}
        self.rows = 0
        self.done: asyncio.Future[None] = loop.create_future()
        self.stacks: set[StackKey] = set()  # (tenant, stack id)
        self.opened = time.monotonic()
        # insert tokens of the blocks (and split halves) stored: retries skip them
        self.inserted: set[str] = set()
        # rows that must be inserted as their own block under a deterministic token (one
        # Kafka message each): a redelivered message's insert is then dropped by the server
        self.blocks: list[tuple[str, dict[str, Columns]]] = []
        self.tokens: set[str] = set()
        # an attempt failed in a way that may have stored a block all the same
        self.uncertain = False

    def add(self, tables: dict[str, Columns]) -> None:
        extend(self.tables, tables)
        self.rows += sum(row_count(cols) for cols in tables.values())

    @property
    def started(self) -> bool:
        """Whether some of it may be in ClickHouse (then it must keep its tokens)."""
        return bool(self.inserted) or self.uncertain

    def fail(self, err: Retryable) -> None:
        if not self.done.done():
            self.done.set_exception(err)
        self.done.exception()  # retrieved here so that no caller-less future warns


"""Batched, retried, acknowledged inserts.

Incoming batches join the current *generation*: column lists per table plus one future.
The flusher swaps the generation when it holds ``batch_rows`` rows or ``flush_interval`` has
passed, inserts its tables one by one (stacks before the samples that reference them), and
resolves the future only when every table is in. A failed insert is retried with
exponential backoff under the same ``insert_deduplication_token``, so a retry that follows
a half-applied attempt is a no-op on the server; only when ``max_elapsed_time`` runs out do
the batch's senders get a retryable error, and they never get a success for rows that were
not written.

The pending row count (current generation plus the one being inserted) is bounded by
``max_pending_rows``; beyond it ``submit`` refuses with ``Retryable`` at once.

A batch with a token (a Kafka block, or what the correlator derived from one) that this
writer already inserted is acknowledged at once, and one already waiting joins its
generation: a sender that re-sends a round after a refusal (the Kafka receiver) then spends
queue room only on what was refused, instead of being refused again by its own re-sent
rows for ever. ClickHouse would drop the repeated insert anyway (same token); this only
keeps it out of the queue.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.errors import Retryable
from pipeline.exporters.clickhouse.rows import COLUMNS, Columns

# stacks first: a sample is never visible before the stack it references
TABLE_ORDER = ["profile_stacks", "otel_traces", "profile_samples", "span_attribution",
               "span_functions", "span_stacks", "unattributed_cpu"]
# a table rows.py fills but the writer does not know would be dropped without a word
assert set(TABLE_ORDER) == set(COLUMNS), set(TABLE_ORDER) ^ set(COLUMNS)
# tokens of inserted blocks remembered (a bound, like ClickHouse's own dedup window)
INSERTED_TOKENS = 100_000
# a stack written this long ago is written again when seen, which renews its last_seen:
# profile_stacks expires stacks by last_seen (migration 7), never one still in use
STACK_REFRESH_S = 6 * 3600
WRITTEN_STACKS = 1_000_000  # remembered at most; beyond, forgotten (rewriting is harmless)


class _Generation:
    __slots__ = ("id", "tables", "rows", "done", "stacks", "opened", "inserted", "blocks",
                 "tokens")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.id = uuid.uuid4().hex
        self.tables: dict[str, Columns] = {}
        self.rows = 0
        self.done: asyncio.Future[None] = loop.create_future()
        self.stacks: set[int] = set()
        self.opened = time.monotonic()
        self.inserted: set[str] = set()
        # rows that must be inserted as their own block under a deterministic token (one
        # Kafka message each): a redelivered message's insert is then dropped by the server
        self.blocks: list[tuple[str, dict[str, Columns]]] = []
        self.tokens: set[str] = set()

    def add(self, tables: dict[str, Columns]) -> None:
        for table, cols in tables.items():
            mine = self.tables.get(table)
            if mine is None:
                self.tables[table] = {c: list(v) for c, v in cols.items()}
            else:
                for c, v in cols.items():
                    mine[c].extend(v)
            self.rows += len(next(iter(cols.values()), []))


class Writer:
    def __init__(self, *, client: Any, executor: ThreadPoolExecutor, database: str,
                 batch_rows: int, flush_interval: float, max_pending_rows: int,
                 retry: Any, log: Any, metrics: Callable[[str, int], None]) -> None:
        self.client = client
        self.executor = executor
        self.database = database
        self.batch_rows = batch_rows
        self.flush_interval = flush_interval
        self.max_pending_rows = max_pending_rows
        self.retry = retry
        self.log = log
        self.metric = metrics
        self._gen: _Generation | None = None
        self._inflight: _Generation | None = None  # the generation being inserted
        self._inserted_tokens: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._written_stacks: dict[int, float] = {}  # stack id -> when written (monotonic)
        self.stack_refresh = STACK_REFRESH_S

    def __repr__(self) -> str:
        pending = self._gen.rows if self._gen else 0
        inflight = self._inflight.rows if self._inflight else 0
        return f"<Writer pending={pending} inflight={inflight} closing={self._closing}>"

    @property
    def pending_rows(self) -> int:
        return sum(g.rows for g in (self._gen, self._inflight) if g is not None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="clickhouse-writer")

    def known_stacks(self, ids: Iterable[int]) -> set[int]:
        """Which of these stacks need no row now: waiting in the current generation, or
        written less than ``stack_refresh`` ago."""
        now = time.monotonic()
        waiting = self._gen.stacks if self._gen else set()
        written = self._written_stacks
        known = set()
        for sid in ids:
            at = written.get(sid)
            if sid in waiting or (at is not None and now - at < self.stack_refresh):
                known.add(sid)
        return known

    async def submit(self, tables: dict[str, Columns], rows: int, stacks: set[int],
                     token: str | None = None) -> None:
        if self._closing:
            raise Retryable("clickhouse exporter is shutting down")
        if rows == 0:
            return
        if token is not None:
            # one token names a Kafka block's spans, its samples and its attribution rows:
            # what is remembered is the insert token of each table
            toks = {f"{token}-{table}" for table in tables}
            if toks <= self._inserted_tokens.keys():
                self.metric("repeated_blocks", 1)
                return
            for waiting in (self._gen, self._inflight):
                if waiting is not None and toks <= waiting.tokens:
                    self.metric("repeated_blocks", 1)
                    await asyncio.shield(waiting.done)
                    return
        # an empty queue takes any batch: one bigger than the bound alone would otherwise
        # be refused for ever (its sender retrying in vain)
        if self.pending_rows and self.pending_rows + rows > self.max_pending_rows:
            self.metric("refused_rows", rows)
            raise Retryable(f"clickhouse exporter queue is full ({self.pending_rows} rows "
                            f"pending, max_pending_rows={self.max_pending_rows})", retry_after=2.0)
        if self._gen is None:
            self._gen = _Generation(asyncio.get_running_loop())
        gen = self._gen
        if token is None:
            gen.add(tables)
        else:
            gen.blocks.append((token, tables))
            gen.tokens |= toks
            gen.rows += rows
        gen.stacks |= stacks
        if gen.rows >= self.batch_rows:
            self._wake.set()
        # shield: one caller giving up must not cancel the others' acknowledgement
        await asyncio.shield(gen.done)

    async def _run(self) -> None:
        # Inserts run back to back: while one is in flight the next generation fills, so a
        # busy exporter inserts big blocks and an idle one waits at most flush_interval.
        while True:
            gen = self._gen
            age = time.monotonic() - gen.opened if gen is not None else 0.0
            if gen is not None and (gen.rows >= self.batch_rows or self._closing
                                    or age >= self.flush_interval):
                self._gen = None
                await self._flush(gen)
                continue
            if self._closing:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.flush_interval - age)
            except TimeoutError:
                pass

    async def _flush(self, gen: _Generation) -> None:
        self._inflight = gen
        try:
            await self._insert_all(gen)
        except Retryable as err:
            if not gen.done.done():
                gen.done.set_exception(err)
            gen.done.exception()  # retrieved here so that no caller-less future warns
        else:
            if len(self._written_stacks) + len(gen.stacks) > WRITTEN_STACKS:
                self._written_stacks.clear()  # a bounded cache; rewriting a stack is harmless
            now = time.monotonic()
            for sid in gen.stacks:
                self._written_stacks[sid] = now
            for token in gen.tokens:
                self._inserted_tokens[token] = None
            while len(self._inserted_tokens) > INSERTED_TOKENS:
                self._inserted_tokens.popitem(last=False)
            if not gen.done.done():
                gen.done.set_result(None)
        finally:
            self._inflight = None

    async def _insert_all(self, gen: _Generation) -> None:
        loop = asyncio.get_running_loop()
        delay = float(self.retry.initial_interval)
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                for table in TABLE_ORDER:
                    blocks = [(gen.id, gen.tables)] + gen.blocks
                    for token, tables in blocks:
                        cols = tables.get(table)
                        tok = f"{token}-{table}"
                        if cols is None or tok in gen.inserted:
                            continue
                        names = COLUMNS[table]
                        data = [cols[c] for c in names]
                        insert = functools.partial(
                            self.client.insert, f"{self.database}.{table}", data,
                            column_names=names, column_oriented=True,
                            # the views' targets deduplicate too (their own window)
                            settings={"insert_deduplication_token": tok,
                                      "deduplicate_blocks_in_dependent_materialized_views": 1})
                        await loop.run_in_executor(self.executor, insert)
                        gen.inserted.add(tok)
                        self.metric(f"sent_rows.{table}", len(data[0]))
                return
            except Exception as err:
                attempt += 1
                elapsed = time.monotonic() - started
                self.metric("send_failed", 1)
                if not self.retry.enabled or elapsed + delay > float(self.retry.max_elapsed_time):
                    self.log.error("clickhouse_insert_gave_up", error=str(err)[:500],
                                   attempts=attempt, rows=gen.rows)
                    raise Retryable(f"clickhouse insert failed: {str(err)[:200]}") from err
                self.log.warning("clickhouse_insert_retry", error=str(err)[:500],
                                 attempt=attempt, retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
                delay = min(delay * 2, float(self.retry.max_interval))

    async def close(self) -> None:
        """Flush everything pending, then stop (idempotent)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

"""Batched, retried, acknowledged inserts.

Incoming batches join the current *generation*: column lists per table plus one future.
The flusher swaps the generation when it holds ``batch_rows`` rows or ``flush_interval`` has
passed, inserts its tables one by one (stacks before the samples that reference them), and
resolves the future only when every table is in (or, for rows refused for their values,
quarantined). Senders never get a success for rows that were neither.

The pending row count (current generation plus the one being inserted) is bounded by
``max_pending_rows``; beyond it ``submit`` refuses with ``Retryable`` at once.

A batch with a token (a Kafka block, or what the correlator derived from one) that this
writer already inserted is acknowledged at once, and one already waiting joins its
generation: a sender that re-sends a round after a refusal (the Kafka receiver) then spends
queue room only on what was refused, instead of being refused again by its own re-sent
rows for ever. ClickHouse would drop the repeated insert anyway (same token); this only
keeps it out of the queue.

**Failures** (``faults.py`` says which is which; a generation is ``generation.py``):

* *Permanent* (the rows' values: a number beyond its column, a time beyond ``DateTime``):
  the block is split in halves, recursively, under tokens derived from its own
  (``TOKEN-table/0/1``), so the good rows go in and a retry of the split inserts nothing
  twice; each single row still refused goes to the ``quarantine`` table with the reason
  (counted as ``quarantined_rows``). A quarantine insert refused permanently too is logged
  with its counts and dropped (``dropped_rows``) rather than wedging the writer. Nothing
  waits on bad rows, and their senders are acknowledged: their data is stored or
  quarantined (``split.py``).
* *Retryable* (ClickHouse down, disk full, too many parts): the writer enters a failing
  state, a circuit breaker. Until the next attempt is due (exponential backoff from
  ``retry_on_failure.initial_interval`` to ``max_interval``), ``submit`` refuses at once
  with ``Retryable(retry_after=...)``, and the generation waiting to be inserted is failed
  at once, so that clients get UNAVAILABLE / 503 with a delay instead of a timeout. Once
  the attempt is due, submissions are let in again and the next insert is the probe; the
  first insert that succeeds ends the failing state. ``failing_for`` reports the state
  (the exporter's ``failed``, hence /health, once it has lasted ``unhealthy_after``).
* The generation in flight when a retryable error strikes: if nothing of it can have been
  stored (no table inserted yet, ``gen.inserted`` empty, and the error says the attempt
  stored nothing: ``faults.may_have_landed``), its senders get ``Retryable`` at once and it
  is dropped; they resend, and nothing is stored twice. Otherwise (some blocks in, or an
  attempt whose outcome is unknown, like a timeout) it is retried under the same tokens
  until it is in, so that ClickHouse drops what it already has - or until
  ``max_elapsed_time``, after which its senders get ``Retryable`` and the rows are logged
  as not stored (``clickhouse_rows_not_stored``). This also bounds ``close()``: a shutdown
  waits at most ``max_elapsed_time`` for a generation that cannot be inserted.

Resending timed-out requests into new generations was what stored the same rows four times
during a disk-full episode: now clients are refused instead of left waiting, and what is
retried keeps its tokens.

Limits: a permanent error raised by a materialized view (none of spanprof's views raises on
values) comes after the source table stored the block, so splitting it would store the
good rows a second time there; and the failing state is only left by an insert that
succeeds, so with no traffic at all it lasts until the next batch.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.errors import Retryable
from pipeline.exporters.clickhouse import faults, quarantine
from pipeline.exporters.clickhouse.backend import ClickHouseClient
from pipeline.exporters.clickhouse.generation import Generation
from pipeline.exporters.clickhouse.rows import COLUMNS, Columns, StackKey, insert_columns
from pipeline.exporters.clickhouse.split import Splitter

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


class Writer:
    def __init__(self, *, client: ClickHouseClient, executor: ThreadPoolExecutor, database: str,
                 batch_rows: int, flush_interval: float, max_pending_rows: int,
                 retry: Any, log: Any, metrics: Callable[[str, int], None],
                 component: str = "clickhouse") -> None:
        self.client = client
        self.executor = executor
        self.database = database
        self.batch_rows = batch_rows
        self.flush_interval = flush_interval
        self.max_pending_rows = max_pending_rows
        self.retry = retry
        self.log = log
        self.metric = metrics
        self.component = component
        # one block into one table, split and quarantined on values ClickHouse refuses
        self._split = Splitter(self._insert, metrics, log, component)
        self._gen: Generation | None = None
        self._inflight: Generation | None = None  # the generation being inserted
        self._inserted_tokens: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        # (tenant, stack id) -> when written (monotonic): profile_stacks is per tenant, so
        # a stack another tenant wrote is written again for this one
        self._written_stacks: dict[StackKey, float] = {}
        self.stack_refresh = STACK_REFRESH_S
        # the failing state (circuit breaker): since when (monotonic), why, the next backoff
        # delay, and until when submissions are refused
        self._failing_since: float | None = None
        self._last_error = ""
        self._delay = float(retry.initial_interval)
        self._refuse_until = 0.0

    def __repr__(self) -> str:
        pending = self._gen.rows if self._gen else 0
        inflight = self._inflight.rows if self._inflight else 0
        failing = self.failing_for()
        state = f" failing={failing[0]:.0f}s" if failing else ""
        return (f"<Writer pending={pending} inflight={inflight} closing={self._closing}"
                f"{state}>")

    @property
    def pending_rows(self) -> int:
        return sum(g.rows for g in (self._gen, self._inflight) if g is not None)

    def failing_for(self) -> tuple[float, str] | None:
        """How long inserts have been failing with retryable errors, and the last error;
        None while the last insert succeeded."""
        if self._failing_since is None:
            return None
        return time.monotonic() - self._failing_since, self._last_error

    def retry_in(self) -> float | None:
        """While inserts fail: seconds until the next attempt (at least 1); else None."""
        if self._failing_since is None:
            return None
        return max(1.0, self._refuse_until - time.monotonic())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="clickhouse-writer")

    def known_stacks(self, tenant: str, ids: Iterable[int]) -> set[int]:
        """Which of these stacks of ``tenant`` need no row now: waiting in the current
        generation, or written less than ``stack_refresh`` ago."""
        now = time.monotonic()
        waiting = self._gen.stacks if self._gen else set()
        written = self._written_stacks
        known = set()
        for sid in ids:
            key = (tenant, sid)
            at = written.get(key)
            if key in waiting or (at is not None and now - at < self.stack_refresh):
                known.add(sid)
        return known

    async def submit(self, tables: dict[str, Columns], rows: int, stacks: set[StackKey],
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
        self._refuse_if_failing(rows)
        # an empty queue takes any batch: one bigger than the bound alone would otherwise
        # be refused for ever (its sender retrying in vain)
        if self.pending_rows and self.pending_rows + rows > self.max_pending_rows:
            self.metric("refused_rows", rows)
            raise Retryable(f"clickhouse exporter queue is full ({self.pending_rows} rows "
                            f"pending, max_pending_rows={self.max_pending_rows})", retry_after=2.0)
        if self._gen is None:
            self._gen = Generation(asyncio.get_running_loop())
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

    def _refuse_if_failing(self, rows: int) -> None:
        """The open circuit: while inserts fail and the next attempt is not yet due, a new
        batch could only wait; its sender is told at once when to come back."""
        wait = self._refuse_until - time.monotonic()
        if self._failing_since is None or wait <= 0:
            return
        self.metric("refused_rows", rows)
        raise Retryable(f"clickhouse inserts are failing, next attempt in {wait:.1f}s: "
                        f"{self._last_error[:200]}", retry_after=max(1.0, wait))

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

    async def _flush(self, gen: Generation) -> None:
        self._inflight = gen
        try:
            await self._insert_all(gen)
        except Retryable as err:
            gen.fail(err)
        else:
            if len(self._written_stacks) + len(gen.stacks) > WRITTEN_STACKS:
                self._written_stacks.clear()  # a bounded cache; rewriting a stack is harmless
            now = time.monotonic()
            for key in gen.stacks:
                self._written_stacks[key] = now
            for token in gen.tokens:
                self._inserted_tokens[token] = None
            while len(self._inserted_tokens) > INSERTED_TOKENS:
                self._inserted_tokens.popitem(last=False)
            if not gen.done.done():
                gen.done.set_result(None)
        finally:
            self._inflight = None

    async def _insert_all(self, gen: Generation) -> None:
        """Insert every block of ``gen``; on a retryable error either give its senders
        ``Retryable`` at once (nothing of it stored) or retry with the same tokens."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                for table in TABLE_ORDER:
                    for token, tables in [(gen.id, gen.tables), *gen.blocks]:
                        cols = tables.get(table)
                        if cols is not None:
                            await self._split.insert_block(gen.inserted, table,
                                                           f"{token}-{table}", cols)
                return
            except Exception as err:
                attempt += 1
                gen.uncertain |= faults.may_have_landed(err)
                delay = self._failed(err)
                elapsed = time.monotonic() - started
                short = faults.reason(err, 200)
                if not gen.started:
                    self._not_stored(gen, "insert_failed_nothing_stored", err, attempt)
                    raise Retryable(f"clickhouse insert failed: {short}",
                                    retry_after=max(1.0, delay)) from err
                if not self.retry.enabled or elapsed + delay > float(self.retry.max_elapsed_time):
                    self._not_stored(gen, "retries_exhausted", err, attempt)
                    raise Retryable(f"clickhouse insert failed: {short}") from err
                self.log.warning("clickhouse_insert_retry", error=faults.reason(err, 500),
                                 attempt=attempt, retry_in_s=round(delay, 2),
                                 code=faults.server_code(err))
                await asyncio.sleep(delay)

    def _not_stored(self, gen: Generation, why: str, err: BaseException,
                    attempts: int) -> None:
        """The generation's senders are about to be told to resend: say so, with counts."""
        log = self.log.warning if why == "insert_failed_nothing_stored" else self.log.error
        self.metric("send_failed_rows", gen.rows)
        log("clickhouse_rows_not_stored", why=why, rows=gen.rows, attempts=attempts,
            blocks_stored=len(gen.inserted), error=faults.reason(err, 500),
            code=faults.server_code(err))

    def _failed(self, err: BaseException) -> float:
        """Enter (or stay in) the failing state after a retryable error; returns the delay
        before the next attempt. The batches waiting for the next insert are failed now:
        they could only wait, and nothing of them is stored."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        self._last_error = faults.reason(err, 200)
        delay = self._delay
        self._delay = min(delay * 2, float(self.retry.max_interval))
        self._refuse_until = now + delay
        self.metric("send_failed", 1)
        waiting = self._gen
        if waiting is not None:
            self._gen = None
            self.metric("send_failed_rows", waiting.rows)
            waiting.fail(Retryable(f"clickhouse inserts are failing: {self._last_error}",
                                   retry_after=max(1.0, delay)))
        return delay

    def _succeeded(self) -> None:
        """An insert went in: the failing state, if any, is over."""
        if self._failing_since is not None:
            self.log.info("clickhouse_insert_recovered",
                          failed_for_s=round(time.monotonic() - self._failing_since, 1))
        self._failing_since = None
        self._delay = float(self.retry.initial_interval)
        self._refuse_until = 0.0

    async def _insert(self, table: str, tok: str, cols: Columns) -> None:
        names = (quarantine.QUARANTINE_COLUMNS if table == quarantine.TABLE
                 else insert_columns(table, cols))
        data = [cols[c] for c in names]
        insert = functools.partial(
            self.client.insert, f"{self.database}.{table}", data,
            column_names=names, column_oriented=True,
            # the views' targets deduplicate too (their own window)
            settings={"insert_deduplication_token": tok,
                      "deduplicate_blocks_in_dependent_materialized_views": 1})
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, insert)
        finally:
            # clickhouse-connect's InsertContext holds a bound method of its own (a
            # reference cycle) and this list: emptied, the columns are freed by refcount
            # now rather than by the garbage collector, whose young collections spent up to
            # 200 ms walking them (10 000-item lists, every insert) at steady state
            data.clear()
        self._succeeded()

    async def close(self) -> None:
        """Flush everything pending, then stop (idempotent). Bounded: a generation that
        cannot be inserted is given up after ``max_elapsed_time``."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

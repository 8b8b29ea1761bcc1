"""``spancorrelator``: joins profile samples to spans, emits per-span attribution.

It has the Collector's *connector* shape: an exporter of the ``traces`` and ``profiles``
pipelines and the receiver of an ``attributions`` pipeline::

    connectors:
      spancorrelator:
        grace: 10s            # hold a span this long after it arrives for its samples
        orphan_timeout: 60s   # report samples of never-seen spans after this
        late_window: 10m      # samples this late for a reported span still flush fast
        max_entries: 200000   # held spans + sample groups; beyond: report oldest early
        max_state_mib: 512    # estimated memory of what is held; beyond: the same
        flush_interval: 1s
        checkpoint_interval: 5s  # how often the checkpoint of held input is written
        recover: true         # on start, reconcile what a crash lost (recovery.py)
    service:
      pipelines:
        traces:       {receivers: [otlp], exporters: [clickhouse, spancorrelator]}
        profiles:     {receivers: [otlp], exporters: [clickhouse, spancorrelator]}
        attributions: {receivers: [spancorrelator], exporters: [clickhouse]}

Batches from the Kafka receiver (``origin`` set: one insert block of many messages) take
another path: their rows are a pure function of each message, are sent on as one batch
under the block's name and are written before ``consume`` returns, so that the receiver
commits the offsets only once the attribution is durable (exactly once after crashes, see
``messages.attribute_block`` and ``pipeline.kafka.blocks``).

Reports that the next stage refuses stay in an outbox and are retried; while the outbox is
over ``max_entries`` rows, new input is refused with a retryable error (explicit
backpressure, not an unbounded queue).

Crash recovery: when the ``attributions`` pipeline ends in a ``clickhouse`` exporter (the
graph then gives the connector that store, ``Context.store``), the connector writes a
checkpoint every ``checkpoint_interval``: the arrival of the oldest input it still holds
unreported, taken only after a flush that left the outbox empty. On start it reconciles
every trace stored since then with what ``span_attribution`` holds (``recovery``), before
any receiver runs. Without a store (the Kafka tier, unit tests) there is neither.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from pipeline.component import Consumer
from pipeline.config import Duration, NonNegDuration, PositiveInt
from pipeline.errors import ConfigError, Retryable
from pipeline.records import DEFAULT_TENANT, AttributionBatch, Batch, ProfileBatch, SpanBatch
from pipeline.registry import Context, Factory, Store
from processors.correlate import recovery
from processors.correlate.messages import SpanLookup, attribute_block, span_lookup_add
from processors.correlate.state import CorrelatorState, Stats

# attribution rows per batch sent on (each fans out to function and stack rows). The pieces
# of one flush are sent at once, so that the exporter inserts them together (a 2 000-row
# insert costs 5x more per row than a 20 000-row one: each insert writes a part per table
# and view), while none blocks the event loop for long (with a sending queue each piece is
# logged in turn, and acknowledgements of other requests get through between them)
OUTBOX_CHUNK = 10_000


class Config(msgspec.Struct, forbid_unknown_fields=True):
    grace: NonNegDuration = NonNegDuration(10.0)
    orphan_timeout: Duration = Duration(60.0)
    late_window: Duration = Duration(600.0)
    max_entries: PositiveInt = 200_000
    max_state_mib: PositiveInt = 512
    flush_interval: Duration = Duration(1.0)
    checkpoint_interval: Duration = Duration(5.0)
    recover: bool = True

    def validate(self) -> None:
        if self.max_entries < 1:
            raise ConfigError("max_entries: must be at least 1")
        if self.flush_interval <= 0:
            raise ConfigError("flush_interval: must be greater than 0")


class SpanCorrelator:
    def __init__(self, cfg: Config, ctx: Context,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.clock = clock
        # one join state per tenant: a sample only ever meets spans of its own tenant, and
        # each tenant's held entries are bounded on their own (``max_entries``)
        self.states: dict[str, CorrelatorState] = {}
        self._outbox: list[AttributionBatch] = []
        # Kafka tier: spans of this worker's partitions, per tenant, for the rows of later
        # samples; oldest forgotten first: an OrderedDict's first item is O(1), a dict's is not
        self._seen_spans: dict[str, SpanLookup] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._last_checkpoint = float("-inf")
        # a recovery that failed: checkpoints stay at its start, so the next start retries
        self._floor: float | None = None

    def __repr__(self) -> str:
        return f"<SpanCorrelator {self.states!r} outbox={self.outbox_rows}>"

    def state_of(self, tenant: str) -> CorrelatorState:
        """The tenant's join state (created at its first batch)."""
        state = self.states.get(tenant)
        if state is None:
            cfg = self.cfg
            state = self.states[tenant] = CorrelatorState(
                grace=cfg.grace, orphan_timeout=cfg.orphan_timeout,
                late_window=cfg.late_window,
                # service.tenants: a tenant's own bound on what it may hold
                max_entries=self.ctx.tenants.max_spans_held(tenant, cfg.max_entries),
                max_bytes=cfg.max_state_mib << 20)
        return state

    @property
    def state(self) -> CorrelatorState:
        """The default tenant's state (the one tenant of a single-team deployment)."""
        return self.state_of(DEFAULT_TENANT)

    def stats(self) -> Stats:
        """Every tenant's counters added up."""
        total = Stats()
        for state in self.states.values():
            for f in dataclasses.fields(Stats):
                setattr(total, f.name, getattr(total, f.name) + getattr(state.stats, f.name))
        return total

    @property
    def outbox_rows(self) -> int:
        return sum(len(b) for b in self._outbox)

    async def start(self) -> None:
        store = self.ctx.store
        if store is not None and "attributions" in self.ctx.next:
            await self._recover(store)
        self._task = asyncio.create_task(self._run(), name=f"{self.ctx.id}-flush")

    def admit(self) -> None:
        """``Retryable`` while this connector cannot take batches (``Fanout`` asks before
        the exporters store a batch, so that a retry stores nothing twice)."""
        if self._stopped:
            raise Retryable(f"{self.ctx.id}: shutting down")
        if self.outbox_rows > self.cfg.max_entries:
            raise Retryable(f"{self.ctx.id}: attribution output is backed up "
                            f"({self.outbox_rows} rows waiting); retry later", retry_after=5.0)

    async def consume(self, batch: Batch) -> None:
        self.admit()
        if isinstance(batch, SpanBatch | ProfileBatch) and batch.origin:
            # from Kafka: write this block's rows now, before its offsets are committed. A
            # span block has none (names and durations are in otel_traces): its spans are
            # remembered to name the operation of later samples' rows
            seen = self._seen_spans.get(batch.tenant)
            if seen is None:
                seen = self._seen_spans[batch.tenant] = OrderedDict()
            if isinstance(batch, SpanBatch):
                span_lookup_add(seen, batch, self.cfg.max_entries)
            else:
                await self.ctx.next["attributions"].consume(attribute_block(batch, seen))
            return
        now = self.clock()
        if isinstance(batch, SpanBatch):
            self.state_of(batch.tenant).add_spans(batch.spans, now)
        elif isinstance(batch, ProfileBatch):
            self.state_of(batch.tenant).add_samples(batch, now)
        else:
            raise TypeError(f"{self.ctx.id} does not consume {batch.signal}")
        if len(self.states) > 1:
            self._bound_all(now)

    def _bound_all(self, now: float) -> None:
        """``max_entries`` and ``max_state_mib`` bound every tenant's state together too:
        beyond them, the tenant holding the most reports its oldest entries early (each
        state already keeps within its own bounds)."""
        max_bytes = self.cfg.max_state_mib << 20
        for _ in range(len(self.states)):  # the biggest first, the next if not enough
            entries = sum(s.entries for s in self.states.values())
            held = sum(s.bytes for s in self.states.values())
            if entries <= self.cfg.max_entries and held <= max_bytes:
                return
            big = max(self.states.values(), key=lambda s: (s.bytes, s.entries))
            big.shrink_to(big.entries - max(0, entries - self.cfg.max_entries),
                          big.bytes - max(0, held - max_bytes), now)

    async def flush(self, force: bool = False) -> bool:
        """Report what is due and send the outbox; True when nothing is left unsent.

        What is due is taken ``OUTBOX_CHUNK`` entries at a time, each piece sent before
        the next is built: at shutdown (everything held, 200 000 spans by default) the
        rows of all of it at once were 300 MiB more at the moment the process stops. When
        a send fails, the rest of what is due is taken into the outbox all the same (it
        then bounds new input, ``consume``), except when forced: the state keeps it for
        the next try."""
        async with self._lock:
            now = self.clock()
            nxt = self.ctx.next["attributions"]
            # a copy: a new tenant's state may come while a piece is sent
            for tenant, state in list(self.states.items()):
                # at most what is held now: input that comes while pieces are sent (late
                # samples of reported spans are due at once) waits for the next flush, so
                # that a flush ends and every tenant gets its turn. Forced (stopping, no
                # input taken any more): all of it, orphans made by placing held samples too
                pieces = -(-(len(state.spans) + len(state.late) + len(state.orphans))
                           // OUTBOX_CHUNK)
                while True:
                    self._take(tenant, state, now, force, OUTBOX_CHUNK)
                    pieces -= 1
                    if (pieces <= 0 and not force) or not state.has_due(now, force):
                        break
                    if not await self._send(nxt):
                        if not force:
                            for t, st in list(self.states.items()):
                                self._take(t, st, now, force, None)
                        return False  # tried again at the next flush
            return await self._send(nxt)

    def _take(self, tenant: str, state: CorrelatorState, now: float, force: bool,
              limit: int | None) -> None:
        """Move what is due of ``state`` (at most ``limit`` entries) into the outbox, in
        pieces of at most ``OUTBOX_CHUNK`` rows: each one bounded insert, and one slow piece
        does not hold the rest."""
        evicted_before = state.stats.evicted
        due = state.take_due(now, force=force, limit=limit)
        for i in range(0, max(len(due.attributions), 1), OUTBOX_CHUNK):
            piece = AttributionBatch(due.attributions[i:i + OUTBOX_CHUNK],
                                     due.unattributed if i == 0 else [], tenant=tenant)
            if piece.attributions or piece.unattributed:
                self._outbox.append(piece)
        if state.stats.evicted != evicted_before:
            self.log.warning("correlator_evicted", tenant=tenant,
                             evicted_total=state.stats.evicted,
                             max_entries=self.cfg.max_entries,
                             max_state_mib=self.cfg.max_state_mib,
                             state_mib=round(state.bytes / (1 << 20), 1))

    async def _send(self, nxt: Consumer) -> bool:
        """Send the outbox, its pieces at once; what fails stays, in order, and is retried:
        nothing is dropped, nothing accepted goes twice."""
        if not self._outbox:
            return True
        sending = list(self._outbox)
        results = await asyncio.gather(*(nxt.consume(b) for b in sending),
                                       return_exceptions=True)
        failed = [b for b, r in zip(sending, results, strict=True)
                  if isinstance(r, BaseException)]
        self._outbox = failed + self._outbox[len(sending):]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.log.warning("correlator_send_failed", error=str(errors[0]),
                             failed_batches=len(errors), outbox_rows=self.outbox_rows)
            return False
        return True

    async def _run(self) -> None:
        while not self._stopped:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=float(self.cfg.flush_interval))
            except TimeoutError:
                pass
            if self._stopped:
                return
            try:
                if await self.flush() and \
                        self.clock() - self._last_checkpoint >= float(self.cfg.checkpoint_interval):
                    await self.checkpoint()
            except Exception:  # never let the flusher die silently
                self.log.exception("correlator_flush_error")

    def held_since(self) -> float:
        """Wall-clock time of the oldest input held unreported (now if none): only valid
        right after a flush that left the outbox empty (otherwise its rows are held too)."""
        now = time.time()
        times = [t for t in (s.oldest_held() for s in self.states.values()) if t is not None]
        oldest = min(times) if times else None
        held = now if oldest is None else min(now, now - (self.clock() - oldest))
        return held if self._floor is None else min(held, self._floor)

    async def checkpoint(self, held_since: float | None = None) -> None:
        """Write the checkpoint (``held_since`` computed now unless given); a failure is
        logged: the previous checkpoint stays, which only widens the next recovery."""
        store = self.ctx.store
        if store is None:
            return
        held = self.held_since() if held_since is None else held_since
        self._last_checkpoint = self.clock()
        try:
            await recovery.write_checkpoint(store, self.ctx.id, held)
        except Exception as err:
            self.log.warning("correlator_checkpoint_failed", error=str(err)[:300])

    async def _recover(self, store: Store) -> None:
        """Reconcile what a crash may have lost, then checkpoint: see ``recovery``."""
        t0 = time.monotonic()
        try:
            since = await recovery.read_checkpoint(store, self.ctx.id)
        except Exception as err:
            self.log.warning("correlator_checkpoint_unreadable", error=str(err)[:300])
            return
        if since is not None and self.cfg.recover:
            margin = recovery.MARGIN_S + 2 * float(self.cfg.flush_interval)
            try:
                res = await recovery.recover(store, since - margin,
                                             self.ctx.next["attributions"].consume)
            except Exception as err:
                self._floor = since
                self.log.error("correlator_recovery_failed", error=str(err)[:300],
                               held_since=since)
                return
            self.log.info("correlator_recovered", traces=res.traces, rows=res.rows,
                          cpu_ns=res.cpu_ns, seconds=round(time.monotonic() - t0, 3),
                          held_since=since, traces_skipped=res.skipped_traces,
                          services=res.services, services_skipped=res.skipped_services)
        await self.checkpoint(time.time())

    async def shutdown(self) -> None:
        """Report everything held, whatever its window, and deliver it before returning."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            # never cancel a send in flight: its rows may already be in the exporter, and
            # sending them again from the outbox would count them twice
            self._wake.set()
            await self._task
        if "attributions" not in self.ctx.next:
            return
        delay = 0.2
        for _ in range(50):
            if await self.flush(force=True):
                now = time.time()
                await self.checkpoint(now if self._floor is None else self._floor)
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        else:
            self.log.error("correlator_shutdown_unsent", outbox_rows=self.outbox_rows)
        s = self.stats()
        self.log.info("correlator_stopped", spans=s.spans_in, samples=s.samples_in,
                      rows=s.rows_out, evicted=s.evicted, orphans=s.orphans_reported)


def create(cfg: Config, ctx: Context) -> SpanCorrelator:
    return SpanCorrelator(cfg, ctx)


FACTORY = Factory(type="spancorrelator", kind="connector", config=Config, create=create,
                  signals=("traces", "profiles"), emits=("attributions",))

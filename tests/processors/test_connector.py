"""SpanCorrelator: the connector around CorrelatorState (outbox, backpressure, lifecycle).

The clock is injected so that windows pass when the test says so; the downstream is a fake
consumer that records what it accepts and can be made to fail or to block.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest

from pipeline.config import Duration
from pipeline.errors import ConfigError, Retryable
from pipeline.records import (
    AttributionBatch,
    Batch,
    ProfileBatch,
    Sample,
    Span,
    SpanBatch,
    Stack,
)
from pipeline.registry import Context
from processors.correlate.connector import FACTORY, Config, SpanCorrelator

TRACE = bytes(range(1, 17))


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class RecordingLog:
    """Stands in for the bound structlog logger; keeps the event names."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def _record(self, event: str, **_: object) -> None:
        self.events.append(event)

    info = warning = error = exception = _record


class FakeDownstream:
    """Records each batch it accepts; refuses the next ``fail_times`` sends; ``gate`` blocks."""

    def __init__(self) -> None:
        self.accepted: list[AttributionBatch] = []
        self.calls = 0
        self.fail_times = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.refuse_span: bytes | None = None  # refuse any batch holding this span id
        # like an exporter that has buffered the rows before it awaits its insert
        self.keep_on_entry = False

    async def consume(self, batch: Batch) -> None:
        self.calls += 1
        self.entered.set()
        if self.keep_on_entry:
            assert isinstance(batch, AttributionBatch)
            self.accepted.append(batch)
        if self.gate is not None:
            await self.gate.wait()
        assert isinstance(batch, AttributionBatch)
        if self.refuse_span is not None and any(
                a.span_id == self.refuse_span for a in batch.attributions):
            raise Retryable("clickhouse: part too large")
        if self.fail_times:
            self.fail_times -= 1
            raise Retryable("clickhouse: unavailable")
        if not self.keep_on_entry:
            self.accepted.append(batch)

    def cpu_rows(self) -> Counter[tuple[bytes, int, bool]]:
        """Every accepted row as (span id, cpu, span known), with multiplicity."""
        return Counter((a.span_id, a.cpu_ns, a.span_known)
                       for b in self.accepted for a in b.attributions)

    def cpu_by_span(self) -> Counter[bytes]:
        out: Counter[bytes] = Counter()
        for b in self.accepted:
            for a in b.attributions:
                out[a.span_id] += a.cpu_ns
        return out


def sid(n: int) -> bytes:
    return n.to_bytes(8, "big")


def spans(*ns: int) -> SpanBatch:
    return SpanBatch([Span(TRACE, sid(n), b"", f"op{n}", 2, "api", 0, 100) for n in ns])


async def feed(c: SpanCorrelator, *ns: int) -> None:
    """Spans with CPU (span n gets n ns): a span without any has no attribution row."""
    await c.consume(spans(*ns))
    await c.consume(samples(*((n, n) for n in ns)))


def samples(*pairs: tuple[int | None, int]) -> ProfileBatch:
    out = [Sample(TRACE if n is not None else b"", sid(n) if n is not None else b"", "api",
                  0, 1, "cpu", v, 1, "cpu", "nanoseconds") for n, v in pairs]
    return ProfileBatch(out, {1: Stack(1, ["leaf"], ["a.py"], [1])})


def make(grace: float = 10.0, orphan_timeout: float = 60.0, max_entries: int = 1_000,
         flush_interval: float = 3_600.0, downstream: bool = True,
         ) -> tuple[SpanCorrelator, FakeDownstream, FakeClock]:
    fake = FakeDownstream()
    clock = FakeClock()
    cfg = Config(grace=Duration(grace), orphan_timeout=Duration(orphan_timeout),
                 max_entries=max_entries, flush_interval=Duration(flush_interval))
    nxt = {"attributions": fake} if downstream else {}
    ctx = Context(id="spancorrelator", pipelines=["traces", "profiles"],
                  next=nxt, log=RecordingLog())  # type: ignore[arg-type]
    return SpanCorrelator(cfg, ctx, clock=clock), fake, clock


class TestFlush:
    async def test_sends_only_due_rows(self) -> None:
        """flush() sends the rows whose window has passed and holds the others."""
        c, fake, clock = make(grace=10)
        await c.consume(spans(1))
        await c.consume(samples((1, 40)))
        clock.t = 5
        await feed(c, 2)
        clock.t = 9.9
        assert await c.flush() is True
        assert fake.calls == 0
        clock.t = 10
        assert await c.flush() is True
        assert fake.cpu_rows() == Counter({(sid(1), 40, True): 1})
        clock.t = 15
        assert await c.flush() is True
        assert fake.cpu_rows() == Counter({(sid(1), 40, True): 1, (sid(2), 2, True): 1})
        assert c.outbox_rows == 0

    async def test_nothing_due_sends_nothing(self) -> None:
        """A flush with nothing due does not call the downstream at all."""
        c, fake, _ = make()
        await c.consume(spans(1))
        assert await c.flush() is True
        assert fake.calls == 0

    async def test_unattributed_is_sent(self) -> None:
        """Unlinked CPU is delivered on the next flush as unattributed."""
        c, fake, _ = make()
        await c.consume(samples((None, 25)))
        assert await c.flush() is True
        assert [u.cpu_ns for b in fake.accepted for u in b.unattributed] == [25]

    async def test_attribution_batch_is_refused(self) -> None:
        """The connector consumes traces and profiles only."""
        c, _, _ = make()
        with pytest.raises(TypeError, match="attributions"):
            await c.consume(AttributionBatch([]))


class TestTenants:
    async def test_same_ids_of_two_tenants_never_meet(self) -> None:
        """Two tenants send the same trace and span ids: each one's samples join its own
        span only, unlinked CPU stays with its tenant, and every row names its tenant."""
        c, fake, _ = make(grace=0)
        a_spans, b_samples = spans(1), samples((1, 70), (None, 5))
        b_samples.tenant = "team-b"
        await c.consume(a_spans)  # team-b never sends this span: its samples are orphans
        await c.consume(samples((1, 30)))
        await c.consume(b_samples)
        await c.flush(force=True)
        rows = {(b.tenant, a.span_id, a.cpu_ns, a.span_known)
                for b in fake.accepted for a in b.attributions}
        assert rows == {("default", sid(1), 30, True), ("team-b", sid(1), 70, False)}
        assert [(b.tenant, u.cpu_ns) for b in fake.accepted for u in b.unattributed] == \
            [("team-b", 5)]
        assert c.stats().samples_in == 3 and c.state.stats.samples_in == 1

    async def test_a_tenant_bound_of_its_own(self) -> None:
        """service.tenants' max_spans_held bounds that tenant's held entries: beyond it
        its oldest are reported early, the other tenants' are untouched."""
        from pipeline.tenants import TenantLimits, Tenants, TenantsConfig

        c, fake, _ = make(max_entries=1_000)
        c.ctx.tenants = Tenants(TenantsConfig(overrides={"small": TenantLimits(
            max_spans_held=2)}))
        small, big = spans(1, 2, 3, 4), spans(1, 2, 3, 4)
        small.tenant, big.tenant = "small", "big"
        await c.consume(small)
        await c.consume(big)
        assert (c.states["small"].max_entries, c.states["big"].max_entries) == (2, 1_000)
        assert c.states["small"].stats.evicted == 2 and c.states["big"].stats.evicted == 0

    async def test_all_tenants_together_within_max_entries(self) -> None:
        """Many tenants each within their own bound still hold no more than max_entries
        together: the biggest reports its oldest early, nothing is lost (every sample's
        CPU is reported once flushed)."""
        c, fake, _ = make(max_entries=10)
        for t in range(4):
            batch, smp = spans(*range(1, 6)), samples(*((n, 10) for n in range(1, 6)))
            batch.tenant = smp.tenant = f"t{t}"
            await c.consume(batch)
            await c.consume(smp)
            assert sum(s.entries for s in c.states.values()) <= 10
        assert c.stats().evicted > 0
        await c.flush(force=True)
        assert sum(a.cpu_ns for b in fake.accepted for a in b.attributions) == 4 * 5 * 10

    async def test_kafka_blocks_look_up_their_tenant_spans(self) -> None:
        """In the Kafka tier a sample's row is named from a span of its own tenant only."""
        c, fake, _ = make()
        block_a, block_b = spans(1), samples((1, 9))
        block_a.origin, block_b.origin, block_b.tenant = "a", "b", "team-b"
        await c.consume(block_a)
        await c.consume(block_b)
        ((row,),) = [b.attributions for b in fake.accepted]
        assert (fake.accepted[0].tenant, row.span_known, row.name) == ("team-b", False, "")


class TestOutbox:
    async def test_failed_rows_are_resent_once(self) -> None:
        """Rows the downstream refused stay in the outbox and go out on the next flush."""
        c, fake, clock = make(grace=0)
        fake.fail_times = 1
        await c.consume(spans(1))
        await c.consume(samples((1, 10)))
        assert await c.flush() is False
        assert fake.accepted == []
        assert c.outbox_rows == 1
        assert "outbox=1" in repr(c)

        clock.t = 1
        await c.consume(spans(2))
        await c.consume(samples((2, 20), (1, 5)))  # 1 is reported: a late delta row
        assert await c.flush() is True
        assert c.outbox_rows == 0
        assert fake.cpu_rows() == Counter({(sid(1), 10, True): 1, (sid(2), 20, True): 1,
                                           (sid(1), 5, True): 1})
        assert fake.cpu_by_span() == {sid(1): 15, sid(2): 20}
        # the old batch goes first: the outbox keeps its order
        assert [a.span_id for a in fake.accepted[0].attributions] == [sid(1)]

    async def test_repeated_failures_lose_and_double_nothing(self) -> None:
        """Across several failed flushes, every row is delivered exactly once in the end."""
        c, fake, clock = make(grace=0)
        fed: Counter[bytes] = Counter()
        fake.fail_times = 3
        for n in range(1, 6):
            clock.t = n
            await c.consume(spans(n))
            await c.consume(samples((n, n * 100)))
            fed[sid(n)] += n * 100
            await c.flush()
        assert await c.flush() is True
        assert fake.cpu_by_span() == fed
        assert sum(fake.cpu_rows().values()) == 5  # one row per span, none repeated
        assert c.outbox_rows == 0

    async def test_partial_drain_keeps_the_rest(self) -> None:
        """If a later outbox batch fails, the batches already accepted are not re-sent."""
        c, fake, clock = make(grace=0)
        fake.fail_times = 1
        await feed(c, 1)
        assert await c.flush() is False          # outbox: [1]
        clock.t = 1
        await feed(c, 2)
        fake.refuse_span = sid(2)
        assert await c.flush() is False          # [1] accepted, [2] refused
        assert fake.cpu_rows() == Counter({(sid(1), 1, True): 1})
        assert c.outbox_rows == 1
        fake.refuse_span = None
        assert await c.flush() is True
        assert fake.cpu_rows() == Counter({(sid(1), 1, True): 1, (sid(2), 2, True): 1})
        assert c.outbox_rows == 0

    async def test_send_failure_does_not_raise(self) -> None:
        """flush() reports a refused send with False rather than an exception."""
        c, fake, _ = make(grace=0)
        fake.fail_times = 5
        await feed(c, 1)
        assert await c.flush() is False
        assert await c.flush() is False
        assert c.outbox_rows == 1


class TestBackpressure:
    async def test_refuses_input_when_outbox_over_max_entries(self) -> None:
        """While the outbox holds more than max_entries rows, consume raises Retryable."""
        c, fake, _ = make(grace=0, max_entries=2)
        fake.fail_times = 100
        await feed(c, 1, 2, 3)  # the bound evicts one; all three rows are due
        assert await c.flush() is False
        assert c.outbox_rows == 3
        before = c.state.stats.samples_in, c.state.stats.spans_in
        with pytest.raises(Retryable) as exc:
            await c.consume(samples((4, 1)))
        assert exc.value.retry_after > 0
        with pytest.raises(Retryable):
            await c.consume(spans(4))
        assert (c.state.stats.samples_in, c.state.stats.spans_in) == before  # not taken in

        fake.fail_times = 0
        assert await c.flush() is True
        await c.consume(spans(4))  # accepted again once the outbox drained
        assert c.state.stats.spans_in == 4

    async def test_outbox_at_max_entries_still_accepts(self) -> None:
        """Exactly max_entries rows waiting is not yet 'over' the bound."""
        c, fake, _ = make(grace=0, max_entries=3)
        fake.fail_times = 100
        await feed(c, 1, 2, 3)
        assert await c.flush() is False
        assert c.outbox_rows == 3
        await c.consume(spans(4))
        assert c.state.stats.spans_in == 4


class TestShutdown:
    async def test_reports_everything_regardless_of_windows(self) -> None:
        """shutdown() delivers held spans, orphans and unattributed CPU, whatever the windows."""
        c, fake, _ = make(grace=1_000, orphan_timeout=1_000)
        await c.start()
        await c.consume(spans(1))
        await c.consume(samples((1, 10), (2, 20), (None, 30)))
        await asyncio.wait_for(c.shutdown(), timeout=5)
        assert fake.cpu_rows() == Counter({(sid(1), 10, True): 1, (sid(2), 20, False): 1})
        assert [u.cpu_ns for b in fake.accepted for u in b.unattributed] == [30]
        assert c.state.entries == 0
        assert c.outbox_rows == 0

    async def test_idempotent(self) -> None:
        """A second shutdown() sends nothing more; input after shutdown is refused."""
        c, fake, _ = make()
        await c.start()
        await feed(c, 1)
        await asyncio.wait_for(c.shutdown(), timeout=5)
        calls = fake.calls
        await asyncio.wait_for(c.shutdown(), timeout=5)
        assert fake.calls == calls == 1
        assert c.log.events.count("correlator_stopped") == 1
        with pytest.raises(Retryable):
            await c.consume(spans(2))

    async def test_without_start(self) -> None:
        """shutdown() without start() is safe, and still flushes what was consumed."""
        c, fake, _ = make()
        await feed(c, 1)
        await asyncio.wait_for(c.shutdown(), timeout=5)
        assert fake.cpu_rows() == Counter({(sid(1), 1, True): 1})
        await asyncio.wait_for(c.shutdown(), timeout=5)

    async def test_without_start_or_downstream(self) -> None:
        """A correlator with no attributions consumer shuts down without error, twice."""
        c, _, _ = make(downstream=False)
        await c.shutdown()
        await c.shutdown()
        assert repr(c)

    async def test_retries_a_refused_final_send(self) -> None:
        """If the downstream refuses during shutdown, shutdown retries until it is delivered."""
        c, fake, _ = make(grace=1_000)
        await c.consume(spans(1))
        await c.consume(samples((1, 7)))
        fake.fail_times = 1
        await asyncio.wait_for(c.shutdown(), timeout=5)
        assert fake.calls == 2
        assert fake.cpu_rows() == Counter({(sid(1), 7, True): 1})
        assert c.outbox_rows == 0

    async def test_send_in_flight_is_not_doubled(self) -> None:
        """A background flush in flight at shutdown completes; its rows are not sent twice."""
        c, fake, clock = make(grace=0, flush_interval=0.01)
        fake.gate = asyncio.Event()
        fake.keep_on_entry = True  # cancelling this send and re-sending it would double it
        await c.start()
        await c.consume(spans(1))
        await c.consume(samples((1, 11)))
        await asyncio.wait_for(fake.entered.wait(), timeout=2)  # the flusher is sending
        clock.t = 1
        await feed(c, 2)  # arrives while the first send is blocked
        stop = asyncio.create_task(c.shutdown())
        await asyncio.sleep(0.02)
        assert not stop.done()  # waits for the send in flight
        fake.gate.set()
        await asyncio.wait_for(stop, timeout=5)
        assert fake.cpu_rows() == Counter({(sid(1), 11, True): 1, (sid(2), 2, True): 1})

    async def test_everything_held_goes_a_piece_at_a_time(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """At shutdown everything held is reported, but built and sent a piece at a time:
        the next piece is taken only once the one before is delivered (the rows of all of
        it at once were 300 MiB at 200 000 spans); every row exactly once."""
        monkeypatch.setattr("processors.correlate.connector.OUTBOX_CHUNK", 100)
        c, fake, _ = make(grace=1_000, orphan_timeout=1_000, max_entries=10_000)
        await feed(c, *range(1, 1_001))
        await c.consume(samples(*((n, 5) for n in range(2_001, 2_251))))  # orphans
        in_flight = peak = 0
        held_at_send: list[int] = []
        consume = fake.consume

        async def counting(batch: Batch) -> None:
            nonlocal in_flight, peak
            assert isinstance(batch, AttributionBatch)
            in_flight += len(batch)
            peak = max(peak, in_flight)
            held_at_send.append(c.state.entries)
            await asyncio.sleep(0)  # let a concurrent send (were there one) begin
            await consume(batch)
            in_flight -= len(batch)

        fake.consume = counting  # type: ignore[method-assign]
        await asyncio.wait_for(c.shutdown(), timeout=10)
        assert peak <= 100
        assert len(fake.accepted) == 13
        assert held_at_send == sorted(held_at_send, reverse=True)  # taken as it goes
        assert held_at_send[0] == 1_150
        want = Counter({(sid(n), n, True): 1 for n in range(1, 1_001)})
        want.update({(sid(n), 5, False): 1 for n in range(2_001, 2_251)})
        assert fake.cpu_rows() == want
        assert c.state.entries == 0

    async def test_a_piece_refused_at_shutdown_keeps_the_rest_held(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A piece refused while stopping stays in the outbox and the rest in the state
        (not all built at once into the outbox); the retry delivers all, each row once."""
        monkeypatch.setattr("processors.correlate.connector.OUTBOX_CHUNK", 10)
        c, fake, _ = make(grace=1_000)
        await feed(c, *range(1, 51))
        fake.fail_times = 1
        assert not await c.flush(force=True)
        assert c.outbox_rows == 10
        assert c.state.entries == 40
        assert await c.flush(force=True)
        assert fake.cpu_rows() == Counter({(sid(n), n, True): 1 for n in range(1, 51)})

    async def test_a_refused_piece_takes_the_rest_into_the_outbox(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Not stopping: when a piece is refused, the rest of what is due moves to the
        outbox as before (where it bounds new input) and is sent later, once each."""
        monkeypatch.setattr("processors.correlate.connector.OUTBOX_CHUNK", 10)
        c, fake, clock = make(grace=1)
        await feed(c, *range(1, 51))
        clock.t = 2
        fake.fail_times = 1
        assert not await c.flush()
        assert c.outbox_rows == 50
        assert c.state.entries == 0
        assert await c.flush()
        assert fake.cpu_rows() == Counter({(sid(n), n, True): 1 for n in range(1, 51)})

    async def test_input_during_the_pieces_waits_for_the_next_flush(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Late samples (due at once) arriving while each piece is sent do not keep a
        flush going: it takes at most what was held when it began, returns, and every
        tenant gets its turn."""
        monkeypatch.setattr("processors.correlate.connector.OUTBOX_CHUNK", 10)
        c, fake, clock = make(grace=1, max_entries=100_000)
        for t in ("a", "b"):
            await c.consume(msgspec.structs.replace(spans(*range(1, 31)), tenant=t))
            await c.consume(msgspec.structs.replace(
                samples(*((n, n) for n in range(1, 31))), tenant=t))
        clock.t = 2
        consume = fake.consume

        async def busy(batch: Batch) -> None:
            await consume(batch)
            late = samples(*((n, 1) for n in range(1, 12)))  # more than a piece
            await c.consume(msgspec.structs.replace(late, tenant="a"))

        fake.consume = busy  # type: ignore[method-assign]
        assert await asyncio.wait_for(c.flush(), timeout=5)
        assert {b.tenant for b in fake.accepted} == {"a", "b"}

    async def test_stopping_reports_the_orphans_that_placing_held_samples_makes(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Forced, a flush goes on past what was held when it began: timed samples whose
        span never came become orphans when placed, and are reported too."""
        monkeypatch.setattr("processors.correlate.connector.OUTBOX_CHUNK", 10)
        c, fake, _ = make(grace=1_000, orphan_timeout=1_000)
        timed = [Sample(TRACE, sid(n), "api", 1_000, 1, "cpu", 7, 1, "cpu", "nanoseconds",
                        timed=True) for n in range(100, 135)]
        await c.consume(ProfileBatch(timed, {1: Stack(1, ["leaf"], ["a.py"], [1])}))
        await feed(c, 1)
        await asyncio.wait_for(c.shutdown(), timeout=5)
        assert sum(a.cpu_ns for b in fake.accepted for a in b.attributions) == 35 * 7 + 1
        assert c.state.entries == 0


class TestBackgroundFlush:
    async def test_flusher_sends_due_rows(self) -> None:
        """After start(), due rows are sent every flush_interval without an explicit flush."""
        c, fake, clock = make(grace=5, flush_interval=0.01)
        await c.start()
        await feed(c, 1)
        await asyncio.sleep(0.05)
        assert fake.calls == 0  # grace has not passed on the fake clock
        clock.t = 5
        await asyncio.wait_for(fake.entered.wait(), timeout=2)
        assert fake.cpu_rows() == Counter({(sid(1), 1, True): 1})
        await c.shutdown()
        assert fake.calls == 1


class TestConfig:
    def test_empty_decodes_to_defaults(self) -> None:
        """``{}`` gives the documented defaults."""
        cfg = msgspec.convert({}, Config)
        assert (cfg.grace, cfg.orphan_timeout, cfg.late_window) == (10.0, 60.0, 600.0)
        assert (cfg.max_entries, cfg.flush_interval) == (200_000, 1.0)

    @pytest.mark.parametrize(("kw", "message"), [
        ({"max_entries": 0}, "max_entries: must be at least 1"),
        ({"flush_interval": Duration(0)}, "flush_interval: must be greater than 0"),
    ])
    def test_invalid_values_name_the_key(self, kw: dict[str, object], message: str) -> None:
        """Invalid values are configuration errors that name their key."""
        with pytest.raises(ConfigError, match=message):
            Config(**kw).validate()  # type: ignore[arg-type]

    def test_factory_is_a_connector(self) -> None:
        """Registered as ``spancorrelator``: consumes traces and profiles, emits attributions."""
        assert (FACTORY.type, FACTORY.kind) == ("spancorrelator", "connector")
        assert (FACTORY.signals, FACTORY.emits) == (("traces", "profiles"), ("attributions",))


class TestJoin:
    async def test_samples_then_span_make_one_known_row(self) -> None:
        """Samples consumed before their span are joined to it: one known row, their CPU."""
        c, fake, clock = make(grace=10)
        await c.consume(samples((1, 300), (1, 200)))
        clock.t = 3
        await c.consume(spans(1))
        clock.t = 13
        assert await c.flush() is True
        assert fake.cpu_rows() == Counter({(sid(1), 500, True): 1})
        (row,) = [a for b in fake.accepted for a in b.attributions]
        assert row.name == "op1"


class TestShutdownRace:
    async def test_direct_flush_in_flight_is_not_doubled(self) -> None:
        """Shutdown while a direct flush() is blocked in its send: no row goes twice."""
        c, fake, _ = make(grace=0)
        fake.gate = asyncio.Event()
        fake.keep_on_entry = True
        await feed(c, 1)
        flushing = asyncio.create_task(c.flush())
        await asyncio.wait_for(fake.entered.wait(), timeout=2)
        await feed(c, 2)
        stop = asyncio.create_task(c.shutdown())
        await asyncio.sleep(0.02)
        assert not stop.done()  # the final flush waits for the one in flight
        fake.gate.set()
        await asyncio.wait_for(asyncio.gather(flushing, stop), timeout=5)
        assert flushing.result() is True
        assert fake.cpu_rows() == Counter({(sid(1), 1, True): 1, (sid(2), 2, True): 1})

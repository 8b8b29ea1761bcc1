"""processors/batch.py: merging small batches, and telling each caller the truth.

The downstream is a fake consumer that records what it is sent and can be made to fail or
to block until the test releases it.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pipeline.config import Duration
from pipeline.errors import ConfigError, Retryable
from pipeline.records import (
    Attribution,
    AttributionBatch,
    Batch,
    ProfileBatch,
    Sample,
    Span,
    SpanBatch,
    Stack,
    Unattributed,
)
from pipeline.records import concat as merge
from pipeline.registry import Context
from processors.batch import FACTORY, BatchProcessor, Config, create

TRACE = bytes(range(1, 17))


class FakeConsumer:
    """Records every batch it accepts; ``fail`` makes it raise, ``gate`` makes it wait."""

    def __init__(self) -> None:
        self.calls = 0
        self.batches: list[Batch] = []
        self.fail: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def consume(self, batch: Batch) -> None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.batches.append(batch)


def span(i: int) -> Span:
    return Span(TRACE, i.to_bytes(8, "big"), b"", f"op{i}", 1, "api", 0, 10)


def spans(*ids: int) -> SpanBatch:
    return SpanBatch([span(i) for i in ids])


def names(batch: Batch) -> list[str]:
    assert isinstance(batch, SpanBatch)
    return [s.name for s in batch.spans]


def processor(fake: FakeConsumer, send_batch_size: int = 3,
              timeout: float = 30.0) -> BatchProcessor:
    cfg = Config(send_batch_size=send_batch_size, timeout=Duration(timeout))
    cfg.validate()
    return create(cfg, Context(id="batch", pipelines=["traces"], next={"traces": fake}))


async def settle() -> None:
    """Let every ready task run (a few loop iterations, no real time)."""
    for _ in range(10):
        await asyncio.sleep(0)


class TestConfig:
    def test_empty_decodes_to_defaults(self) -> None:
        """``{}`` gives send_batch_size 8192 and a 200 ms timeout."""
        cfg = msgspec.convert({}, Config)
        assert (cfg.send_batch_size, float(cfg.timeout)) == (8192, 0.2)

    def test_send_batch_size_below_one_is_rejected(self) -> None:
        """A zero batch size is a configuration error naming the key."""
        with pytest.raises(ConfigError, match="send_batch_size: must be at least 1"):
            Config(send_batch_size=0).validate()

    def test_factory_handles_every_signal(self) -> None:
        """The factory is registered as ``batch`` for traces, profiles and attributions."""
        assert (FACTORY.type, FACTORY.kind) == ("batch", "processor")
        assert set(FACTORY.signals) == {"traces", "profiles", "attributions"}


class TestMerging:
    async def test_sends_when_send_batch_size_reached(self) -> None:
        """Three one-span batches with send_batch_size 3 go down as one batch, in order."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=3)
        tasks = [asyncio.create_task(bp.consume(spans(i))) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        assert fake.calls == 1
        assert names(fake.batches[0]) == ["op0", "op1", "op2"]

    async def test_tenants_are_batched_apart(self) -> None:
        """Batches of two tenants waiting together go down as one batch per tenant, each
        in order and naming its tenant; every caller is answered."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=4)
        sent = [spans(0), spans(1), spans(2), spans(3)]
        sent[1].tenant = sent[3].tenant = "team-b"
        tasks = [asyncio.create_task(bp.consume(b)) for b in sent]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        got = {b.tenant: names(b) for b in fake.batches}
        assert got == {"default": ["op0", "op2"], "team-b": ["op1", "op3"]}
        assert fake.calls == 2

    def test_concat_refuses_mixed_tenants(self) -> None:
        """``concat`` never makes one batch of two tenants' data."""
        a, b = spans(0), spans(1)
        b.tenant = "team-b"
        with pytest.raises(ValueError, match="tenants"):
            merge([a, b])
        b.tenant = "default"
        assert merge([a, b]).tenant == "default"

    async def test_waits_below_send_batch_size(self) -> None:
        """Two items of three are held: nothing is sent and no caller returns yet."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=3)
        tasks = [asyncio.create_task(bp.consume(spans(i))) for i in range(2)]
        await settle()
        assert fake.calls == 0
        assert not any(t.done() for t in tasks)
        assert repr(bp) == "<BatchProcessor batch waiting=2 sending=0>"
        await bp.shutdown()
        await asyncio.gather(*tasks)

    async def test_sends_on_timeout(self) -> None:
        """Below the size, the waiting items go when the oldest is ``timeout`` old."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=100, timeout=0.05)
        loop = asyncio.get_running_loop()
        began = loop.time()
        first = asyncio.create_task(bp.consume(spans(1)))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(bp.consume(spans(2, 3)))
        await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
        elapsed = loop.time() - began
        assert 0.045 <= elapsed < 1.0
        assert fake.calls == 1
        assert names(fake.batches[0]) == ["op1", "op2", "op3"]

    async def test_timer_counts_from_the_oldest_item(self) -> None:
        """A later item does not postpone the send of the first one."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=100, timeout=0.1)
        loop = asyncio.get_running_loop()
        began = loop.time()
        first = asyncio.create_task(bp.consume(spans(1)))
        await asyncio.sleep(0.06)
        second = asyncio.create_task(bp.consume(spans(2)))
        await asyncio.wait_for(first, timeout=5)
        assert loop.time() - began < 0.15
        await second
        assert fake.calls == 1

    async def test_one_large_batch_goes_at_once(self) -> None:
        """A batch at least send_batch_size big is sent without waiting for the timer."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=2, timeout=30.0)
        await asyncio.wait_for(bp.consume(spans(1, 2, 3)), timeout=5)
        assert names(fake.batches[0]) == ["op1", "op2", "op3"]

    async def test_next_batch_starts_fresh(self) -> None:
        """After a send the count restarts: the next items make a batch of their own."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=2)
        await asyncio.gather(*(bp.consume(spans(i)) for i in range(4)))
        assert [names(b) for b in fake.batches] == [["op0", "op1"], ["op2", "op3"]]

    async def test_empty_batch_returns_at_once(self) -> None:
        """An empty batch is not queued and not sent."""
        fake = FakeConsumer()
        bp = processor(fake)
        await asyncio.wait_for(bp.consume(SpanBatch([])), timeout=1)
        await bp.shutdown()
        assert fake.calls == 0

    def test_merge_profiles_keeps_every_stack(self) -> None:
        """Merged profile batches keep all samples and the union of their stacks."""
        s1 = Sample(TRACE, b"a" * 8, "api", 0, 1, "cpu", 5, 1, "cpu", "nanoseconds")
        s2 = Sample(TRACE, b"b" * 8, "api", 0, 2, "cpu", 7, 1, "cpu", "nanoseconds")
        st1 = Stack(1, ["f"], ["f.py"], [1])
        st2 = Stack(2, ["g"], ["g.py"], [2])
        out = merge([ProfileBatch([s1], {1: st1}), ProfileBatch([s2], {2: st2})])
        assert isinstance(out, ProfileBatch)
        assert out.samples == [s1, s2]
        assert out.stacks == {1: st1, 2: st2}

    def test_merge_gateway_batches_adds_their_counts(self) -> None:
        """A gateway's batches hold requests and counts, no records (``items``): merged,
        the counts add up and every request is carried on, for spans and samples."""
        p = merge([ProfileBatch([], {}, sources=[("p1", [])], items=7),
                   ProfileBatch([], {}, sources=[("p2", [(0, 0, 1)])], items=5)])
        assert isinstance(p, ProfileBatch)
        assert (len(p), p.samples, p.sources) == (12, [], [("p1", []), ("p2", [(0, 0, 1)])])
        s = merge([SpanBatch([], sources=[("t1", [])], items=3),
                   SpanBatch([], sources=[("t2", [])], items=0)])
        assert isinstance(s, SpanBatch)
        assert (len(s), s.spans) == (3, [])

    def test_merge_attributions_keeps_unattributed(self) -> None:
        """Merged attribution batches keep both the rows and the unattributed totals."""
        a = Attribution(TRACE, b"a" * 8, "link", "api", "x", b"", 0, 0, True, 1, 0, 1, {}, {})
        u = Unattributed("api", 0, 3, 0, 1)
        out = merge([AttributionBatch([a]), AttributionBatch([], [u])])
        assert isinstance(out, AttributionBatch)
        assert (out.attributions, out.unattributed) == ([a], [u])

    def test_merge_spans_keeps_sources(self) -> None:
        """Merged span batches carry every source request on."""
        b1 = SpanBatch([span(1)], sources=[("req1", [])])
        b2 = SpanBatch([span(2)], sources=[("req2", [(0, 0, 1)])])
        out = merge([b1, b2])
        assert isinstance(out, SpanBatch)
        assert out.sources == [("req1", []), ("req2", [(0, 0, 1)])]


class TestAcknowledgement:
    async def test_callers_return_only_after_send_succeeded(self) -> None:
        """While the merged send is in flight, no caller's await has returned."""
        fake = FakeConsumer()
        fake.gate = asyncio.Event()
        bp = processor(fake, send_batch_size=2)
        tasks = [asyncio.create_task(bp.consume(spans(i))) for i in range(2)]
        await asyncio.wait_for(fake.entered.wait(), timeout=5)
        await settle()
        assert not any(t.done() for t in tasks)
        assert repr(bp) == "<BatchProcessor batch waiting=0 sending=1>"
        fake.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        assert len(fake.batches) == 1

    async def test_cancelled_caller_does_not_disturb_the_others(self) -> None:
        """A caller that gives up does not fail the send for the rest of its batch."""
        fake = FakeConsumer()
        fake.gate = asyncio.Event()
        bp = processor(fake, send_batch_size=2)
        gone = asyncio.create_task(bp.consume(spans(1)))
        kept = asyncio.create_task(bp.consume(spans(2)))
        await asyncio.wait_for(fake.entered.wait(), timeout=5)
        gone.cancel()
        await settle()
        fake.gate.set()
        await asyncio.wait_for(kept, timeout=5)
        assert gone.cancelled()
        assert names(fake.batches[0]) == ["op1", "op2"]

    async def test_retryable_reaches_every_caller_of_the_batch(self) -> None:
        """A Retryable from downstream is raised to each caller whose data was in the batch."""
        fake = FakeConsumer()
        fake.fail = Retryable("clickhouse: unavailable", retry_after=3.0)
        bp = processor(fake, send_batch_size=3)
        tasks = [asyncio.create_task(bp.consume(spans(i))) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        assert fake.calls == 1
        assert all(isinstance(r, Retryable) for r in results), results
        assert all(r.retry_after == 3.0 for r in results)  # type: ignore[union-attr]

    async def test_failure_is_confined_to_its_batch(self) -> None:
        """Callers of a later, successful batch succeed after an earlier batch failed."""
        fake = FakeConsumer()
        fake.fail = Retryable("down")
        bp = processor(fake, send_batch_size=2)
        failed = await asyncio.gather(bp.consume(spans(1)), bp.consume(spans(2)),
                                      return_exceptions=True)
        assert all(isinstance(r, Retryable) for r in failed)
        fake.fail = None
        await asyncio.wait_for(asyncio.gather(bp.consume(spans(3)), bp.consume(spans(4))), 5)
        assert [names(b) for b in fake.batches] == [["op3", "op4"]]

    async def test_timeout_send_failure_reaches_callers(self) -> None:
        """A batch sent by the timer reports its failure to its callers too."""
        fake = FakeConsumer()
        fake.fail = Retryable("down")
        bp = processor(fake, send_batch_size=100, timeout=0.01)
        with pytest.raises(Retryable, match="down"):
            await asyncio.wait_for(bp.consume(spans(1)), timeout=5)


class TestShutdown:
    async def test_shutdown_flushes_waiting_items(self) -> None:
        """Items below the size and before the timer are sent at shutdown; callers succeed."""
        fake = FakeConsumer()
        bp = processor(fake, send_batch_size=100, timeout=30.0)
        tasks = [asyncio.create_task(bp.consume(spans(i))) for i in range(2)]
        await settle()
        assert fake.calls == 0
        await asyncio.wait_for(bp.shutdown(), timeout=5)
        assert [names(b) for b in fake.batches] == [["op0", "op1"]]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=1)

    async def test_shutdown_waits_for_sends_in_flight(self) -> None:
        """shutdown() returns only after the send already in flight has finished."""
        fake = FakeConsumer()
        fake.gate = asyncio.Event()
        bp = processor(fake, send_batch_size=1)
        task = asyncio.create_task(bp.consume(spans(1)))
        await asyncio.wait_for(fake.entered.wait(), timeout=5)
        stopping = asyncio.create_task(bp.shutdown())
        await settle()
        assert not stopping.done()
        fake.gate.set()
        await asyncio.wait_for(stopping, timeout=5)
        assert task.done() and task.exception() is None
        assert len(fake.batches) == 1

    async def test_shutdown_with_nothing_waiting(self) -> None:
        """shutdown() with no data sends nothing, and can be called twice."""
        fake = FakeConsumer()
        bp = processor(fake)
        await bp.shutdown()
        await bp.shutdown()
        assert fake.calls == 0

    async def test_shutdown_reports_failure_to_callers(self) -> None:
        """If the final send fails, its callers get the error; shutdown itself returns."""
        fake = FakeConsumer()
        fake.fail = Retryable("down")
        bp = processor(fake, send_batch_size=100, timeout=30.0)
        task = asyncio.create_task(bp.consume(spans(1)))
        await settle()
        await asyncio.wait_for(bp.shutdown(), timeout=5)
        with pytest.raises(Retryable):
            await task

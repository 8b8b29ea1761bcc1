"""pipeline.component.Fanout: exporters first, connectors after; a retry never stores a
batch twice."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.component import Fanout
from pipeline.errors import InvalidData, PartlyStored, Retryable
from pipeline.records import SpanBatch

B1 = SpanBatch([])


class Consumer:
    def __init__(self, fail: list[Exception] | None = None, busy: int = 0) -> None:
        self.got: list[Any] = []
        self.fail = fail or []
        self.busy = busy  # admit() refuses this many times

    async def consume(self, batch: Any) -> None:
        if self.fail:
            raise self.fail.pop(0)
        self.got.append(batch)


class Connector(Consumer):
    def admit(self) -> None:
        if self.busy:
            self.busy -= 1
            raise Retryable("backed up", retry_after=0.01)


class TestFanout:
    async def test_connector_busy_refuses_before_anything_is_stored(self) -> None:
        exp, conn = Consumer(), Connector(busy=1)
        fan = Fanout([exp], [conn])
        with pytest.raises(Retryable, match="backed up"):
            await fan.consume(B1)
        assert exp.got == [] and conn.got == []
        await fan.consume(B1)  # the retry
        assert exp.got == [B1] and conn.got == [B1]

    async def test_connector_refusing_after_the_store_is_retried_alone(self) -> None:
        exp, other = Consumer(), Consumer()
        conn = Connector(fail=[Retryable("later", retry_after=0.01)] * 2)
        fan = Fanout([exp, other], [conn])
        await fan.consume(B1)
        assert exp.got == other.got == conn.got == [B1]

    async def test_taken_somewhere_never_refused_for_now(self) -> None:
        """Once an exporter has stored the batch, another's refusal for now is waited out
        (it alone is given the batch again), never handed back for a retry that would
        store it twice; then the connectors."""
        a, b = Consumer(), Consumer(fail=[Retryable("later", retry_after=0.01)] * 3)
        conn = Connector()
        await Fanout([a, b], [conn]).consume(B1)
        assert a.got == b.got == conn.got == [B1]

    async def test_refused_for_good_after_a_store_is_partly_stored(self) -> None:
        """An exporter refusing for good what another stored, or the connector what the
        exporters stored: PartlyStored (final), nothing given twice."""
        a, b, conn = Consumer(), Consumer(fail=[InvalidData("too big for Kafka")]), Connector()
        with pytest.raises(PartlyStored, match="too big for Kafka"):
            await Fanout([a, b], [conn]).consume(B1)
        assert a.got == [B1] and conn.got == []
        exp, conn = Consumer(), Connector(fail=[TypeError("a bug")])
        with pytest.raises(PartlyStored, match="a bug"):
            await Fanout([exp], [conn]).consume(B1)
        assert exp.got == [B1]

    async def test_worst_status_wins(self) -> None:
        a = Consumer(fail=[Retryable("x")])
        b = Consumer(fail=[InvalidData("bad")])
        with pytest.raises(InvalidData):
            await Fanout([a, b], [Connector()]).consume(B1)
        with pytest.raises(Retryable):  # nothing taken: the caller may retry
            await Fanout([Consumer(fail=[Retryable("x")]), Consumer(fail=[Retryable("y")])],
                         [Connector()]).consume(B1)

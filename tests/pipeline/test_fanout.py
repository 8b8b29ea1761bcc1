"""pipeline.component.Fanout: exporters first, connectors after; a retry never stores a
batch twice."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.component import Fanout
from pipeline.errors import InvalidData, Retryable


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
            await fan.consume("b1")
        assert exp.got == [] and conn.got == []
        await fan.consume("b1")  # the retry
        assert exp.got == ["b1"] and conn.got == ["b1"]

    async def test_connector_refusing_after_the_store_is_retried_alone(self) -> None:
        exp, other = Consumer(), Consumer()
        conn = Connector(fail=[Retryable("later", retry_after=0.01)] * 2)
        fan = Fanout([exp, other], [conn])
        await fan.consume("b1")
        assert exp.got == other.got == conn.got == ["b1"]

    async def test_connector_refusing_too_long_is_refused_stored_once(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(Fanout, "THEN_RETRY_S", 0.05)
        exp = Consumer()
        conn = Connector(fail=[Retryable("later", retry_after=0.02)] * 100)
        with pytest.raises(Retryable):
            await Fanout([exp], [conn]).consume("b1")
        assert exp.got == ["b1"]

    async def test_worst_status_wins(self) -> None:
        a = Consumer(fail=[Retryable("x")])
        b = Consumer(fail=[InvalidData("bad")])
        with pytest.raises(InvalidData):
            await Fanout([a, b], [Connector()]).consume("b1")
        conn = Connector(fail=[InvalidData("no")])
        with pytest.raises(InvalidData):
            await Fanout([Consumer()], [conn]).consume("b1")

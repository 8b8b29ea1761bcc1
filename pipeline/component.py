"""The few protocols every component implements, and the fan-out between them.

A batch enters at a receiver and flows forward; ``await consumer.consume(batch)`` returns
only once every exporter downstream has made it durable, so the receiver can answer its
client truthfully. Awaiting the call chain *is* the acknowledgement: no side channel to
keep in sync, and the worst outcome of a fan-out is simply the exception it raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pipeline.errors import InvalidData, Retryable
from pipeline.records import Batch


@runtime_checkable
class Consumer(Protocol):
    async def consume(self, batch: Batch) -> None:
        """Return when the batch is durable downstream; raise ``Retryable``/``InvalidData``."""


class Component(Protocol):
    async def start(self) -> None:
        """Start serving; return fast (long work goes into tasks)."""

    async def shutdown(self) -> None:
        """Stop and flush. Idempotent, and safe without ``start()``."""


class Fanout:
    """Delivers one batch to several consumers of one pipeline.

    Exporters go first, together; connectors (e.g. the correlator) only once every exporter
    has stored the raw data. A client that is told to retry therefore never feeds the
    correlator the same batch twice, so attribution cannot double count a retried request.
    Status is the worst of all: ``InvalidData`` over ``Retryable`` over success.
    """

    def __init__(self, first: Sequence[Consumer], then: Sequence[Consumer] = ()) -> None:
        self.first = list(first)
        self.then = list(then)

    def __repr__(self) -> str:
        return f"<Fanout first={len(self.first)} then={len(self.then)}>"

    async def consume(self, batch: Batch) -> None:
        for group in (self.first, self.then):
            if not group:
                continue
            if len(group) == 1:
                await group[0].consume(batch)
                continue
            results = await asyncio.gather(
                *(c.consume(batch) for c in group), return_exceptions=True
            )
            raise_worst(results)


def raise_worst(results: Sequence[object]) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return
    for kind in (InvalidData, Retryable):
        for err in errors:
            if isinstance(err, kind):
                raise err
    raise errors[0]

"""The few protocols every component implements, what it is built from, and the fan-out.

A batch enters at a receiver and flows forward; ``await consumer.consume(batch)`` returns
only once every exporter downstream has made it durable, so the receiver can answer its
client truthfully. Awaiting the call chain *is* the acknowledgement: no side channel to
keep in sync, and the worst outcome of a fan-out is simply the exception it raises.

A ``Factory`` is a component type: its ``Config`` and how to create it with a ``Context``.
Which factories exist is not known here: ``pipeline.registry`` lists them, and whoever
loads a config and builds the graph passes them in (``Factories``).
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import msgspec
import structlog

from pipeline.errors import InvalidData, Retryable
from pipeline.records import Batch, Signal
from pipeline.tenants import Tenants

Kind = Literal["receiver", "processor", "exporter", "connector", "extension"]


@runtime_checkable
class Consumer(Protocol):
    async def consume(self, batch: Batch) -> None:
        """Return when the batch is durable downstream; raise ``Retryable``/``InvalidData``."""


class Component(Protocol):
    async def start(self) -> None:
        """Start serving; return fast (long work goes into tasks)."""

    async def shutdown(self) -> None:
        """Stop and flush. Idempotent, and safe without ``start()``."""


class Store(Protocol):
    """Read and write access to the tables an exporter fills (the ``clickhouse`` exporter).

    Given to a connector whose output ends in that exporter (``graph.build``), so that the
    correlator can keep a checkpoint and, after a crash, reconcile what it held in memory
    with the raw rows already stored. Components never reach the store otherwise."""

    @property
    def database(self) -> str: ...

    async def query(self, sql: str, parameters: dict[str, Any] | None = None
                    ) -> tuple[list[str], list[tuple[Any, ...]]]: ...

    async def insert(self, table: str, data: list[list[Any]], columns: list[str]) -> None: ...

    async def command(self, sql: str, parameters: dict[str, Any] | None = None) -> None: ...


@dataclass
class Context:
    """What a component is given at construction: who it is and whom it feeds."""

    id: str
    pipelines: list[str]
    # receivers / connectors: next consumer per output signal; processors: under its signal
    next: dict[str, Consumer] = field(default_factory=dict)
    log: Any = None
    data_dir: str = "."
    # connectors feeding a ``clickhouse`` exporter: that exporter (see ``Store``); None
    # elsewhere, and where the input comes from Kafka (its offsets already give exactly
    # once); receivers whose pipelines store into one: that exporter (resent requests)
    store: Store | None = None
    # receivers, per signal: whether anything downstream reads the records of a batch;
    # False: every consumer only passes its OTLP requests on (``Factory.records``)
    records: dict[str, bool] = field(default_factory=dict)
    # receivers: the started extensions a receiver's ``auth: {authenticator: ID}`` can name
    authenticators: Mapping[str, Any] = field(default_factory=dict)
    # receivers and connectors: the tenants' limits and counters, one for the whole graph
    tenants: Tenants = field(default_factory=Tenants)

    def __post_init__(self) -> None:
        if self.log is None:
            self.log = structlog.get_logger().bind(component=self.id)


@dataclass(frozen=True)
class Factory:
    type: str
    kind: Kind
    config: builtins.type[msgspec.Struct]
    create: Callable[[Any, Context], Any]
    # receivers/processors/exporters: the signals they handle; connectors: signals consumed
    signals: tuple[Signal, ...]
    # connectors only: the signals they emit
    emits: tuple[Signal, ...] = ()
    # reads the records of a batch (spans, samples); False: only ``len`` and its OTLP
    # ``sources`` (the ``kafka`` exporter, ``memory_limiter``), so that a receiver whose
    # pipelines hold nothing else validates requests without building records
    records: bool = True


# the component types a config may name, by kind and type name (``pipeline.registry``)
Factories: TypeAlias = Mapping[Kind, Mapping[str, Factory]]


class Fanout:
    """Delivers one batch to several consumers of one pipeline.

    Exporters go first, together; connectors (e.g. the correlator) only once every exporter
    has stored the raw data. A connector that cannot take a batch for now (the correlator's
    output backed up) says so before anything is stored (``admit``), so that the batch is
    refused whole and its retry stores nothing twice; one that refuses for now all the same
    once the exporters have stored the batch is given it again here, with the delay it asks
    for (for up to ``THEN_RETRY_S``), not the exporters. Status is the worst of all:
    ``InvalidData`` over ``Retryable`` over success.
    """

    THEN_RETRY_S = 60.0

    def __init__(self, first: Sequence[Consumer], then: Sequence[Consumer] = ()) -> None:
        self.first = list(first)
        self.then = list(then)

    def __repr__(self) -> str:
        return f"<Fanout first={len(self.first)} then={len(self.then)}>"

    async def consume(self, batch: Batch) -> None:
        for c in self.then:
            admit = getattr(c, "admit", None)
            if admit is not None:
                admit()  # raises Retryable before the exporters store anything
        await self._all(self.first, batch)
        if not self.then:
            return
        give_up = time.monotonic() + self.THEN_RETRY_S
        todo = list(self.then)
        while True:
            results = await asyncio.gather(*(c.consume(batch) for c in todo),
                                           return_exceptions=True)
            if not any(isinstance(r, BaseException) for r in results):
                return
            if any(isinstance(r, BaseException) and not isinstance(r, Retryable)
                   for r in results):
                raise_worst(results)
            delay = max(r.retry_after for r in results if isinstance(r, Retryable))
            if time.monotonic() + delay > give_up:
                raise_worst(results)
            todo = [c for c, r in zip(todo, results, strict=True) if isinstance(r, Retryable)]
            await asyncio.sleep(delay)

    @staticmethod
    async def _all(group: Sequence[Consumer], batch: Batch) -> None:
        if len(group) == 1:
            await group[0].consume(batch)
        elif group:
            raise_worst(await asyncio.gather(*(c.consume(batch) for c in group),
                                             return_exceptions=True))


def raise_worst(results: Sequence[object]) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return
    for kind in (InvalidData, Retryable):
        for err in errors:
            if isinstance(err, kind):
                raise err
    raise errors[0]

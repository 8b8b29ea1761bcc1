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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import msgspec
import structlog

from pipeline.errors import InvalidData, PartlyStored, Retryable
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
    refused whole and its retry stores nothing twice.

    Once any consumer has taken the batch, an error is never handed back as one that the
    caller could retry (a client's resend, the intake's retry would store it again where
    it was taken): a consumer refusing for now is given the batch again alone, with the
    delay it asks for, for as long as that lasts (backpressure: the caller waits); one
    refusing for good makes it ``PartlyStored`` (logged), which callers take as final.
    Status when nothing was taken: the worst of all, ``InvalidData`` over ``Retryable``.
    """

    def __init__(self, first: Sequence[Consumer], then: Sequence[Consumer] = ()) -> None:
        self.first = list(first)
        self.then = list(then)
        self.log = structlog.get_logger().bind(component="fanout")

    def __repr__(self) -> str:
        return f"<Fanout first={len(self.first)} then={len(self.then)}>"

    async def consume(self, batch: Batch) -> None:
        for c in self.then:
            admit = getattr(c, "admit", None)
            if admit is not None:
                admit()  # raises Retryable before the exporters store anything
        await self._stage(self.first, batch, taken=False)
        if self.then:
            await self._stage(self.then, batch, taken=True)

    async def _stage(self, group: Sequence[Consumer], batch: Batch, taken: bool) -> None:
        """Deliver to each of ``group``; ``taken``: consumers before them have the batch."""
        todo = list(group)
        while True:
            if len(todo) == 1:
                try:
                    await todo[0].consume(batch)
                    return
                except Exception as err:
                    results: list[object] = [err]
            else:
                results = list(await asyncio.gather(*(c.consume(batch) for c in todo),
                                                    return_exceptions=True))
            failed = [(c, r) for c, r in zip(todo, results, strict=True)
                      if isinstance(r, BaseException)]
            if not failed:
                return
            taken = taken or len(failed) < len(todo)
            if not taken:
                raise_worst(results)  # nothing stored anywhere: the caller may retry
            retry = [r for _, r in failed if isinstance(r, Retryable)]
            if len(retry) < len(failed):
                worst = next(r for _, r in failed if not isinstance(r, Retryable))
                self.log.error("fanout_partly_stored", signal=batch.signal, items=len(batch),
                               error=f"{type(worst).__name__}: {str(worst)[:300]}",
                               refused_by=[type(c).__name__ for c, r in failed
                                           if not isinstance(r, Retryable)])
                raise PartlyStored(f"taken by some consumers, refused by another: "
                                   f"{worst}") from worst
            todo = [c for c, _ in failed]
            await asyncio.sleep(max(r.retry_after for r in retry))


def raise_worst(results: Sequence[object]) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return
    for kind in (InvalidData, Retryable):
        for err in errors:
            if isinstance(err, kind):
                raise err
    raise errors[0]

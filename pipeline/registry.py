"""Component type name -> factory.

Factories live in one explicit list (``FACTORIES`` below) so that ``spanprof validate`` can
name every valid type, and adding a component touches its own module plus one line here.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec
import structlog

from pipeline.component import Consumer
from pipeline.records import Signal

Kind = Literal["receiver", "processor", "exporter", "connector"]


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


def factories() -> dict[Kind, dict[str, Factory]]:
    """All known factories by kind and type name (imported lazily: keeps the CLI fast)."""
    from pipeline.exporters.clickhouse.exporter import FACTORY as clickhouse
    from pipeline.exporters.debug import FACTORY as debug
    from pipeline.exporters.kafka import FACTORY as kafka_exporter
    from pipeline.receivers.kafka import FACTORY as kafka_receiver
    from pipeline.receivers.otlp import FACTORY as otlp
    from pipeline.receivers.pyroscope import FACTORY as pyroscope
    from processors.batch import FACTORY as batch
    from processors.correlate.connector import FACTORY as spancorrelator
    from processors.memory_limiter import FACTORY as memory_limiter

    FACTORIES = [otlp, kafka_receiver, pyroscope, memory_limiter, batch, clickhouse, debug,
                 kafka_exporter, spancorrelator]
    out: dict[Kind, dict[str, Factory]] = {
        "receiver": {}, "processor": {}, "exporter": {}, "connector": {}
    }
    for f in FACTORIES:
        out[f.kind][f.type] = f
    return out

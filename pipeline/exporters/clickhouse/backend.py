"""What the ``clickhouse`` exporter needs of a ClickHouse client, and nothing more.

The exporter, its writer and the fault hook (``failpoints``) call four methods of a
clickhouse-connect client; typing them against this small interface instead of the whole
driver keeps the I/O swappable: ``exporter.connect`` returns the real client (the embedded
engine or a server, which mypy checks against this protocol there), unit tests give the
writer ``memory.MemoryClient`` and need neither an engine nor a server, and integration
tests keep the real engine (wrapped by ``memory.FaultyClient`` when they need it to fail).

The error contract is part of the interface even though a protocol cannot state it: an
implementation raises what clickhouse-connect raises (``faults.py`` classifies it), so
that the writer's failure handling is exercised the same way on a fake as on the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class QueryResult(Protocol):
    """The part of clickhouse-connect's ``QueryResult`` that is read."""

    @property
    def column_names(self) -> Sequence[str]: ...

    @property
    def result_rows(self) -> Sequence[Sequence[Any]]: ...


class ClickHouseClient(Protocol):
    """A synchronous ClickHouse client (its calls block: the exporter runs them in its one
    executor thread)."""

    def insert(self, table: str, data: Sequence[Sequence[Any]], *,
               column_names: Sequence[str], column_oriented: bool = False,
               settings: dict[str, Any] | None = None) -> object:
        """Insert one block into ``table`` (``database.table``): ``data`` is rows, or
        columns when ``column_oriented``. ``settings`` carries the
        ``insert_deduplication_token`` under which a repeated block is dropped."""

    def query(self, sql: str, /, parameters: dict[str, Any] | None = None) -> QueryResult:
        """Run a statement that returns rows (``%(name)s`` / ``{name:Type}`` parameters)."""

    def command(self, sql: str, /, parameters: dict[str, Any] | None = None) -> object:
        """Run a statement that returns no rows (DDL, ``OPTIMIZE``, ``DELETE``)."""

    def close(self) -> None:
        """Release the connection (the embedded engine: the data directory)."""

"""In-memory ClickHouse for unit tests, and failures on demand for any client.

``MemoryClient`` implements ``backend.ClickHouseClient`` in memory: it keeps each table's
rows column by column, and drops a block whose ``insert_deduplication_token`` the table
has already stored, or, without a token, a block with the very same rows, as the tables'
deduplication window does (``schema.DEDUP_SETTING``; checked against the engine in
``tests/pipeline/exporters/test_writer_faults.py``).
``FaultyClient`` wraps another client (the real engine, in integration tests). Both can be
told to fail (``Faults``):

* ``fail(error)``: calls raise ``error`` (for the next ``times`` calls, for ``seconds``, or
  until ``recover()``), before the block is stored, or after (``lands=True``: the server
  stored it but its answer was lost);
* ``refuse(error, table=, where=)``: an insert holding a row ``where`` picks is refused
  whole, permanently, as ClickHouse refuses a block for one bad value.

The errors to give them are built here the way the driver raises them (``refused``,
``reset``, ``server_error``), so that ``faults.py`` classifies a fake's failure exactly as
the real one's: a test of the writer on a fake still exercises the real classification.

Not imitated: SQL (``query`` answers what ``answers`` holds for the exact text, nothing
otherwise), column types (values are stored as given), and tables without a deduplication
window (``schema_migrations``: every table deduplicates here).
"""

from __future__ import annotations

import errno
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError
from urllib3 import HTTPConnectionPool
from urllib3.connection import HTTPConnection
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError

from pipeline.exporters.clickhouse.backend import ClickHouseClient, QueryResult

T = TypeVar("T")
Row = dict[str, Any]
TOKEN = "insert_deduplication_token"
# blocks remembered per table, as the tables' non_replicated_deduplication_window
DEDUP_WINDOW = 10_000


def server_error(code: int, name: str, text: str = "") -> DatabaseError:
    """An error the engine reports (chdb and HTTP alike): ``DatabaseError`` with the numeric
    ``code`` and the symbolic ``name``, e.g. ``(243, "NOT_ENOUGH_SPACE")``, or
    ``(321, "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE")`` for a value beyond its column."""
    return DatabaseError(f"Code: {code}. DB::Exception: {text}. ({name})", code=code, name=name)


def refused(host: str = "localhost", port: int = 8123) -> OperationalError:
    """A server that refuses the connection, as clickhouse-connect's HTTP client reports it:
    ``OperationalError`` from urllib3's ``MaxRetryError``, whose reason is the
    ``NewConnectionError`` raised from ``ConnectionRefusedError`` (nothing was sent)."""
    down = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    conn = NewConnectionError(HTTPConnection(host, port),
                              f"Failed to establish a new connection: {down}")
    conn.__cause__ = down
    err = OperationalError("Error executing HTTP request")
    err.__cause__ = MaxRetryError(HTTPConnectionPool(host, port), "/", conn)
    return err


def reset() -> OperationalError:
    """A connection lost mid-request (the server may have stored the block):
    ``OperationalError`` from urllib3's ``ProtocolError`` around ``ConnectionResetError``."""
    err = OperationalError("Error executing HTTP request")
    err.__cause__ = ProtocolError("Connection aborted.",
                                  ConnectionResetError(errno.ECONNRESET, "Connection reset"))
    return err


def columns_of(data: Sequence[Sequence[Any]], names: Sequence[str],
               column_oriented: bool) -> dict[str, list[Any]]:
    """An insert's block, column by column, whichever way ``data`` holds it."""
    if column_oriented:
        cols = {n: list(c) for n, c in zip(names, data, strict=True)}
    else:
        cols = {n: [row[i] for row in data] for i, n in enumerate(names)}
    lengths = {n: len(c) for n, c in cols.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"columns of different lengths: {lengths}")
    return cols


@dataclass(frozen=True)
class Refusal:
    """Inserts ``Faults.refuse`` refuses: into ``table``, holding a row ``where`` picks."""

    error: BaseException
    table: str | None  # None: any table
    where: Callable[[Row], bool] | None  # None: any row

    def applies(self, table: str, cols: dict[str, list[Any]]) -> bool:
        if self.table is not None and table != self.table:
            return False
        if self.where is None:
            return True
        names = list(cols)
        return any(self.where(dict(zip(names, values, strict=True)))
                   for values in zip(*cols.values(), strict=True))


class Faults:
    """Failures on demand around a client's calls (``insert``, ``query``, ``command``).

    Set from the test's event loop while the calls run in the exporter's executor thread:
    the state is read and consumed under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fault: BaseException | None = None
        self._lands = False
        self._times: int | None = None
        self._until: float | None = None
        self._refusals: list[Refusal] = []

    def fail(self, error: BaseException, *, lands: bool = False, times: int | None = None,
             seconds: float | None = None) -> None:
        """From now on, calls raise ``error``: for the next ``times`` calls, for ``seconds``,
        or until ``recover()``. With ``lands`` an insert stores its block first (a timeout
        after the server wrote it). Give an error the driver raises: ``refused()`` or
        ``server_error(243, "NOT_ENOUGH_SPACE")`` (nothing stored), ``reset()`` or a
        ``TimeoutError`` (maybe stored)."""
        with self._lock:
            self._fault, self._lands, self._times = error, lands, times
            self._until = None if seconds is None else time.monotonic() + seconds

    def recover(self) -> None:
        """Calls succeed again (refusals stay: they are about values)."""
        with self._lock:
            self._fault = None

    def refuse(self, error: BaseException | None = None, *, table: str | None = None,
               where: Callable[[Row], bool] | None = None) -> None:
        """Refuse, with ``error``, every insert into ``table`` (any table when None) that
        holds a row (a dict of column -> value; a column the block lacks is absent) for
        which ``where`` is true (any row when None). Nothing of a refused block is stored.
        The default error is the engine's for a value beyond its column (permanent)."""
        err = error if error is not None else server_error(
            321, "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE", "Value is out of range")
        self._refusals.append(Refusal(err, table, where))

    @property
    def failing(self) -> BaseException | None:
        """The error calls raise now, if any."""
        with self._lock:
            return self._current()

    def _current(self) -> BaseException | None:
        if self._until is not None and time.monotonic() >= self._until:
            self._fault = None
        return self._fault

    def _due(self) -> tuple[BaseException | None, bool]:
        """The error this call raises (consuming one of ``times``), and whether it lands."""
        with self._lock:
            fault = self._current()
            if fault is not None and self._times is not None:
                self._times -= 1
                if self._times <= 0:
                    self._fault = None
            return fault, self._lands

    def _call(self, run: Callable[[], T], table: str = "",
              cols: dict[str, list[Any]] | None = None) -> T:
        """``run()`` the call, or fail it as told (``cols``: an insert's block)."""
        fault, lands = self._due()
        if fault is not None and not lands:
            raise fault
        if cols is not None:
            for refusal in self._refusals:
                if refusal.applies(table, cols):
                    raise refusal.error
        out = run()
        if fault is not None:
            raise fault
        return out

    def _state(self) -> str:
        fault = self.failing
        return f" failing={type(fault).__name__}" if fault is not None else ""


class Insert(NamedTuple):
    """One insert call a ``MemoryClient`` received, and what became of it."""

    table: str
    rows: int
    token: str | None
    stored: bool  # False: failed before storing, refused, or a repeated token (dropped)
    error: BaseException | None  # what the caller got


@dataclass(frozen=True)
class MemoryResult:
    column_names: tuple[str, ...] = ()
    result_rows: list[tuple[Any, ...]] = field(default_factory=list)


class MemoryClient(Faults):
    """A ClickHouse in memory: tables column by column, blocks deduplicated per table by
    their token, and every insert call recorded (``inserts``)."""

    def __init__(self, dedup_window: int = DEDUP_WINDOW) -> None:
        super().__init__()
        self.dedup_window = dedup_window
        self.inserts: list[Insert] = []
        # every statement received, in order (failed ones too, as ``inserts``)
        self.commands: list[str] = []
        self.queries: list[tuple[str, dict[str, Any] | None]] = []
        # what ``query`` answers for exactly this SQL text: (column names, rows)
        self.answers: dict[str, tuple[Sequence[str], list[tuple[Any, ...]]]] = {}
        self.closed = False
        self._tables: dict[str, dict[str, list[Any]]] = {}
        self._counts: dict[str, int] = {}
        self._tokens: dict[str, OrderedDict[str, None]] = {}

    def __repr__(self) -> str:
        tables = " ".join(f"{t}={n}" for t, n in self._counts.items())
        return (f"<MemoryClient {tables or 'empty'} inserts={len(self.inserts)}"
                f"{self._state()}{' closed' if self.closed else ''}>")

    def insert(self, table: str, data: Sequence[Sequence[Any]], *,
               column_names: Sequence[str], column_oriented: bool = False,
               settings: dict[str, Any] | None = None) -> None:
        cols = columns_of(data, column_names, column_oriented)
        rows = len(next(iter(cols.values()), []))
        token = (settings or {}).get(TOKEN)
        stored = False

        def store() -> None:
            nonlocal stored
            # no token: the block's own contents name it (ClickHouse hashes its data)
            key = token if token is not None else f"rows:{list(cols.items())!r}"
            stored = self._store(table, cols, rows, key)

        try:
            self._call(store, table, cols)
        except BaseException as err:
            self.inserts.append(Insert(table, rows, token, stored, err))
            raise
        self.inserts.append(Insert(table, rows, token, stored, None))

    def _store(self, table: str, cols: dict[str, list[Any]], rows: int, key: str) -> bool:
        seen = self._tokens.setdefault(table, OrderedDict())
        if key in seen:
            return False  # ClickHouse acknowledges it and stores nothing
        seen[key] = None
        while len(seen) > self.dedup_window:
            seen.popitem(last=False)
        have = self._tables.setdefault(table, {})
        before = self._counts.get(table, 0)
        # a column missing on either side holds None (what ClickHouse's DEFAULT would fill)
        for name, values in cols.items():
            have.setdefault(name, [None] * before).extend(values)
        for name, values in have.items():
            if name not in cols:
                values.extend([None] * rows)
        self._counts[table] = before + rows
        return True

    def rows(self, table: str) -> list[tuple[Any, ...]]:
        """The rows stored in ``table``, in insert order, columns as ``columns`` orders
        them (first inserted first)."""
        return list(zip(*self._tables.get(table, {}).values(), strict=True))

    def columns(self, table: str) -> dict[str, list[Any]]:
        """The table as stored: column name -> values."""
        return {n: list(v) for n, v in self._tables.get(table, {}).items()}

    def succeeded(self) -> list[tuple[str, int]]:
        """(table, rows) of each insert that returned without an error, in order: stored,
        or dropped as a repeated token (which ClickHouse acknowledges just the same), so
        that a test sees every block a caller got through, not only the first copy."""
        return [(i.table, i.rows) for i in self.inserts if i.error is None]

    def query(self, sql: str, /, parameters: dict[str, Any] | None = None) -> QueryResult:
        self.queries.append((sql, parameters))
        names, rows = self.answers.get(sql, ((), []))
        return self._call(lambda: MemoryResult(tuple(names), list(rows)))

    def command(self, sql: str, /, parameters: dict[str, Any] | None = None) -> None:
        self.commands.append(sql)
        self._call(lambda: None)

    def close(self) -> None:
        self.closed = True


class FaultyClient(Faults):
    """Another client (the real engine) whose calls fail as told (``Faults``); what gets
    through is stored, and deduplicated, by that client."""

    def __init__(self, client: ClickHouseClient) -> None:
        super().__init__()
        self.client = client

    def __repr__(self) -> str:
        return f"<FaultyClient{self._state()} over {self.client!r}>"

    def insert(self, table: str, data: Sequence[Sequence[Any]], *,
               column_names: Sequence[str], column_oriented: bool = False,
               settings: dict[str, Any] | None = None) -> object:
        cols = columns_of(data, column_names, column_oriented) if self._refusals else None
        return self._call(lambda: self.client.insert(
            table, data, column_names=column_names, column_oriented=column_oriented,
            settings=settings), table, cols)

    def query(self, sql: str, /, parameters: dict[str, Any] | None = None) -> QueryResult:
        return self._call(lambda: self.client.query(sql, parameters=parameters))

    def command(self, sql: str, /, parameters: dict[str, Any] | None = None) -> object:
        return self._call(lambda: self.client.command(sql, parameters=parameters))

    def close(self) -> None:
        self.client.close()

"""ClickHouse writer failures: which errors are the rows' fault (classifier table, and what
the real engine raises), splitting a refused block on the in-memory client
(``memory.MemoryClient``), and the circuit breaker: refusing fast, /health's ``failed``, and
exactly-once after recovery."""

from __future__ import annotations

import asyncio
import errno
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import structlog
from clickhouse_connect.driver.exceptions import DatabaseError, DataError, OperationalError
from urllib3.exceptions import ProtocolError

from pipeline.errors import Retryable
from pipeline.exporters.clickhouse import faults
from pipeline.exporters.clickhouse.exporter import RetryConfig
from pipeline.exporters.clickhouse.memory import (
    MemoryClient,
    refused,
    reset,
    server_error,
)
from pipeline.exporters.clickhouse.rows import COLUMNS
from pipeline.exporters.clickhouse.schema import DEDUP_SETTING
from pipeline.exporters.clickhouse.writer import Writer
from tests.conftest import clickhouse


def _raised(err: BaseException, cause: BaseException) -> BaseException:
    """``err`` as raised ``from cause`` (with the chain Python builds)."""
    try:
        raise err from cause
    except BaseException as e:  # noqa: BLE001 - returned, not swallowed
        return e


def _during(err: BaseException, handled: BaseException) -> BaseException:
    """``err`` as raised inside ``except`` of ``handled`` (its ``__context__``)."""
    try:
        try:
            raise handled
        except BaseException:  # noqa: BLE001
            raise err  # noqa: B904 - the point is the implicit context
    except BaseException as e:  # noqa: BLE001
        return e


# (error, permanent, may have landed)
CASES: list[tuple[str, BaseException, bool, bool]] = [
    ("out of range", server_error(321, "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE"), True, False),
    ("type mismatch", server_error(53, "TYPE_MISMATCH"), True, False),
    ("parse", server_error(6, "CANNOT_PARSE_TEXT"), True, False),
    ("decimal overflow", server_error(407, "DECIMAL_OVERFLOW"), True, False),
    ("nested sizes", server_error(190, "SIZES_OF_ARRAYS_DONT_MATCH"), True, False),
    ("disk full", server_error(243, "NOT_ENOUGH_SPACE"), False, False),
    ("too many parts", server_error(252, "TOO_MANY_PARTS"), False, False),
    ("memory", server_error(241, "MEMORY_LIMIT_EXCEEDED"), False, False),
    ("write error", server_error(75, "CANNOT_WRITE_TO_FILE_DESCRIPTOR"), False, False),
    ("schema missing", server_error(60, "UNKNOWN_TABLE"), False, False),
    ("server timeout", server_error(159, "TIMEOUT_EXCEEDED"), False, True),
    ("keeper", server_error(999, "KEEPER_EXCEPTION"), False, True),
    ("a view failed", server_error(243, "NOT_ENOUGH_SPACE", "while pushing to view db.mv"),
     False, True),
    ("encoder overflow",
     _raised(DataError("Unable to create native array for column `cpu_ns`: error"),
             struct.error("argument out of range")), True, False),
    ("OverflowError", OverflowError("int too big to convert"), True, False),
    ("TypeError", TypeError("int() argument must be ... not 'NoneType'"), True, False),
    ("ValueError", ValueError("invalid literal for int()"), True, False),
    ("AttributeError", AttributeError("'int' object has no attribute 'encode'"), True, False),
    ("surrogate", UnicodeEncodeError("utf-8", "a\udcff", 1, 2, "surrogates not allowed"),
     True, False),
    ("connection refused", refused(), False, False),
    ("ConnectionRefusedError", ConnectionRefusedError(111, "refused"), False, False),
    ("OSError ECONNREFUSED", type("Down", (OSError,), {})(errno.ECONNREFUSED, "refused"),
     False, False),
    ("reset mid-request",
     _raised(OperationalError("Error executing HTTP request"),
             ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))),
     False, True),
    ("reset (the fake's)", reset(), False, True),
    ("socket timeout", TimeoutError("timed out"), False, True),
    # a network error raised while a ValueError was being handled is not the rows' fault
    ("raised during a ValueError", _during(OperationalError("connection reset"),
                                           ValueError("bad reply")), False, True),
    ("unknown", RuntimeError("something else"), False, True),
]


class TestClassifier:
    @pytest.mark.parametrize(("label", "err", "permanent", "landed"), CASES,
                             ids=[c[0] for c in CASES])
    def test_table(self, label: str, err: BaseException, permanent: bool,
                   landed: bool) -> None:
        """Values at fault are permanent; ClickHouse's state is retryable; only an attempt
        known to have stored nothing may be dropped and resent by the client."""
        assert faults.is_permanent(err) is permanent
        assert faults.may_have_landed(err) is landed

    def test_reason_names_the_cause(self) -> None:
        """The encoder's own message names only the column; the reason adds why."""
        err = CASES[13][1]
        assert faults.reason(err) == ("DataError: Unable to create native array for column "
                                      "`cpu_ns`: error (struct.error: argument out of range)")

    def test_what_the_embedded_engine_raises(self, tmp_path: Path) -> None:
        """The facts the classifier rests on, from the real client and engine: out-of-range
        values fail in the encoder (no code), a view's throwIf fails on the server with a
        code, and a view failing leaves the source block stored."""
        with clickhouse(tmp_path / "ch") as ch:
            ch.command("CREATE TABLE t (n UInt64, m DateTime, ts DateTime64(9), s String) "
                       "ENGINE = MergeTree ORDER BY n")
            good = {"n": 1, "m": 1_700_000_000, "ts": 1_700_000_000 * 10**9, "s": "x"}
            poison = {"n": 3 * (2**63 - 1), "m": 4_400_000_000, "ts": 2**63 + 1,
                      "s": "a\udcff"}
            for col, bad in poison.items():
                row = dict(good, **{col: bad})
                with pytest.raises(Exception) as info:  # noqa: PT011 - any type: classified
                    ch.insert("t", [[row[c]] for c in good], column_names=list(good),
                              column_oriented=True)
                assert faults.is_permanent(info.value), (col, info.value)
                assert not faults.may_have_landed(info.value)
                assert faults.server_code(info.value) is None
            ch.command("CREATE TABLE sink (n UInt64) ENGINE = MergeTree ORDER BY n")
            ch.command("CREATE MATERIALIZED VIEW mv TO sink AS SELECT throwIf(n = 13) AS n "
                       "FROM t")
            with pytest.raises(DatabaseError) as info:
                ch.insert("t", [[13], [0], [0], [""]], column_names=list(good),
                          column_oriented=True)
            assert faults.server_code(info.value) == 395 and faults.is_permanent(info.value)
            assert faults.may_have_landed(info.value)  # "while pushing to view"
            assert ch.query("SELECT count() FROM t WHERE n = 13").result_rows == [(1,)]


class TestMemoryClient:
    """The in-memory client the writer's unit tests run on, kept honest against the engine."""

    def test_deduplicates_as_the_engine_does(self, tmp_path: Path) -> None:
        """A block repeated under its token is dropped (whatever its rows), per table, and
        so is one repeated without a token (the same rows); the same token on another
        table is stored: on the engine as in memory."""
        mem = MemoryClient()
        blocks = [("t", [1], "k1"), ("t", [2], "k1"), ("u", [3], "k1"), ("t", [4], "k2"),
                  ("t", [5], None), ("t", [5], None), ("t", [5, 6], None)]
        with clickhouse(tmp_path / "ch") as ch:
            for table in ("t", "u"):
                ch.command(f"CREATE TABLE {table} (n UInt64) ENGINE = MergeTree ORDER BY n "
                           f"SETTINGS {DEDUP_SETTING}")
            for client in (ch, mem):
                for table, ns, tok in blocks:
                    client.insert(table, [ns], column_names=["n"], column_oriented=True,
                                  settings={"insert_deduplication_token": tok} if tok else {})
            for table in ("t", "u"):
                real = ch.query(f"SELECT n FROM {table} ORDER BY n").result_rows
                assert sorted(mem.rows(table)) == [tuple(r) for r in real]
        assert mem.rows("t") == [(1,), (4,), (5,), (5,), (6,)]
        assert [i.stored for i in mem.inserts] == [True, False, True, True, True, False, True]
        assert repr(mem) == "<MemoryClient t=5 u=1 inserts=7>"

    def test_fails_as_told_with_the_driver_s_errors(self) -> None:
        """``fail`` for a number of calls, after storing (``lands``) or not, and for a time;
        ``refuse`` for chosen rows only; each error classified as the real one is."""
        client = MemoryClient()
        client.fail(refused(), times=2)
        assert "failing=OperationalError" in repr(client)
        for _ in range(2):
            with pytest.raises(OperationalError) as info:
                client.insert("t", [[1]], column_names=["n"])
            assert not faults.is_permanent(info.value)
            assert not faults.may_have_landed(info.value)
        client.insert("t", [[1]], column_names=["n"])  # row-oriented: one row
        client.fail(reset(), lands=True)
        with pytest.raises(OperationalError) as info:
            client.insert("t", [[2], [3]], column_names=["n"])
        assert faults.may_have_landed(info.value) and not faults.is_permanent(info.value)
        client.fail(server_error(243, "NOT_ENOUGH_SPACE"), seconds=0.05)
        with pytest.raises(DatabaseError):
            client.command("OPTIMIZE TABLE t")
        time.sleep(0.06)
        assert client.failing is None
        client.refuse(table="t", where=lambda row: row["n"] > 100)
        with pytest.raises(DatabaseError) as info:
            client.insert("t", [[4, 101]], column_names=["n"], column_oriented=True)
        assert faults.is_permanent(info.value)
        client.insert("u", [[101]], column_names=["n"], column_oriented=True)
        assert client.rows("t") == [(1,), (2,), (3,)]
        assert [(i.stored, type(i.error).__name__) for i in client.inserts] == [
            (False, "OperationalError"), (False, "OperationalError"), (True, "NoneType"),
            (True, "OperationalError"), (False, "DatabaseError"), (True, "NoneType")]
        assert client.commands == ["OPTIMIZE TABLE t"]


def poisoned() -> MemoryClient:
    """The in-memory client refusing a block holding a span named ``poison`` (permanently,
    as the engine refuses a value beyond its column)."""
    client = MemoryClient()
    client.refuse(server_error(321, "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE"),
                  where=lambda row: row.get("SpanName") == "poison")
    return client


def spans(names: list[str]) -> dict[str, dict[str, list[object]]]:
    cols: dict[str, list[object]] = {c: [0] * len(names) for c in COLUMNS["otel_traces"]}
    cols["SpanName"] = list(names)
    cols["tenant"] = ["acme"] * len(names)
    return {"otel_traces": cols}


def writer(client: Any, metrics: dict[str, int] | None = None, **kw: Any) -> Writer:
    got = metrics if metrics is not None else {}
    opts: dict[str, Any] = dict(batch_rows=1000, flush_interval=0.02, max_pending_rows=10_000,
                                retry=RetryConfig(initial_interval=0.05, max_interval=0.2,
                                                  max_elapsed_time=2.0))
    opts.update(kw)
    return Writer(client=client, executor=ThreadPoolExecutor(1), database="db",
                  log=structlog.get_logger(), component="clickhouse",
                  metrics=lambda n, v: got.__setitem__(n, got.get(n, 0) + v), **opts)


class TestSplit:
    async def test_bad_rows_are_quarantined_and_the_rest_stored(self) -> None:
        """A block with two rows refused for their values: the eight others are stored,
        the two are in the quarantine with the reason, the row as JSON and its tenant, and
        the sender is acknowledged."""
        client, metrics = poisoned(), {}
        w = writer(client, metrics)
        w.start()
        names = [f"s{i}" for i in range(10)]
        names[3] = names[8] = "poison"
        await asyncio.wait_for(w.submit(spans(names), 10, set()), timeout=5)
        stored = client.rows("db.otel_traces")
        assert sorted(r[COLUMNS["otel_traces"].index("SpanName")] for r in stored) == \
            sorted(n for n in names if n != "poison")
        q = client.rows("db.quarantine")
        assert [r[:3] for r in q] == [("acme", "clickhouse", "otel_traces")] * 2
        assert all("VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE" in r[3] and '"SpanName":"poison"'
                   in r[4] for r in q)
        assert metrics["quarantined_rows.otel_traces"] == 2
        assert metrics["sent_rows.otel_traces"] == 8
        assert w.failing_for() is None
        await w.close()

    async def test_a_retried_split_stores_nothing_twice(self) -> None:
        """The same named block split twice (a Kafka block delivered again, in a new
        generation) uses the same sub-tokens: the server drops every second copy."""
        client = poisoned()
        w = writer(client)
        w.start()
        names = ["a", "poison", "b", "c", "d"]
        await asyncio.wait_for(w.submit(spans(names), 5, set(), token="blk"), timeout=5)
        w._inserted_tokens.clear()  # a restarted writer remembers nothing
        await asyncio.wait_for(w.submit(spans(names), 5, set(), token="blk"), timeout=5)
        assert len(client.rows("db.otel_traces")) == 4
        assert len(client.rows("db.quarantine")) == 1
        await w.close()

    @pytest.mark.parametrize("error", [
        server_error(53, "TYPE_MISMATCH"),
        # create_schema: false without migration 8: retrying would hold every client for
        # max_elapsed_time, then tell them to resend rows already stored
        server_error(60, "UNKNOWN_TABLE", "Table db.quarantine does not exist"),
    ])
    async def test_a_refused_quarantine_drops_and_counts(self, error: BaseException) -> None:
        """When the quarantine refuses the rows too, they are dropped, counted and logged;
        nothing wedges (well within max_elapsed_time) and the next batch goes in."""
        client, metrics = poisoned(), {}
        client.refuse(error, table="db.quarantine")
        w = writer(client, metrics)
        w.start()
        await asyncio.wait_for(w.submit(spans(["a", "poison"]), 2, set()), timeout=1)
        await asyncio.wait_for(w.submit(spans(["b"]), 1, set()), timeout=1)
        assert metrics["dropped_rows.otel_traces"] == 1
        assert len(client.rows("db.otel_traces")) == 2
        await w.close()


class TestFailingState:
    async def test_refuses_fast_and_fails_the_waiting_generation(self) -> None:
        """A disk-full error (the attempt stored nothing): the sender is told at once,
        new submissions are refused until the next attempt is due, and the first insert
        that succeeds ends the state."""
        client = poisoned()
        client.fail(server_error(243, "NOT_ENOUGH_SPACE"))
        w = writer(client, retry=RetryConfig(initial_interval=0.5, max_interval=1.0,
                                             max_elapsed_time=60.0))
        w.start()
        t0 = time.monotonic()
        with pytest.raises(Retryable, match="NOT_ENOUGH_SPACE"):
            await asyncio.wait_for(w.submit(spans(["a"]), 1, set()), timeout=5)
        with pytest.raises(Retryable, match="inserts are failing") as refused:
            await w.submit(spans(["b"]), 1, set())
        assert time.monotonic() - t0 < 0.3
        assert refused.value.retry_after >= 1.0
        assert w.failing_for() is not None and "NOT_ENOUGH_SPACE" in w.failing_for()[1]
        client.recover()
        await asyncio.sleep(0.6)  # the next attempt is due: let in again
        await asyncio.wait_for(w.submit(spans(["c"]), 1, set()), timeout=5)
        assert w.failing_for() is None
        assert len(client.rows("db.otel_traces")) == 1
        await w.close()

    async def test_an_attempt_that_may_have_landed_keeps_its_tokens(self) -> None:
        """A timeout after the server stored the block: the generation is retried under the
        same token (never dropped and resent), so it is stored once and its sender
        acknowledged once the server answers again; meanwhile newcomers are refused."""
        client = poisoned()
        client.fail(TimeoutError("read timed out"), lands=True)
        w = writer(client)
        w.start()
        first = asyncio.create_task(w.submit(spans(["a", "b"]), 2, set()))
        await asyncio.sleep(0.1)
        with pytest.raises(Retryable, match="inserts are failing"):
            await w.submit(spans(["c"]), 1, set())
        assert not first.done()
        client.recover()
        await asyncio.wait_for(first, timeout=5)
        assert len(client.rows("db.otel_traces")) == 2
        await w.close()

    async def test_close_is_bounded_by_max_elapsed_time(self) -> None:
        """Shutdown with a generation that can never be inserted (every attempt may have
        landed) ends after max_elapsed_time; its sender gets Retryable, not a success."""
        client = poisoned()
        client.fail(ConnectionResetError(104, "reset"), lands=True)
        w = writer(client, retry=RetryConfig(initial_interval=0.05, max_interval=0.1,
                                             max_elapsed_time=0.5))
        w.start()
        sender = asyncio.create_task(w.submit(spans(["a"]), 1, set()))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await asyncio.wait_for(w.close(), timeout=5)
        assert time.monotonic() - t0 < 2
        with pytest.raises(Retryable, match="clickhouse insert failed"):
            await sender

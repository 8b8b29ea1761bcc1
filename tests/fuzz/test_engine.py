"""The storable() checker against the real engine: what it accepts, ClickHouse stores.

Accepted fuzz outputs of every decoder are inserted through ``rows.py`` into the real
schema (materialized views included) on the embedded engine; and values the checker
refuses for their column type are refused by the engine too, so the checker is neither
looser nor an invention. The decoders' own bounds are checked against the checker's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis.errors import NonInteractiveExampleWarning

from pipeline.errors import InvalidData
from pipeline.exporters.clickhouse import rows
from pipeline.exporters.clickhouse.migrate import bootstrap, statements
from pipeline.exporters.clickhouse.schema import SchemaOptions
from pipeline.otlp import bounds
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.pyroscope import ingest, pprof
from pipeline.records import ProfileBatch, Sample, Stack
from tests.conftest import clickhouse
from tests.fuzz import storable as checker
from tests.fuzz import strategies as S
from tests.fuzz.test_decoders import SMALL

DB = SchemaOptions(database="fuzz")


@pytest.fixture(scope="module")
def ch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with clickhouse(tmp_path_factory.mktemp("ch") / "data") as client:
        for sql in bootstrap(DB):
            client.command(sql)
        for _, stmts in statements(DB):
            for sql in stmts:
                client.command(sql)
        yield client


def _insert(ch: Any, tables: dict[str, dict[str, list[object]]]) -> None:
    for table, cols in tables.items():
        names = list(cols)
        if cols and len(cols[names[0]]):
            ch.insert(f"{DB.database}.{table}", [cols[c] for c in names], column_names=names,
                      column_oriented=True)


def _examples(strategy: Any, n: int) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return [strategy.example() for _ in range(n)]


class TestCheckerMatchesEngine:
    def test_accepted_fuzz_outputs_insert(self, ch: Any) -> None:
        """Spans and samples the decoders accepted from hostile inputs insert cleanly into
        every table rows.py writes, views included."""
        # each example's rows, inserted at the end as one block per table (joined as the
        # exporter joins its batches): every row is in it, and one insert is much cheaper
        # than one per example
        each: list[dict[str, dict[str, list[object]]]] = []
        inserted = 0
        for req in _examples(S.trace_requests(tame=True), 30) + _examples(
                S.trace_requests(), 20):
            batch = decode_traces(req).batch
            assert checker.storable(batch) == []
            each.append(rows.traces(batch))
            inserted += len(batch)
        for req in _examples(S.profile_requests(tame=True), 30) + _examples(
                S.profile_requests(), 20):
            batch = decode_profiles(req).batch
            assert checker.storable(batch) == []
            each.append(rows.profiles(batch))
            inserted += len(batch)
        for p in _examples(S.pprofs(), 80):
            try:
                b = pprof.decode_pprof(p.SerializeToString(), "svc", 1 << 20, None, SMALL)
            except InvalidData:
                continue
            assert checker.storable(b) == []
            each.append(rows.profiles(b))
            inserted += len(b)
        for body in _examples(S.folded_texts(), 40) + [b"main;\xc3\xa9 3\nmain;x y 1"]:
            try:  # /ingest's folded text, detected: frames are any text the client sent
                b = ingest.decode_ingest({"name": "svc", "from": "1700000000"}, "", body,
                                         1 << 20, SMALL).batch
            except InvalidData:
                continue
            assert checker.storable(b) == []
            each.append(rows.profiles(b))
            inserted += len(b)
        assert inserted > 0
        joined: dict[str, dict[str, list[object]]] = {}
        for tables in each:
            rows.extend(joined, tables)
        try:
            _insert(ch, joined)
        except Exception:
            for tables in each:  # the first example the engine refuses, for the report
                _insert(ch, tables)
            raise

    @pytest.mark.parametrize("field, value", [
        ("pid", -1), ("pid", 2**32), ("count", 2**32), ("value", -1), ("value", 2**64),
        ("thread_id", 2**64), ("stack_id", -1),
    ])
    def test_what_the_checker_refuses_the_engine_refuses(self, ch: Any, field: str,
                                                         value: int) -> None:
        """Out-of-range integers: the checker says so, and the engine refuses the insert."""
        s = Sample(b"", b"", "svc", bounds.TIME_MAX_NS - 1, 1, "cpu", 1, 1, "cpu", "ns")
        setattr(s, field, value)
        batch = ProfileBatch([s], {1: Stack(1, ["f"], [""], [0])})
        if field == "stack_id":
            batch = ProfileBatch([s], {-1: Stack(-1, ["f"], [""], [0])})
        assert checker.storable(batch) != []
        with pytest.raises(Exception):  # noqa: B017 - the client's error types vary by cause
            _insert(ch, {"profile_samples": rows.profiles(batch)["profile_samples"]})

    def test_decoder_bounds_within_the_schema(self) -> None:
        """bounds.py (what decoders accept) fits what the checker derives from the DDL."""
        assert bounds.TIME_MAX_NS <= checker.DATETIME_NS[1]
        assert bounds.TIME_MIN_NS >= checker.DATETIME_NS[0]
        assert bounds.MAX_COUNT <= checker.INT_RANGES["UInt32"][1]
        assert bounds.MAX_REQUEST_VALUE <= checker.INT_RANGES["Int64"][1]
        types = checker.column_types()["profile_samples"]
        assert (types["count"], types["pid"], types["value"]) == ("UInt32", "UInt32", "UInt64")

    def test_last_accepted_instant_stores(self, ch: Any, tmp_path: Path) -> None:
        """The last nanosecond of the accepted time range goes into every time column."""
        s = Sample(b"", b"", "svc", bounds.TIME_MAX_NS - 1, 1, "cpu", bounds.MAX_SAMPLE_VALUE,
                   bounds.MAX_COUNT, "cpu", "ns", 2**64 - 1, "", "", 2**32 - 1)
        batch = ProfileBatch([s], {1: Stack(1, ["f"], [""], [-(2**63)])})
        assert checker.storable(batch) == []
        _insert(ch, rows.profiles(batch))

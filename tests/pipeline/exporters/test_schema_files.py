"""The schema's migrations as SQL files (``pipeline/exporters/clickhouse/migrations``): the
format schema.py reads them in, and the files refused for not following it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from pipeline.exporters.clickhouse.migrate import statements
from pipeline.exporters.clickhouse.schema import (
    MIGRATIONS,
    STACK_TTL_MARGIN_S,
    SchemaOptions,
    load_migrations,
    parse_migration,
)

PACKAGED = resources.files("pipeline.exporters.clickhouse") / "migrations"

EXAMPLE = """\
-- Migration 10: an example. Its header; a semicolon here splits nothing;

-- statement
-- why this table: dropped from the statement, kept in the file
CREATE TABLE IF NOT EXISTS {db}.example (
    time DateTime,                -- a comment in the statement stays; so does this ;
    n UInt64
) ENGINE = MergeTree
ORDER BY time
{ttl:time}
SETTINGS {dedup}

-- statement when ttl
ALTER TABLE {db}.example MODIFY TTL time + toIntervalSecond({stack_ttl_seconds})
"""


class TestMigrationFiles:
    def test_the_packaged_files_are_the_migrations_in_order(self) -> None:
        """One file per migration, versions 1..N in file-name order, each with statements."""
        names = sorted(f.name for f in PACKAGED.iterdir() if f.name.endswith(".sql"))
        assert len(names) == len(MIGRATIONS) >= 9
        assert [m.version for m in MIGRATIONS] == list(range(1, len(names) + 1))
        assert [f"{m.version:04d}_{m.name}.sql" for m in MIGRATIONS] == names
        assert all(m.statements for m in MIGRATIONS)

    def test_placeholders_markers_and_comments(self) -> None:
        """Placeholders are filled from the options; comments after a marker describe the
        statement and are not applied, comments inside it are; semicolons split nothing."""
        m = parse_migration("0010_example.sql", EXAMPLE)
        assert (m.version, m.name, len(m.statements)) == (10, "example", 2)
        create, alter = m.render(SchemaOptions(database="d", ttl_seconds=60))
        assert create == (
            "CREATE TABLE IF NOT EXISTS d.example (\n"
            "    time DateTime,                -- a comment in the statement stays; so does "
            "this ;\n"
            "    n UInt64\n"
            ") ENGINE = MergeTree\n"
            "ORDER BY time\n"
            "TTL toDateTime(time) + toIntervalSecond(60)\n"
            "SETTINGS non_replicated_deduplication_window = 10000")
        assert alter == (f"ALTER TABLE d.example MODIFY TTL time + "
                         f"toIntervalSecond({60 + STACK_TTL_MARGIN_S})")

    def test_without_a_ttl(self) -> None:
        """ttl 0: ``{ttl:COLUMN}`` renders as nothing (its line stays, empty) and a
        ``when ttl`` statement is left out."""
        (create,) = parse_migration("0010_example.sql", EXAMPLE).render(
            SchemaOptions(ttl_seconds=0))
        assert "ORDER BY time\n\nSETTINGS" in create
        assert " TTL " not in create

    def test_a_new_migration_is_a_new_file(self, tmp_path: Path) -> None:
        """A folder with the packaged files plus the next NNNN_*.sql has one migration
        more, applied last."""
        n = len(MIGRATIONS)
        for f in PACKAGED.iterdir():
            if f.name.endswith(".sql"):
                (tmp_path / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
        (tmp_path / f"{n + 1:04d}_example.sql").write_text(EXAMPLE, encoding="utf-8")
        (tmp_path / "README.md").write_text("not a migration", encoding="utf-8")
        found = load_migrations(tmp_path)
        assert [m.version for m in found] == list(range(1, n + 2))
        assert found[:n] == MIGRATIONS
        assert found[n].render(SchemaOptions())[0].startswith(
            "CREATE TABLE IF NOT EXISTS spanprof.example (")

    def test_other_braces_are_left_as_they_are(self) -> None:
        """Only ``{word}`` and ``{word:word}`` are placeholders: a JSON literal passes."""
        m = parse_migration("0010_json.sql", "-- statement\nSELECT '{\"a\": 1}' FROM {db}.t\n")
        assert m.render(SchemaOptions(database="d")) == ["SELECT '{\"a\": 1}' FROM d.t"]

    def test_a_statement_applied_while_a_table_lacks_a_column(self) -> None:
        """``-- statement when TABLE lacks COLUMN``: the step carries the condition the runner
        checks (on the local table for a cluster), and ``schema print`` shows it."""
        from pipeline.exporters.clickhouse.migrate import lacks_column, render
        from pipeline.exporters.clickhouse.schema import Lacks

        m = parse_migration("0010_example.sql", "-- statement when t lacks tenant\n"
                                                "-- why\nEXCHANGE TABLES {db}.t AND {db}.t__new\n"
                                                "-- statement\nDROP TABLE IF EXISTS {db}.t__new")
        (exchange, drop) = m.steps(SchemaOptions(database="d"))
        assert exchange == (["EXCHANGE TABLES d.t AND d.t__new"], Lacks("t", "tenant"))
        assert drop == (["DROP TABLE IF EXISTS d.t__new"], None)
        sql, params = lacks_column(SchemaOptions(database="d"), Lacks("t", "tenant"))
        assert "system.columns" in sql and params == {"db": "d", "table": "t",
                                                      "column": "tenant"}
        assert lacks_column(SchemaOptions(cluster="c"), Lacks("t", "x"))[1]["table"] == "t_local"
        printed = render(SchemaOptions())
        assert ("-- only while otel_traces has no column tenant\n"
                "EXCHANGE TABLES spanprof.otel_traces AND spanprof.otel_traces__new;") in printed

    def test_statements_follow_the_files(self) -> None:
        """``statements`` is each file's statements in order, without ``when ttl`` ones
        when rows are kept for ever."""
        o = SchemaOptions(ttl_seconds=0)
        assert [v for v, _ in statements(o)] == [m.version for m in MIGRATIONS]
        assert dict(statements(o))[7] == []
        assert len(dict(statements(SchemaOptions()))[7]) == 1


class TestRefused:
    @pytest.mark.parametrize(("name", "text", "message"), [
        ("10_example.sql", EXAMPLE, "expected a name like 0010_what_it_does.sql"),
        ("0010_example.sql", "CREATE TABLE x (a UInt8)\n-- statement\nSELECT 1",
         "0010_example.sql:1: SQL before the first '-- statement' line"),
        ("0010_example.sql", "-- only a header\n", "no '-- statement' line"),
        ("0010_example.sql", "-- statement\n-- a description only\n\n-- statement\nSELECT 1",
         "a '-- statement' with no SQL after it"),
        ("0010_example.sql", "-- statement\nSELECT 1\n-- statement if ttl\nSELECT 2",
         "0010_example.sql:3: expected '-- statement', '-- statement when ttl' or "
         "'-- statement when TABLE lacks COLUMN'"),
        ("0010_example.sql", "-- statement when cluster\nSELECT 1",
         "0010_example.sql:1: expected '-- statement', '-- statement when ttl' or "
         "'-- statement when TABLE lacks COLUMN'"),
        ("0010_example.sql", "-- statement when t lacks\nSELECT 1",
         "0010_example.sql:1: expected '-- statement', '-- statement when ttl' or "
         "'-- statement when TABLE lacks COLUMN'"),
        ("0010_example.sql", "-- statement\nSELECT 1\nFROM {database}.t",
         "0010_example.sql:3: unknown placeholder {database}"),
        ("0010_example.sql", "-- statement\nSELECT 1 FROM t\n{ttl}",
         "0010_example.sql:3: unknown placeholder {ttl}"),
        ("0010_example.sql", "-- statement\nSELECT 1 FROM {db:x}.t",
         "0010_example.sql:2: unknown placeholder {db:x}"),
    ])
    def test_malformed_file(self, name: str, text: str, message: str) -> None:
        """A file not in the format is refused with its name, the line, and what is wrong."""
        with pytest.raises(ValueError, match="migrations/") as err:
            parse_migration(name, text)
        assert message in str(err.value)

    @pytest.mark.parametrize("names", [
        ["0001_a.sql", "0003_c.sql"], ["0002_b.sql"], ["0001_a.sql", "0001_again.sql"]])
    def test_versions_with_a_gap_or_twice(self, tmp_path: Path, names: list[str]) -> None:
        """Versions run 1..N, each once: a gap or a repeat is refused, not skipped."""
        for name in names:
            (tmp_path / name).write_text("-- statement\nSELECT 1\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"migrations: versions .* expected 1\.\."):
            load_migrations(tmp_path)


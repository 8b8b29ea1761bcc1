"""``cluster:``: the DDL for a ClickHouse cluster (ON CLUSTER, Replicated* local tables,
Distributed tables under the plain names). No cluster can run here, so this checks the
statements themselves; the single-node DDL is what every other test applies."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pipeline.errors import ConfigError
from pipeline.exporters.clickhouse.exporter import Config
from pipeline.exporters.clickhouse.migrate import bootstrap, render, statements
from pipeline.exporters.clickhouse.schema import SchemaOptions

CLUSTER = SchemaOptions(cluster="prod")


def all_statements(o: SchemaOptions) -> list[str]:
    return [s for _, stmts in statements(o) for s in stmts]


class TestClusterSchema:
    def test_every_table_is_replicated_with_a_distributed_table_over_it(self) -> None:
        single = all_statements(SchemaOptions())
        tables = re.findall(r"CREATE TABLE IF NOT EXISTS spanprof\.(\w+) \(",
                            "\n".join(single))
        assert len(tables) >= 12
        clustered = "\n".join(all_statements(CLUSTER))
        for t in tables:
            local = re.search(rf"CREATE TABLE IF NOT EXISTS spanprof\.{t}_local ON CLUSTER prod "
                              rf"\(.*?ENGINE = Replicated\w*MergeTree\('/clickhouse/tables/"
                              rf"\{{shard\}}/spanprof/{t}_local', '\{{replica\}}'", clustered,
                              re.S)
            assert local, t
            assert f"CREATE TABLE IF NOT EXISTS spanprof.{t} ON CLUSTER prod AS " \
                   f"spanprof.{t}_local\nENGINE = Distributed(prod, spanprof, {t}_local, " \
                   in clustered, t
        assert "non_replicated_deduplication_window" not in clustered
        assert "replicated_deduplication_window = 10000" in clustered
        # engine arguments survive: ReplacingMergeTree(last_seen)
        assert re.search(r"ReplicatedReplacingMergeTree\('[^']+profile_stacks_local', "
                         r"'\{replica\}', last_seen\)", clustered)

    def test_trace_rows_share_a_shard(self) -> None:
        clustered = "\n".join(all_statements(CLUSTER))
        for t in ("otel_traces", "span_attribution", "span_functions", "span_stacks",
                  "profile_samples", "op_calls"):
            assert re.search(rf"Distributed\(prod, spanprof, {t}_local, "
                             rf"cityHash64\((TraceId|trace_id)\)\)", clustered), t

    def test_views_hang_off_local_tables_and_queries_read_distributed(self) -> None:
        clustered = all_statements(CLUSTER)
        mvs = [s for s in clustered if s.startswith("CREATE MATERIALIZED VIEW")]
        assert len(mvs) >= 6
        for mv in mvs:
            assert re.search(r"\nTO spanprof\.\w+_local AS", mv), mv
            assert re.findall(r"FROM spanprof\.(\w+)", mv)
            assert all(t.endswith("_local") for t in re.findall(r"FROM spanprof\.(\w+)", mv))
        views = [s for s in clustered if re.match(r"CREATE (OR REPLACE )?VIEW", s)]
        assert views and all(" ON CLUSTER prod AS" in v for v in views)
        assert all("GLOBAL LEFT JOIN" in v for v in views if "JOIN" in v)
        alters = [s for s in clustered if s.startswith("ALTER")]
        assert {re.match(r"ALTER TABLE spanprof\.(\w+) ", a).group(1)  # type: ignore[union-attr]
                for a in alters} >= {"profile_samples", "profile_samples_local"}
        # what only a MergeTree has goes to the local tables alone
        local_only = [a for a in alters if "MODIFY TTL" in a or "MODIFY SETTING" in a]
        assert any("profile_stacks_local" in a and "MODIFY TTL" in a for a in local_only)
        assert all(re.match(r"ALTER TABLE spanprof\.\w+_local ON CLUSTER", a)
                   for a in local_only), local_only

    def test_a_rebuilt_table_exchanges_its_local_tables(self) -> None:
        """Migration 11's rebuild on a cluster: the staging table is local + Distributed like
        any other; emptied and exchanged as local tables, after the Distributed table under
        the plain name is remade with the new columns (over NAME_local); copied once through
        the Distributed tables; dropped both; views dropped on every node."""
        from pipeline.exporters.clickhouse.migrate import plan

        steps = dict(plan(CLUSTER))[11]
        by_first = {s.sql[0].split(" ON CLUSTER")[0]: s for s in steps}
        exchange = next(s for s in steps if "EXCHANGE TABLES spanprof.otel_traces_local" in
                        s.sql[-1])
        assert exchange.lacks is not None and exchange.lacks.table == "otel_traces"
        assert exchange.sql == [
            "CREATE OR REPLACE TABLE spanprof.otel_traces ON CLUSTER prod AS "
            "spanprof.otel_traces__new_local\nENGINE = Distributed(prod, spanprof, "
            "otel_traces_local, cityHash64(TraceId))",
            "EXCHANGE TABLES spanprof.otel_traces_local AND spanprof.otel_traces__new_local "
            "ON CLUSTER prod"]
        assert by_first["TRUNCATE TABLE IF EXISTS spanprof.otel_traces__new_local"].sql == [
            "TRUNCATE TABLE IF EXISTS spanprof.otel_traces__new_local ON CLUSTER prod"]
        assert by_first["DROP TABLE IF EXISTS spanprof.otel_traces__new"].sql == [
            "DROP TABLE IF EXISTS spanprof.otel_traces__new ON CLUSTER prod",
            "DROP TABLE IF EXISTS spanprof.otel_traces__new_local ON CLUSTER prod"]
        assert by_first["DROP VIEW IF EXISTS spanprof.op_minute_mv"].sql == [
            "DROP VIEW IF EXISTS spanprof.op_minute_mv ON CLUSTER prod"]
        copy = next(s for s in steps if s.sql[0].startswith(
            "INSERT INTO spanprof.otel_traces__new "))
        assert len(copy.sql) == 1 and "FROM spanprof.otel_traces\n" in copy.sql[0] + "\n"
        assert re.search(r"CREATE TABLE IF NOT EXISTS spanprof\.profile_stacks__new_local ON "
                         r"CLUSTER prod \(.*ORDER BY \(tenant, stack_id\)", "\n".join(
                             sql for s in steps for sql in s.sql), re.S)

    def test_a_changed_ttl_alters_the_local_tables(self) -> None:
        from pipeline.exporters.clickhouse.migrate import ttl_changes

        now = {"otel_traces_local": "CREATE TABLE spanprof.otel_traces_local (...) ENGINE = "
                                    "ReplicatedReplacingMergeTree(...) ORDER BY (...) TTL "
                                    "toDateTime(Timestamp) + toIntervalSecond(604800)",
               "otel_traces": "CREATE TABLE spanprof.otel_traces (...) ENGINE = Distributed"}
        assert ttl_changes(SchemaOptions(cluster="prod", ttl_seconds=86400), now) == [
            "ALTER TABLE spanprof.otel_traces_local ON CLUSTER prod MODIFY TTL "
            "toDateTime(Timestamp) + toIntervalSecond(86400)"]
        assert ttl_changes(SchemaOptions(cluster="prod", ttl_seconds=0), now) == [
            "ALTER TABLE spanprof.otel_traces_local ON CLUSTER prod REMOVE TTL"]

    def test_single_node_ddl_is_unchanged_and_bootstrap_too(self) -> None:
        assert "ON CLUSTER" not in render(SchemaOptions())
        assert all("ON CLUSTER prod" in s for s in
                   render(CLUSTER).split(";\n") if s.strip().startswith(("CREATE", "ALTER")))
        assert bootstrap(SchemaOptions()) == bootstrap(CLUSTER)  # clusterized when applied

    def test_cli_prints_it_and_config_checks_it(self) -> None:
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "schema", "print",
                              "--cluster", "prod"], capture_output=True, text=True, check=True)
        assert "ENGINE = Distributed(prod, spanprof, otel_traces_local" in out.stdout
        with pytest.raises(ConfigError, match="cluster: needs a ClickHouse server"):
            Config(endpoint="chdb://./data", cluster="prod").validate()
        with pytest.raises(ConfigError, match="cluster: must be letters"):
            Config(endpoint="http://ch:8123", cluster="a-b").validate()
        Config(endpoint="http://ch:8123", cluster="prod").validate()

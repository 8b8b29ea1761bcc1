"""The schema on a ClickHouse cluster (``cluster:``), derived from the same statements as
the single-server one: ``on_cluster`` rewrites each statement a migration renders (and the
bootstrap's), so that a migration is written once, for one server, and the cluster form
follows from rules per kind of statement. A statement no rule covers is an error, not a
statement applied on one node only.
"""

from __future__ import annotations

import re

from pipeline.exporters.clickhouse.schema import MIGRATIONS, SchemaOptions

_CREATE_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+)\.(\w+) \(")
_ENGINE = re.compile(r"ENGINE = (\w*)MergeTree(\(([^)]*)\))?")
_CREATE_VIEW = re.compile(r"^CREATE (OR REPLACE VIEW|VIEW IF NOT EXISTS) (\w+)\.(\w+) AS")
_CREATE_MV = re.compile(r"^CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+)\.(\w+)\s+TO (\w+)\.(\w+)")
_ALTER = re.compile(r"^ALTER TABLE (\w+)\.(\w+)")
_DROP = re.compile(r"^DROP (TABLE|VIEW) IF EXISTS (\w+)\.(\w+)$")
_TRUNCATE = re.compile(r"^TRUNCATE TABLE IF EXISTS (\w+)\.(\w+)$")
_EXCHANGE = re.compile(r"^EXCHANGE TABLES (\w+)\.(\w+) AND (\w+)\.(\w+)$")
_INSERT = re.compile(r"^INSERT INTO (\w+)\.(\w+) ")


def _shard_key(ddl: str) -> str:
    """Rows of one trace on one shard (one-trace queries read one shard); others spread."""
    if re.search(r"^\s+TraceId String", ddl, re.M):
        return "cityHash64(TraceId)"
    if re.search(r"^\s+trace_id String", ddl, re.M):
        return "cityHash64(trace_id)"
    return "rand()"


def on_cluster(stmts: list[str], o: SchemaOptions) -> list[str]:
    """The same schema for a cluster: ``ON CLUSTER``, ``Replicated*MergeTree`` local tables
    (``NAME_local``, replicated through Keeper under /clickhouse/tables/{shard}/...), and a
    ``Distributed`` table under each plain name. Materialized views hang off the local
    tables (each node aggregates what it stores; queries re-aggregate across shards, which
    sums and uniqExact states allow); views read the Distributed tables, with GLOBAL joins.
    Inserts must be synchronous (``insert_distributed_sync``) for deduplication tokens to
    reach the shards: the exporter sets it when ``cluster`` is configured.

    A rebuild (``NAME__new``, see schema.py's docstring) exchanges the local tables; the
    Distributed table ``NAME`` is first remade with the new columns (over ``NAME_local``,
    which the exchange then makes the new table). Its copy goes through the Distributed
    tables, once, from the node the runner is connected to. The exchanged local table
    keeps the Keeper path it was created with (``.../NAME__new_local``). Not run on a
    real cluster here (no cluster in the tests): the statements are checked as text."""
    c = o.cluster
    out: list[str] = []
    for stmt in stmts:
        s = stmt.strip()
        if m := _CREATE_TABLE.match(s):
            db, name = m.groups()
            local = f"{name}_local"

            def engine(e: re.Match[str], db: str = db, local: str = local) -> str:
                args = e.group(3)
                path = f"'/clickhouse/tables/{{shard}}/{db}/{local}', '{{replica}}'"
                return f"ENGINE = Replicated{e.group(1)}MergeTree({path}" + \
                    (f", {args})" if args else ")")
            body = _ENGINE.sub(engine, s[m.end():], count=1).replace(
                "non_replicated_deduplication_window", "replicated_deduplication_window")
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{local} ON CLUSTER {c} (" + body)
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{name} ON CLUSTER {c} AS {db}.{local}\n"
                       f"ENGINE = Distributed({c}, {db}, {local}, {_shard_key(s)})")
        elif m := _CREATE_MV.match(s):
            db, name, tdb, target = m.groups()
            rest = re.sub(rf"\bFROM {db}\.(\w+)", rf"FROM {db}.\1_local", s[m.end():])
            out.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{name} ON CLUSTER {c}\n"
                       f"TO {tdb}.{target}_local{rest}")
        elif m := _CREATE_VIEW.match(s):
            kind, db, name = m.groups()
            body = s[m.end():].replace("LEFT JOIN (", "GLOBAL LEFT JOIN (")
            out.append(f"CREATE {kind} {db}.{name} ON CLUSTER {c} AS{body}")
        elif m := _ALTER.match(s):
            db, name = m.groups()
            rest = s[m.end():]
            # a MergeTree setting or TTL: the local tables only (a Distributed table has
            # neither, and refuses the ALTER)
            if "MODIFY SETTING" in rest or "MODIFY TTL" in rest:
                out.append(f"ALTER TABLE {db}.{name}_local ON CLUSTER {c}" + rest.replace(
                    "non_replicated_deduplication_window", "replicated_deduplication_window"))
                continue
            out.append(f"ALTER TABLE {db}.{name}_local ON CLUSTER {c}{rest}")
            out.append(f"ALTER TABLE {db}.{name} ON CLUSTER {c}{rest}")
        elif m := _DROP.match(s):
            kind, db, name = m.groups()
            out.append(f"DROP {kind} IF EXISTS {db}.{name} ON CLUSTER {c}")
            if kind == "TABLE":
                out.append(f"DROP TABLE IF EXISTS {db}.{name}_local ON CLUSTER {c}")
        elif m := _TRUNCATE.match(s):
            db, name = m.groups()
            out.append(f"TRUNCATE TABLE IF EXISTS {db}.{name}_local ON CLUSTER {c}")
        elif m := _EXCHANGE.match(s):
            db, name, db2, other = m.groups()
            out.append(f"CREATE OR REPLACE TABLE {db}.{name} ON CLUSTER {c} AS "
                       f"{db2}.{other}_local\nENGINE = Distributed({c}, {db}, {name}_local, "
                       f"{_SHARD_KEYS.get(name, 'rand()')})")
            out.append(f"EXCHANGE TABLES {db}.{name}_local AND {db2}.{other}_local "
                       f"ON CLUSTER {c}")
        elif _INSERT.match(s):
            out.append(s)  # through the Distributed tables, once
        elif s.startswith("CREATE DATABASE IF NOT EXISTS "):
            out.append(f"{s} ON CLUSTER {c}")
        else:
            raise ValueError(f"on_cluster: no rule for statement: {s[:80]}")
    return out


# each table's sharding key on a cluster, from the CREATE TABLE that made it
_SHARD_KEYS = {m[1]: _shard_key(s.sql) for migration in MIGRATIONS
               for s in migration.statements
               if (m := re.match(r"CREATE TABLE IF NOT EXISTS \{db\}\.(\w+) \(", s.sql))}

"""Bringing a database to the schema: what is applied on start, in order, for a
``SchemaOptions`` (the bootstrap, then each migration's steps, on a cluster as
``cluster.on_cluster`` derives them; the query a conditional step checks first; the ALTERs
that bring each table's TTL to the configured ``ttl``), and the same as the text
``spanprof schema print`` shows (``render``). The exporter runs them
(``exporter.py``); the statements themselves are the migration files (``schema.py``).
"""

from __future__ import annotations

import re

from pipeline.exporters.clickhouse.cluster import on_cluster
from pipeline.exporters.clickhouse.schema import (
    MIGRATIONS,
    Lacks,
    SchemaOptions,
    Step,
    stack_ttl_seconds,
    ttl_expr,
)

# the name a table is rebuilt under before it is exchanged with the table (schema.py's
# docstring)
REBUILT = "__new"
# a table's TTL column, as its CREATE TABLE template writes it
_TTL_OF = re.compile(r"CREATE TABLE IF NOT EXISTS \{db\}\.(\w+) \(.*?\{ttl:(\w+)\}", re.S)
_INTERVAL = re.compile(r"\bTTL\b.*?toIntervalSecond\((\d+)\)", re.S)


def ttl_plan(o: SchemaOptions) -> dict[str, tuple[str, int]]:
    """Per table: the column its TTL counts from and the seconds it should keep rows for
    (0: for ever), as the migrations would create it with these options today."""
    plan = {table.removesuffix(REBUILT): (column, o.ttl_seconds)
            for migration in MIGRATIONS for s in migration.statements
            for table, column in _TTL_OF.findall(s.sql)}
    plan["profile_stacks"] = ("last_seen", stack_ttl_seconds(o))  # migration 7
    return plan


def ttl_changes(o: SchemaOptions, current: dict[str, str]) -> list[str]:
    """The ALTERs that bring each table's TTL to what ``ttl`` says now, given each table's
    ``create_table_query`` (a ``ttl:`` changed after the tables were made takes effect
    without a manual ALTER; ClickHouse then applies it to the rows already there)."""
    out = []
    for table, (column, seconds) in sorted(ttl_plan(o).items()):
        name = f"{table}_local" if o.cluster else table
        ddl = current.get(name)
        if ddl is None:
            continue
        m = _INTERVAL.search(ddl)
        have = int(m[1]) if m else 0
        if have == seconds:
            continue
        where = f"{o.database}.{name}" + (f" ON CLUSTER {o.cluster}" if o.cluster else "")
        out.append(f"ALTER TABLE {where} REMOVE TTL" if seconds == 0 else
                   f"ALTER TABLE {where} MODIFY TTL {ttl_expr(column, seconds)}")
    return out


def bootstrap(o: SchemaOptions) -> list[str]:
    """The database and the record of applied migrations, created before anything else."""
    return [
        f"CREATE DATABASE IF NOT EXISTS {o.database}",
        f"""CREATE TABLE IF NOT EXISTS {o.database}.schema_migrations (
    version UInt32,
    applied_at DateTime DEFAULT now()
) ENGINE = MergeTree ORDER BY version""",
    ]


def plan(o: SchemaOptions) -> list[tuple[int, list[Step]]]:
    """Each migration's version and the steps it applies with these options (on a
    cluster, each step's statements are those ``on_cluster`` derives from it)."""
    if not o.cluster:
        return [(m.version, m.steps(o)) for m in MIGRATIONS]
    return [(m.version, [Step(on_cluster(step.sql, o), step.lacks) for step in m.steps(o)])
            for m in MIGRATIONS]


def statements(o: SchemaOptions) -> list[tuple[int, list[str]]]:
    """Each migration's version and the statements it applies with these options."""
    return [(version, [sql for step in steps for sql in step.sql])
            for version, steps in plan(o)]


def lacks_column(o: SchemaOptions, lacks: Lacks) -> tuple[str, dict[str, str]]:
    """The query (and its parameters) whose single value is 1 when a ``when TABLE lacks
    COLUMN`` statement is to be applied: the table (local table on a cluster) has no such
    column."""
    table = f"{lacks.table}_local" if o.cluster else lacks.table
    return ("SELECT count() = 0 FROM system.columns WHERE database = {db:String} "
            "AND table = {table:String} AND name = {column:String}",
            {"db": o.database, "table": table, "column": lacks.column})


def render(o: SchemaOptions) -> str:
    boot = on_cluster(bootstrap(o), o) if o.cluster else bootstrap(o)
    out = ["-- bootstrap"] + [s.strip() + ";\n" for s in boot]
    for version, steps in plan(o):
        out.append(f"-- migration {version}")
        for step in steps:
            when = (f"-- only while {step.lacks.table} has no column {step.lacks.column}\n"
                    if step.lacks else "")
            out.extend(when + s.strip() + ";\n" for s in step.sql)
    return "\n".join(out)

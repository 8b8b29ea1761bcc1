"""DDL is data: every table spanprof writes, kept in ``migrations/`` beside this module,
versioned, printed by ``spanprof schema print``. Each ordering key and codec says why in a
comment, in the SQL.

Migrations are applied in order on start; each statement is idempotent (``IF NOT EXISTS``)
and the applied version is recorded in ``schema_migrations``.

Migration files
---------------
``migrations/NNNN_name.sql`` is migration ``NNNN`` (versions run 1, 2, ... without a gap);
adding one is adding a file, read as package data. A file is its statements, each after a
line ``-- statement`` (a line, not ``;``, so that a semicolon in a comment or a string
cannot split one). Comment lines before the first marker describe the migration, and
comment lines right after a marker describe that statement: both stay in the file. The
rest, up to the next marker, is the statement as applied, its own comments included.

``-- statement when ttl`` renders that statement only when ``ttl_seconds > 0``.

``-- statement when TABLE lacks COLUMN`` is applied only while ``TABLE`` (on a cluster: its
local table) has no column ``COLUMN``: the runner asks ``system.columns`` just before the
statement. It is what makes a statement that is not idempotent by itself (``EXCHANGE
TABLES``, a copy) safe to apply again: a migration killed part-way is applied again whole
(its version is recorded only at the end), and such a statement must then do nothing once
what it did is done. ``spanprof schema print`` prints the condition as a comment above it.

In a statement, and nowhere else, these placeholders are replaced:

``{db}``                 the database
``{ttl:COLUMN}``         ``TTL toDateTime(COLUMN) + toIntervalSecond(ttl_seconds)``, or
                         nothing when rows are kept for ever (``ttl_seconds`` 0)
``{dedup}``              the deduplication window a retried insert is dropped within
``{stack_ttl_seconds}``  how long an unseen stack stays: ``ttl_seconds`` plus
                         ``STACK_TTL_MARGIN_S``
``{stack_ttl:COLUMN}``   ``TTL toDateTime(COLUMN) + toIntervalSecond(stack_ttl_seconds)``, or
                         nothing (``ttl_seconds`` 0)

Any other ``{word}`` or ``{word:word}`` is an error when the file is read; other braces
are left as they are. A file that does not parse stops the import of this module, so a
broken migration fails every test rather than a deployment.

Cluster schemas are derived from the same statements (``on_cluster``).

Rebuilding a table (a new ordering key: ClickHouse cannot change one in place) follows one
pattern, migration 11's: the new table is made under ``NAME__new``, emptied, filled from
``NAME``, and exchanged with it, each of those while ``NAME`` lacks the new column; then
``NAME__new`` (the old rows, by then) is dropped. ``ttl_plan`` reads ``NAME__new`` as
``NAME``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import NamedTuple


@dataclass(frozen=True)
class SchemaOptions:
    database: str = "spanprof"
    ttl_seconds: int = 7 * 86400  # 0 keeps data forever
    # a ClickHouse cluster (remote_servers): every table becomes a Replicated* table
    # ``NAME_local`` on each node plus a Distributed table ``NAME`` over them, so inserts
    # and queries keep using the plain names (see ``on_cluster``)
    cluster: str = ""


# profile_stacks outlives the samples by this much (clock skew, the writer's refresh)
STACK_TTL_MARGIN_S = 86_400

# a retried insert with the same insert_deduplication_token is a no-op within this window
# (``on_cluster`` turns it into the replicated setting)
DEDUP_SETTING = "non_replicated_deduplication_window = 10000"


def _ttl_expr(column: str, seconds: int) -> str:
    return f"toDateTime({column}) + toIntervalSecond({seconds})"


def _ttl(expr: str, o: SchemaOptions) -> str:
    if o.ttl_seconds <= 0:
        return ""
    return f"TTL {_ttl_expr(expr, o.ttl_seconds)}"


def _stack_ttl_seconds(o: SchemaOptions) -> int:
    return o.ttl_seconds + STACK_TTL_MARGIN_S if o.ttl_seconds > 0 else 0


# placeholder -> its text for these options and the placeholder's argument ('' if none)
_PLACEHOLDERS: dict[str, Callable[[SchemaOptions, str], str]] = {
    "db": lambda o, _: o.database,
    "ttl": lambda o, column: _ttl(column, o),
    "dedup": lambda o, _: DEDUP_SETTING,
    "stack_ttl_seconds": lambda o, _: str(_stack_ttl_seconds(o)),
    "stack_ttl": lambda o, column: (f"TTL {_ttl_expr(column, _stack_ttl_seconds(o))}"
                                    if o.ttl_seconds > 0 else ""),
}
_TAKES_ARGUMENT = {"ttl", "stack_ttl"}
# ``-- statement when NAME``: rendered only when NAME holds for the options
_CONDITIONS: dict[str, Callable[[SchemaOptions], bool]] = {
    "ttl": lambda o: o.ttl_seconds > 0,
}
_PLACEHOLDER = re.compile(r"\{(\w+)(?::(\w+))?\}")
_MARKER_LIKE = re.compile(r"--\s*statement\b")  # a line meant as a marker, well formed or not
_MARKER = re.compile(r"-- statement(?: when (\w+)(?: lacks (\w+))?)?")
_FILE_NAME = re.compile(r"(\d{4})_(\w+)\.sql")


class Lacks(NamedTuple):
    """``-- statement when TABLE lacks COLUMN``: applied only while the table (its local
    table on a cluster) has no such column; the runner checks before applying."""

    table: str
    column: str


class Step(NamedTuple):
    """A statement as the runner applies it: its SQL (one or more statements on a
    cluster) and the condition checked once before them, if any."""

    sql: list[str]
    lacks: Lacks | None = None


@dataclass(frozen=True)
class Statement:
    """One statement of a migration file, placeholders unfilled."""

    sql: str
    when: str | None = None  # a name in _CONDITIONS
    lacks: Lacks | None = None

    def render(self, o: SchemaOptions) -> str | None:
        if self.when is not None and not _CONDITIONS[self.when](o):
            return None
        return _PLACEHOLDER.sub(lambda m: _PLACEHOLDERS[m[1]](o, m[2] or ""), self.sql)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[Statement, ...]

    def __repr__(self) -> str:
        return f"<Migration {self.version} {self.name}: {len(self.statements)} statements>"

    def render(self, o: SchemaOptions) -> list[str]:
        """The statements to apply, in order, for these options."""
        return [step.sql[0] for step in self.steps(o)]

    def steps(self, o: SchemaOptions) -> list[Step]:
        """The statements to apply, in order, each with its condition on the database."""
        return [Step([sql], s.lacks) for s in self.statements
                if (sql := s.render(o)) is not None]


def parse_migration(file_name: str, text: str) -> Migration:
    """A migration file's statements (see the module's docstring); ValueError naming the
    file and line when it does not follow the format."""
    named = _FILE_NAME.fullmatch(file_name)
    if named is None:
        raise ValueError(f"migrations/{file_name}: expected a name like 0010_what_it_does.sql")
    chunks: list[tuple[str | None, Lacks | None, list[tuple[int, str]]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"migrations/{file_name}:{number}"
        if _MARKER_LIKE.match(line.strip()):
            marker = _MARKER.fullmatch(line.strip())
            if marker is None or (marker[1] is not None and marker[2] is None
                                  and marker[1] not in _CONDITIONS):
                raise ValueError(f"{where}: expected '-- statement', '-- statement when "
                                 f"{' | '.join(_CONDITIONS)}' or '-- statement when TABLE "
                                 f"lacks COLUMN', got {line.strip()!r}")
            if marker[2] is not None:
                chunks.append((None, Lacks(marker[1], marker[2]), []))
            else:
                chunks.append((marker[1], None, []))
        elif chunks:
            chunks[-1][2].append((number, line))
        elif line.strip() and not line.lstrip().startswith("--"):
            raise ValueError(f"{where}: SQL before the first '-- statement' line")
    statements = []
    for when, lacks, lines in chunks:
        while lines and (not lines[0][1].strip() or lines[0][1].lstrip().startswith("--")):
            lines.pop(0)  # the statement's description
        if not lines:
            raise ValueError(f"migrations/{file_name}: a '-- statement' with no SQL after it")
        for number, line in lines:
            for m in _PLACEHOLDER.finditer(line):
                if m[1] not in _PLACEHOLDERS or (m[2] is not None) != (m[1] in _TAKES_ARGUMENT):
                    known = ", ".join("{" + n + (":COLUMN" if n in _TAKES_ARGUMENT else "")
                                      + "}" for n in _PLACEHOLDERS)
                    raise ValueError(f"migrations/{file_name}:{number}: unknown placeholder "
                                     f"{m[0]} (known: {known})")
        statements.append(Statement("\n".join(line for _, line in lines).rstrip(), when,
                                    lacks))
    if not statements:
        raise ValueError(f"migrations/{file_name}: no '-- statement' line")
    return Migration(int(named[1]), named[2], tuple(statements))


def load_migrations(folder: Traversable) -> tuple[Migration, ...]:
    """Every ``*.sql`` file of ``folder``, in version order; versions must run 1..N."""
    found = sorted((parse_migration(f.name, f.read_text(encoding="utf-8"))
                    for f in folder.iterdir() if f.is_file() and f.name.endswith(".sql")),
                   key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise ValueError(f"migrations: versions {versions}, expected 1..{len(found)}, each once")
    return tuple(found)


MIGRATIONS = load_migrations(resources.files(__name__.rpartition(".")[0]) / "migrations")


# the name a table is rebuilt under before it is exchanged with the table (see the docstring)
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
    plan["profile_stacks"] = ("last_seen", _stack_ttl_seconds(o))  # migration 7
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
                   f"ALTER TABLE {where} MODIFY TTL {_ttl_expr(column, seconds)}")
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

    A rebuild (``NAME__new``, see the module's docstring) exchanges the local tables; the
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

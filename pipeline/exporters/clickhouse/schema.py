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

In a statement, and nowhere else, these placeholders are replaced:

``{db}``                 the database
``{ttl:COLUMN}``         ``TTL toDateTime(COLUMN) + toIntervalSecond(ttl_seconds)``, or
                         nothing when rows are kept for ever (``ttl_seconds`` 0)
``{dedup}``              the deduplication window a retried insert is dropped within
``{stack_ttl_seconds}``  how long an unseen stack stays: ``ttl_seconds`` plus
                         ``STACK_TTL_MARGIN_S``

Any other ``{word}`` or ``{word:word}`` is an error when the file is read; other braces
are left as they are. A file that does not parse stops the import of this module, so a
broken migration fails every test rather than a deployment.

Cluster schemas are derived from the same statements (``on_cluster``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable


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
}
_TAKES_ARGUMENT = {"ttl"}
# ``-- statement when NAME``: rendered only when NAME holds for the options
_CONDITIONS: dict[str, Callable[[SchemaOptions], bool]] = {
    "ttl": lambda o: o.ttl_seconds > 0,
}
_PLACEHOLDER = re.compile(r"\{(\w+)(?::(\w+))?\}")
_MARKER_LIKE = re.compile(r"--\s*statement\b")  # a line meant as a marker, well formed or not
_MARKER = re.compile(r"-- statement(?: when (\w+))?")
_FILE_NAME = re.compile(r"(\d{4})_(\w+)\.sql")


@dataclass(frozen=True)
class Statement:
    """One statement of a migration file, placeholders unfilled."""

    sql: str
    when: str | None = None  # a name in _CONDITIONS

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
        return [sql for s in self.statements if (sql := s.render(o)) is not None]


def parse_migration(file_name: str, text: str) -> Migration:
    """A migration file's statements (see the module's docstring); ValueError naming the
    file and line when it does not follow the format."""
    named = _FILE_NAME.fullmatch(file_name)
    if named is None:
        raise ValueError(f"migrations/{file_name}: expected a name like 0010_what_it_does.sql")
    chunks: list[tuple[str | None, list[tuple[int, str]]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"migrations/{file_name}:{number}"
        if _MARKER_LIKE.match(line.strip()):
            marker = _MARKER.fullmatch(line.strip())
            if marker is None or (marker[1] is not None and marker[1] not in _CONDITIONS):
                raise ValueError(f"{where}: expected '-- statement' or '-- statement when "
                                 f"{' | '.join(_CONDITIONS)}', got {line.strip()!r}")
            chunks.append((marker[1], []))
        elif chunks:
            chunks[-1][1].append((number, line))
        elif line.strip() and not line.lstrip().startswith("--"):
            raise ValueError(f"{where}: SQL before the first '-- statement' line")
    statements = []
    for when, lines in chunks:
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
        statements.append(Statement("\n".join(line for _, line in lines).rstrip(), when))
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


# a table's TTL column, as its CREATE TABLE template writes it
_TTL_OF = re.compile(r"CREATE TABLE IF NOT EXISTS \{db\}\.(\w+) \(.*?\{ttl:(\w+)\}", re.S)
_INTERVAL = re.compile(r"\bTTL\b.*?toIntervalSecond\((\d+)\)", re.S)


def ttl_plan(o: SchemaOptions) -> dict[str, tuple[str, int]]:
    """Per table: the column its TTL counts from and the seconds it should keep rows for
    (0: for ever), as the migrations would create it with these options today."""
    plan = {table: (column, o.ttl_seconds)
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


def statements(o: SchemaOptions) -> list[tuple[int, list[str]]]:
    """Each migration's version and the statements it applies with these options."""
    if o.cluster:
        return [(m.version, on_cluster(m.render(o), o)) for m in MIGRATIONS]
    return [(m.version, m.render(o)) for m in MIGRATIONS]


_CREATE_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+)\.(\w+) \(")
_ENGINE = re.compile(r"ENGINE = (\w*)MergeTree(\(([^)]*)\))?")
_CREATE_VIEW = re.compile(r"^CREATE (OR REPLACE VIEW|VIEW IF NOT EXISTS) (\w+)\.(\w+) AS")
_CREATE_MV = re.compile(r"^CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+)\.(\w+)\s+TO (\w+)\.(\w+)")
_ALTER = re.compile(r"^ALTER TABLE (\w+)\.(\w+)")


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
    reach the shards: the exporter sets it when ``cluster`` is configured."""
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
        elif s.startswith("CREATE DATABASE IF NOT EXISTS "):
            out.append(f"{s} ON CLUSTER {c}")
        else:
            raise ValueError(f"on_cluster: no rule for statement: {s[:80]}")
    return out


def render(o: SchemaOptions) -> str:
    boot = on_cluster(bootstrap(o), o) if o.cluster else bootstrap(o)
    out = ["-- bootstrap"] + [s.strip() + ";\n" for s in boot]
    for version, stmts in statements(o):
        out.append(f"-- migration {version}")
        out.extend(s.strip() + ";\n" for s in stmts)
    return "\n".join(out)

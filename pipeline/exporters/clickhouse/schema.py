"""DDL is data: every table spanprof writes, kept in ``migrations/`` beside this module,
versioned, printed by ``spanprof schema print``. Each ordering key and codec says why in a
comment, in the SQL. This module reads the files and renders their statements for a
``SchemaOptions``; ``migrate.py`` puts them in the order they are applied, and
``cluster.py`` derives a cluster's form of them.

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

Cluster schemas are derived from the same statements (``cluster.on_cluster``).

Rebuilding a table (a new ordering key: ClickHouse cannot change one in place) follows one
pattern, migration 11's: the new table is made under ``NAME__new``, emptied, filled from
``NAME``, and exchanged with it, each of those while ``NAME`` lacks the new column; then
``NAME__new`` (the old rows, by then) is dropped. ``migrate.ttl_plan`` reads ``NAME__new``
as ``NAME``.
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
    # and queries keep using the plain names (see ``cluster.on_cluster``)
    cluster: str = ""


# profile_stacks outlives the samples by this much (clock skew, the writer's refresh)
STACK_TTL_MARGIN_S = 86_400

# a retried insert with the same insert_deduplication_token is a no-op within this window
# (``cluster.on_cluster`` turns it into the replicated setting)
DEDUP_SETTING = "non_replicated_deduplication_window = 10000"


def ttl_expr(column: str, seconds: int) -> str:
    return f"toDateTime({column}) + toIntervalSecond({seconds})"


def _ttl(expr: str, o: SchemaOptions) -> str:
    if o.ttl_seconds <= 0:
        return ""
    return f"TTL {ttl_expr(expr, o.ttl_seconds)}"


def stack_ttl_seconds(o: SchemaOptions) -> int:
    return o.ttl_seconds + STACK_TTL_MARGIN_S if o.ttl_seconds > 0 else 0


# placeholder -> its text for these options and the placeholder's argument ('' if none)
_PLACEHOLDERS: dict[str, Callable[[SchemaOptions, str], str]] = {
    "db": lambda o, _: o.database,
    "ttl": lambda o, column: _ttl(column, o),
    "dedup": lambda o, _: DEDUP_SETTING,
    "stack_ttl_seconds": lambda o, _: str(stack_ttl_seconds(o)),
    "stack_ttl": lambda o, column: (f"TTL {ttl_expr(column, stack_ttl_seconds(o))}"
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

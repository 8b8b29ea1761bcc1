"""The Grafana dashboards under deploy/grafana/: their structure, and every SQL query in them
(panel targets and templating queries) run on the embedded ClickHouse with spanprof's
schema and a small known dataset, with the ClickHouse plugin's macros and the dashboard's
variables substituted as Grafana would. A query that does not run, or answers wrongly, fails
here rather than on someone's dashboard. The dataset has two tenants with the same trace,
span and stack ids: a query that reads any table without the `tenant` variable's filter
mixes them, and fails here too."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import Duration
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Span,
    SpanBatch,
    Stack,
    Unattributed,
)
from pipeline.registry import Context
from tests.conftest import ROOT, clickhouse
from tests.pipeline.test_flamegraph import children_value

GRAFANA = ROOT / "deploy" / "grafana"
PLUGIN = "grafana-clickhouse-datasource"
EXACT = ("link", "link+time")
MS = 1_000_000
SEC = 1_000_000_000


def dashboards() -> dict[str, dict[str, Any]]:
    files = sorted(GRAFANA.glob("*.json"))
    assert files, f"no dashboard under {GRAFANA}"
    return {f.name: json.loads(f.read_text()) for f in files}


def panels_of(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too (rows themselves excluded)."""
    out = []
    for p in dash.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def variable_sql(var: dict[str, Any]) -> str:
    """A query variable's SQL: the plugin takes a string or a query object with rawSql."""
    q = var.get("query")
    return q["rawSql"] if isinstance(q, dict) else str(q)


# -- macro and variable substitution -----------------------------------------------------


def _macro_args(sql: str, open_at: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the call whose '(' is at ``open_at`` (parentheses
    and quotes balanced), and the index just past its ')'."""
    depth, args, cur, i, quote = 0, [], "", open_at, ""
    while i < len(sql):
        c = sql[i]
        if quote:
            cur += c
            if c == quote:
                quote = ""
        elif c in "'\"`":
            quote = c
            cur += c
        elif c == "(":
            depth += 1
            if depth > 1:
                cur += c
        elif c == ")":
            depth -= 1
            if depth == 0:
                args.append(cur.strip())
                return args, i + 1
            cur += c
        elif c == "," and depth == 1:
            args.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    raise AssertionError(f"unbalanced macro call at {open_at}: {sql[open_at:open_at + 60]!r}")


def sql_string(value: str) -> str:
    """Grafana's ``sqlstring`` format: single quotes doubled, value quoted."""
    return "'" + value.replace("'", "''") + "'"


_FORMATS: dict[str, Callable[[str], str]] = {
    "raw": lambda v: v,
    "sqlstring": sql_string,
    "singlequote": lambda v: "'" + v.replace("'", "\\'") + "'",
    "doublequote": lambda v: '"' + v.replace('"', '\\"') + '"',
    "csv": lambda v: v,
}


def substitute(sql: str, *, from_s: int, to_s: int, interval_s: int,
               variables: dict[str, str]) -> str:
    """``sql`` as the ClickHouse plugin sends it: dashboard variables first (Grafana's
    template service, the plugin's default format leaving a single value as is), then the
    plugin's macros (pkg/macros: times are whole seconds, ``toDateTime(unix)``). Fails on
    any ``$`` or ``[[`` left over."""
    def var(name: str, fmt: str | None) -> str:
        assert name in variables, f"variable {name!r} has no value in the test"
        value = variables[name]
        assert fmt is None or fmt in _FORMATS, f"format {fmt!r} of ${{{name}}} not handled"
        return _FORMATS[fmt or "raw"](value)

    sql = re.sub(r"\$\{(\w+)(?::(\w+))?\}", lambda m: var(m.group(1), m.group(2)), sql)
    sql = re.sub(r"\[\[(\w+)(?::(\w+))?\]\]", lambda m: var(m.group(1), m.group(2)), sql)
    sql = re.sub(r"\$(?!__)(\w+)", lambda m: var(m.group(1), None), sql)

    def dt(s: int) -> str:
        return f"toDateTime({s})"

    def ms(s: int) -> str:
        return f"fromUnixTimestamp64Milli({s * 1000})"

    def date(s: int) -> str:
        return "toDate('" + time.strftime("%Y-%m-%d", time.gmtime(s)) + "')"

    with_args: dict[str, Callable[[list[str]], str]] = {
        "timeFilter": lambda a: f"{a[0]} >= {dt(from_s)} AND {a[0]} <= {dt(to_s)}",
        "timeFilter_ms": lambda a: f"{a[0]} >= {ms(from_s)} AND {a[0]} <= {ms(to_s)}",
        "dateFilter": lambda a: f"{a[0]} >= {date(from_s)} AND {a[0]} <= {date(to_s)}",
        "dateTimeFilter": lambda a: (f"({a[0]} >= {date(from_s)} AND {a[0]} <= {date(to_s)}) "
                                     f"AND ({a[1]} >= {dt(from_s)} AND {a[1]} <= {dt(to_s)})"),
        "timeInterval": lambda a: (f"toStartOfInterval(toDateTime({a[0]}), "
                                   f"INTERVAL {max(interval_s, 1)} second)"),
        "timeInterval_ms": lambda a: (f"toStartOfInterval(toDateTime64({a[0]}, 3), "
                                      f"INTERVAL {max(interval_s, 1) * 1000} millisecond)"),
        # single values only here: the condition always applies
        "conditionalAll": lambda a: a[0],
    }
    with_args["dt"] = with_args["dateTimeFilter"]
    bare = {"fromTime_ms": ms(from_s), "toTime_ms": ms(to_s), "fromTime": dt(from_s),
            "toTime": dt(to_s), "interval_s": str(max(interval_s, 1))}
    out, i = "", 0
    for m in re.finditer(r"\$__(\w+)", sql):
        if m.start() < i:
            continue  # inside a macro call already replaced
        name = m.group(1)
        out += sql[i:m.start()]
        if name in with_args and m.end() < len(sql) and sql[m.end()] == "(":
            args, i = _macro_args(sql, m.end())
            out += with_args[name](args)
        elif name in bare:
            out += bare[name]
            i = m.end()
        else:
            raise AssertionError(f"unknown macro $__{name}")
    out += sql[i:]
    assert "$" not in out and "[[" not in out, f"unsubstituted macro or variable:\n{out}"
    return out


class TestSubstitute:
    def test_macros_and_variables(self) -> None:
        got = substitute(
            "SELECT $__timeInterval(t) FROM x WHERE $__timeFilter(toDateTime(t)) AND "
            "s = ${service:sqlstring} AND o = '$operation' AND a >= $__fromTime_ms AND "
            "b <= $__toTime AND n = $__interval_s",
            from_s=100, to_s=200, interval_s=30, variables={"service": "a'b", "operation": "op"})
        assert got == (
            "SELECT toStartOfInterval(toDateTime(t), INTERVAL 30 second) FROM x WHERE "
            "toDateTime(t) >= toDateTime(100) AND toDateTime(t) <= toDateTime(200) AND "
            "s = 'a''b' AND o = 'op' AND a >= fromUnixTimestamp64Milli(100000) AND "
            "b <= toDateTime(200) AND n = 30")

    def test_leftover_fails(self) -> None:
        with pytest.raises(AssertionError, match="unknown macro"):
            substitute("SELECT $__nope", from_s=0, to_s=1, interval_s=1, variables={})
        with pytest.raises(AssertionError, match="has no value"):
            substitute("SELECT ${missing}", from_s=0, to_s=1, interval_s=1, variables={})


# -- structure ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_structure(name: str) -> None:
    dash = dashboards()[name]
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"] and len(dash["description"]) > 200
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == PLUGIN
    def uses_plugin(ref: Any) -> bool:
        return isinstance(ref, dict) and (ref.get("type") == PLUGIN
                                          or ref.get("uid") in ("${datasource}", "$datasource"))

    panels = panels_of(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    assert any(p["type"] == "flamegraph" for p in panels), "no flame graph panel"
    for p in panels:
        assert uses_plugin(p.get("datasource")), f"panel {p['title']!r}: datasource"
        assert p["targets"], p["title"]
        assert p.get("description"), f"panel {p['title']!r} has no description"
        for t in p["targets"]:
            assert uses_plugin(t.get("datasource")), f"{p['title']!r} target {t['refId']}"
            assert t["editorType"] == "sql" and t["rawSql"].strip()
            # sqlutil.FormatQueryOption: 0 time series, 1 table
            want = 0 if p["type"] == "timeseries" else 1
            assert t["format"] == want, f"{p['title']!r}: format {t['format']}"
            assert t["queryType"] == ("timeSeries" if want == 0 else "table")
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
    for v in variables.values():
        if v["type"] == "query":
            assert uses_plugin(v["datasource"]) and variable_sql(v).strip()
    # every variable a query or title names is defined
    text = json.dumps(dash)
    used = set(re.findall(r"\$\{(?!__)(\w+)(?::\w+)?\}", text)) | \
        set(re.findall(r"\$(?!__)([a-z]\w*)", text))
    assert used <= set(variables), f"undefined variables: {used - set(variables)}"


def test_trace_links_point_at_the_trace_dashboard() -> None:
    """Links name variables of their target, and carry those both dashboards have (the
    data source and the tenant: a trace opened under another tenant is another trace)."""
    dashes = dashboards()
    by_uid = {d["uid"]: d for d in dashes.values()}
    links = [(d, lk["url"]) for d in dashes.values() for p in panels_of(d)
             for o in p.get("fieldConfig", {}).get("overrides", [])
             for prop in o["properties"] if prop["id"] == "links" for lk in prop["value"]]
    assert links, "no data link"
    links += [(d, lk["url"]) for d in dashes.values() for lk in d.get("links", [])
              if lk["type"] == "link"]
    for source, url in links:
        m = re.match(r"^/d/([\w-]+)/[\w-]+\?(.*)$", url)
        assert m, url
        target = by_uid[m.group(1)]
        names = {v["name"] for v in target["templating"]["list"]}
        params = set(re.findall(r"var-(\w+)=", m.group(2))) | \
            set(re.findall(r"\$\{(\w+):queryparam\}", m.group(2)))
        for param in params:
            assert param in names, f"{url}: {param} is not a variable of {m.group(1)}"
        shared = names & {v["name"] for v in source["templating"]["list"]}
        assert shared <= params, f"{url}: does not carry {shared - params}"
    for d in dashes.values():  # links by tag carry the variables (the tenant) too
        assert all(lk["includeVars"] for lk in d.get("links", []) if lk["type"] == "dashboards")


# -- a known dataset in the embedded engine ----------------------------------------------

STACKS = {  # leaf first, as profile_stacks stores them
    101: ["json.dumps", "serialize", "handle_order", "main"],
    102: ["compute_price", "handle_order", "main"],
    103: ["handle_order", "main"],
    104: ["db.execute", "fetch_items", "list_items", "main"],
    105: ["json.dumps", "render", "list_items", "main"],
    106: ["reserve", "main"],
    107: ["psycopg.execute", "run_query", "main"],
}
STACKS_B = {  # the same stack ids in another tenant's program: other frames
    101: ["orjson.dumps", "encode", "create_invoice", "main"],
    102: ["tax_rate", "create_invoice", "main"],
    103: ["create_invoice", "main"],
    104: ["redis.get", "load_cart", "show_cart", "main"],
    105: ["orjson.dumps", "render", "show_cart", "main"],
    106: ["charge", "main"],
    107: ["redis.execute", "get", "main"],
}
ORDER_MULT = [1, 2, 3, 10]  # POST /order spans: CPU 42, 84, 126, 420 ms
ORDER_DURATION_MS = [100, 200, 300, 1000]
APPROX_CPU = 1000 * MS  # a `thread` row on the slowest span: never in exact figures
ORPHAN_CPU = 500 * MS  # a row of samples whose span never came: no operation
UNATTRIBUTED_CPU = 50 * MS


@dataclass(frozen=True)
class Tenant:
    """One tenant's share of the dataset. Both tenants get the same trace, span and stack
    ids (handed out in the same order) with other figures, frames, durations and names, so
    a query that reads any table without the tenant mixes them where it shows."""

    name: str
    stacks: dict[int, list[str]]
    cpu: int  # every CPU figure times this
    duration: int  # every span duration times this
    # spans start this much later, in the same second: the window of a trace
    # (otel_traces_trace_id_ts) holds both tenants' spans, only the tenant parts them
    shift_ms: int
    reserve_service: str  # the service of the `reserve` span
    child_name: str  # the name of GET /items' child span
    extra_order: bool  # one more POST /order call, ids of its own (5 calls, not 4)
    unstored: frozenset[int]  # stacks referenced but not in the tenant's profile_stacks


A = Tenant("acme", STACKS, 1, 1, 0, "inventory", "db.query", False, frozenset())
B = Tenant("globex", STACKS_B, 3, 2, 300, "payments", "cache.get", True,
           frozenset({103, 107}))  # another tenant's frames must not fill the gaps
NO_DATA = "default"  # the variable's default, a tenant with no row in this dataset
TENANTS = (A, B)


def order_stacks(m: int) -> dict[int, int]:
    return {101: 30 * MS * m, 102: 10 * MS * m, 103: 2 * MS * m}


@dataclass
class TenantData:
    spans: list[Span]
    order: list[Span]  # POST /order, in ORDER_MULT order (then B's extra call)
    items: list[tuple[Span, Span]]  # (GET /items, its child db.query / cache.get)
    exact_stacks: dict[str, dict[int, int]]  # operation -> stack -> exact CPU (checkout)


@dataclass
class Dataset:
    """Both tenants in database ``spanprof``; each alone in ``only_database(tenant)``."""

    path: Path
    now_s: int
    tenants: dict[str, TenantData]

    # tenant A's, which the figures of the tests per panel are about
    @property
    def order(self) -> list[Span]:
        return self.tenants[A.name].order

    @property
    def items(self) -> list[tuple[Span, Span]]:
        return self.tenants[A.name].items

    @property
    def exact_stacks(self) -> dict[str, dict[int, int]]:
        return self.tenants[A.name].exact_stacks


def only_database(tenant: str) -> str:
    return f"spanprof_only_{tenant}"


def _attr(t: Tenant, span: Span, method: str, source: int, stacks: dict[int, int],
          inclusive_extra: int = 0, known: bool = True) -> Attribution:
    stacks = {sid: ns * t.cpu for sid, ns in stacks.items()}
    cpu = sum(stacks.values())
    leaf: dict[str, int] = {}
    for sid, ns in stacks.items():
        leaf[t.stacks[sid][0]] = leaf.get(t.stacks[sid][0], 0) + ns
    return Attribution(
        span.trace_id, span.span_id, method, span.service, span.name if known else "",
        span.parent_span_id if known else b"", span.start_ns if known else 0,
        span.duration_ns if known else 0, known, cpu, 0, cpu // (10 * MS), leaf, {}, source,
        cpu + inclusive_extra * t.cpu, stacks, {})


def tenant_batches(t: Tenant, now_s: int
                   ) -> tuple[TenantData, SpanBatch, ProfileBatch, AttributionBatch]:
    base = (now_s - 30 * 60) * SEC + t.shift_ms * MS
    ids = iter(range(1, 1000))

    def span(service: str, name: str, start: int, dur_ms: int, trace: bytes | None = None,
             parent: bytes = b"") -> Span:
        n = next(ids)
        tid = trace or n.to_bytes(16, "big")
        return Span(tid, (n + 0x1000).to_bytes(8, "big"), parent, name, 2, service, start,
                    start + dur_ms * t.duration * MS)

    # spread over several minutes, so time buckets are really summed
    order = [span("checkout", "POST /order", base + i * 50 * SEC, d)
             for i, d in enumerate(ORDER_DURATION_MS)]
    items = []
    for i in range(2):
        root = span("checkout", "GET /items", base + (i * 70 + 10) * SEC, 50)
        child = span("checkout", t.child_name, root.start_ns + 5 * MS, 20, root.trace_id,
                     root.span_id)
        items.append((root, child))
    reserve = span(t.reserve_service, "reserve", base + 20 * SEC, 30)
    spans = order + [s for pair in items for s in pair] + [reserve]
    orphan = span("checkout", "lost", base, 10)

    src = iter(range(1, 1000))
    rows = [_attr(t, s, "link", next(src), {}) for s in spans]  # as the span itself writes
    for m, s in zip(ORDER_MULT, order, strict=True):
        st = order_stacks(m)
        if m == 10:  # two exact rows (link, link+time) that add up, and an approximate one
            rows.append(_attr(t, s, "link", next(src), {101: 200 * MS, 103: st[103]}))
            rows.append(_attr(t, s, "link+time", next(src), {101: 100 * MS, 102: st[102]}))
            rows.append(_attr(t, s, "thread", next(src), {102: APPROX_CPU}))
        else:
            rows.append(_attr(t, s, "link", next(src), st))
    for root, child in items:
        rows.append(_attr(t, root, "link", next(src), {104: 5 * MS, 105: 3 * MS}, 7 * MS))
        rows.append(_attr(t, child, "link+time", next(src), {107: 7 * MS}))
    rows.append(_attr(t, reserve, "link", next(src), {106: 4 * MS}))
    rows.append(_attr(t, orphan, "link", next(src), {101: ORPHAN_CPU}, known=False))
    if t.extra_order:  # after every shared id: the ids above stay the same in both tenants
        extra = span("checkout", "POST /order", base + 40 * SEC, 500)
        order.append(extra)
        spans.append(extra)
        rows.append(_attr(t, extra, "link", next(src), {}))
        rows.append(_attr(t, extra, "link", next(src), order_stacks(5)))
    unattributed = [Unattributed("checkout", base - base % (60 * SEC),
                                 UNATTRIBUTED_CPU * t.cpu, 0, 5, next(src))]

    stacks = {sid: Stack(sid, fns, ["app.py"] * len(fns), list(range(1, len(fns) + 1)))
              for sid, fns in t.stacks.items() if sid not in t.unstored}
    exact: dict[str, dict[int, int]] = {}
    for r in rows:
        if r.service == "checkout" and r.span_known and r.method in EXACT:
            op = exact.setdefault(r.name, {})
            for sid, ns in r.stack_cpu_ns.items():
                op[sid] = op.get(sid, 0) + ns
    return (TenantData(spans, order, items, exact), SpanBatch(spans, tenant=t.name),
            ProfileBatch([], stacks, tenant=t.name),
            AttributionBatch(rows, unattributed, tenant=t.name))


def build_dataset(path: Path) -> Dataset:
    now_s = int(time.time())
    built = {t.name: tenant_batches(t, now_s) for t in TENANTS}

    async def load(database: str, tenants: tuple[Tenant, ...]) -> None:
        cfg = Config(endpoint=f"chdb://{path}", database=database,
                     flush_interval=Duration(0.05), ttl=Duration(0))
        # an id per database: its own queue directory, never replayed into another
        ex = ClickHouseExporter(cfg, Context(f"clickhouse/{database}", ["traces"],
                                             data_dir=str(path)))
        await ex.start()
        try:
            for t in tenants:
                for batch in built[t.name][1:]:
                    await ex.consume(batch)
        finally:
            await ex.shutdown()

    loads = [("spanprof", TENANTS)] + [(only_database(t.name), (t,)) for t in TENANTS]
    for database, tenants in loads:
        asyncio.run(load(database, tenants))
    # the same stack written again by another process (a restart, a second worker): two
    # rows until profile_stacks (a ReplacingMergeTree) merges; a flame graph counts it once
    with clickhouse(path) as ch:
        for database, tenants in loads:
            for t in tenants:
                fns = t.stacks[101]
                ch.insert(f"{database}.profile_stacks",
                          [[t.name, 101, fns, ["app.py"] * 4, [1, 2, 3, 4]]],
                          column_names=["tenant", "stack_id", "functions", "files", "lines"])
                assert ch.query(f"SELECT count() FROM {database}.profile_stacks "
                                f"WHERE tenant = '{t.name}' AND stack_id = 101"
                                ).result_rows == [(2,)]
    return Dataset(path, now_s, {name: b[0] for name, b in built.items()})


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return build_dataset(tmp_path_factory.mktemp("grafana") / "ch")


@pytest.fixture(scope="module")
def ch(data: Dataset) -> Iterator[Any]:
    with clickhouse(data.path) as client:
        yield client


@dataclass
class Result:
    columns: list[str]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


class Runner:
    """Runs a dashboard's SQL as Grafana would: variables and macros substituted; the
    variable ``tenant`` is ``tenant`` unless ``variables`` name it. With ``database``, on
    that database's tables instead of ``spanprof``'s."""

    def __init__(self, ch: Any, data: Dataset, variables: dict[str, str],
                 tenant: str = A.name, database: str = "spanprof") -> None:
        self.ch, self.data, self.database = ch, data, database
        self.variables = {"tenant": tenant, **variables}
        self.ran: list[str] = []

    def run(self, sql: str, interval_s: int = 30) -> Result:
        text = substitute(sql, from_s=self.data.now_s - 3600, to_s=self.data.now_s + 60,
                          interval_s=interval_s, variables=self.variables)
        if self.database != "spanprof":
            text = re.sub(r"\bspanprof\.", f"{self.database}.", text)
        try:
            res = self.ch.query(text)
        except Exception as err:  # the query as sent, for whoever reads the failure
            raise AssertionError(f"query failed: {err}\n{text}") from err
        self.ran.append(sql)
        return Result(list(res.column_names), [tuple(r) for r in res.result_rows])


def panel(dash: dict[str, Any], title_start: str) -> dict[str, Any]:
    found = [p for p in panels_of(dash) if p["title"].startswith(title_start)]
    assert len(found) == 1, f"{title_start!r}: {[p['title'] for p in panels_of(dash)]}"
    return found[0]


def sql_of(p: dict[str, Any], ref: str = "A") -> str:
    return str(next(t["rawSql"] for t in p["targets"] if t["refId"] == ref))


def all_sql(dash: dict[str, Any]) -> list[str]:
    out = [t["rawSql"] for p in panels_of(dash) for t in p["targets"]]
    out += [variable_sql(v) for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def reference_nested_set(paths: dict[tuple[str, ...], int], root: str
                         ) -> list[tuple[int, int, int, str]]:
    """(level, value, self, label) depth first, children by name: computed in Python."""
    value: dict[tuple[str, ...], int] = {}
    self_: dict[tuple[str, ...], int] = {}
    for path, ns in paths.items():
        for d in range(len(path) + 1):
            value[path[:d]] = value.get(path[:d], 0) + ns
        self_[path] = self_.get(path, 0) + ns
    return [(len(p), value[p], self_.get(p, 0), p[-1] if p else root) for p in sorted(value)]


def check_nested_set(res: Result) -> list[tuple[int, int, int, str]]:
    """What Grafana's flame graph panel needs (FlameGraphDataContainer): fields level,
    value, self, label; rows depth first with a single root first; ``value`` inclusive."""
    assert res.columns == ["level", "value", "self", "label"]
    rows = [(int(lv), int(v), int(s), str(lb)) for lv, v, s, lb in res.rows]
    assert rows and rows[0][0] == 0, "the root must come first"
    assert [r[0] for r in rows].count(0) == 1, "a single root"
    for prev, cur in zip(rows, rows[1:], strict=False):
        assert 1 <= cur[0] <= prev[0] + 1, f"level jump {prev} -> {cur}"
    # inclusive: each frame is its self plus its children
    for i, (_, value, self_, _) in enumerate(rows):
        assert value >= self_
        children = children_value(rows, i)
        assert value == self_ + children, f"row {i} {rows[i]}: children add to {children}"
    return rows


VARS = {"service": "checkout", "operation": "POST /order"}  # tenant A's (Runner)


class TestMainDashboard:
    @pytest.fixture
    def dash(self) -> dict[str, Any]:
        return dashboards()["spanprof.json"]

    def test_variables(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        v = {x["name"]: x for x in dash["templating"]["list"]}
        r = Runner(ch, data, {})
        assert r.run(variable_sql(v["service"])).rows == [("checkout",), ("inventory",)]
        r = Runner(ch, data, {"service": "checkout"})
        assert r.run(variable_sql(v["operation"])).rows == \
            [("GET /items",), ("POST /order",), ("db.query",)]  # no "lost": span never came

    def test_cpu_per_operation_over_time(self, ch: Any, data: Dataset,
                                         dash: dict[str, Any]) -> None:
        p = panel(dash, "CPU per operation")
        r = Runner(ch, data, VARS)
        for interval_s, bucket_s in ((15, 60), (60, 60), (90, 120), (600, 600)):
            res = r.run(sql_of(p, "A"), interval_s)
            assert res.columns[:2] == ["time", "operation"]
            times = [row[0] for row in res.rows]
            assert times == sorted(times), "time series rows must be sorted by time"
            assert all(t.timestamp() % bucket_s == 0 for t in times)
            per_op: dict[str, float] = {}
            for _t, op, cores in res.rows:
                per_op[op] = per_op.get(op, 0.0) + cores * bucket_s * SEC
            want = {op: sum(st.values()) for op, st in data.exact_stacks.items()}
            assert want["POST /order"] == 672 * MS  # the approximate row left out
            assert per_op.keys() == want.keys()
            for op, ns in want.items():
                assert per_op[op] == pytest.approx(ns, rel=1e-9), op
            un = r.run(sql_of(p, "B"), interval_s)
            assert [row[1] for row in un.rows] == ["(unattributed)"]
            assert un.rows[0][2] * bucket_s * SEC == pytest.approx(UNATTRIBUTED_CPU)

    def test_operation_stat(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        res = Runner(ch, data, VARS).run(sql_of(panel(dash, "${operation}: CPU")))
        assert res.dicts() == [{"cpu": 672 * MS, "spans": 4, "cpu_per_call": 168 * MS}]

    def test_cpu_per_call_quantiles(self, ch: Any, data: Dataset,
                                    dash: dict[str, Any]) -> None:
        res = Runner(ch, data, VARS).run(sql_of(panel(dash, "CPU per call")))
        rows = {d["operation"]: d for d in res.dicts()}
        assert set(rows) == {"POST /order", "GET /items", "db.query"}

        def q(xs: list[int], p: float) -> float:  # linear interpolation (inclusive)
            xs = sorted(xs)
            pos = p * (len(xs) - 1)
            lo = math.floor(pos)
            return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)

        cpu = [42 * MS * m for m in ORDER_MULT]
        order = rows["POST /order"]
        assert order["calls"] == 4
        for p, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            assert order[f"cpu_{name}"] == pytest.approx(q(cpu, p))
            assert order[f"self_cpu_{name}"] == pytest.approx(q(cpu, p))
        assert order["cpu_p50"] == pytest.approx(105 * MS)
        assert order["duration_p99"] == pytest.approx(q([d * MS for d in ORDER_DURATION_MS],
                                                        0.99))
        items = rows["GET /items"]  # inclusive CPU counts the db.query child
        assert (items["calls"], items["cpu_p50"], items["self_cpu_p50"]) == (2, 15 * MS, 8 * MS)
        assert rows["db.query"]["cpu_p99"] == pytest.approx(7 * MS)
        assert res.rows[0][0] == "POST /order"  # most expensive calls first

    def test_top_functions(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        res = Runner(ch, data, VARS).run(sql_of(panel(dash, "Top functions")))
        got = res.dicts()
        assert got[0]["function"] == "json.dumps" and got[0]["self_cpu"] == 480 * MS
        assert [(d["function"], d["self_cpu"]) for d in got] == [
            ("json.dumps", 480 * MS), ("compute_price", 160 * MS), ("handle_order", 32 * MS)]
        assert got[0]["share"] == pytest.approx(480 / 672)
        assert got[0]["per_call"] == pytest.approx(120 * MS)
        assert sum(d["share"] for d in got) == pytest.approx(1.0)

    def test_flame_graph(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        p = panel(dash, "Flame graph")
        assert p["type"] == "flamegraph"
        rows = check_nested_set(Runner(ch, data, VARS).run(sql_of(p)))
        total = sum(data.exact_stacks["POST /order"].values())
        assert rows[0] == (0, total, 0, "total") and total == 672 * MS
        dumps = [r for r in rows if r[3] == "json.dumps"]
        assert dumps == [(4, 480 * MS, 480 * MS, "json.dumps")]
        want = reference_nested_set(
            {tuple(reversed(STACKS[s])): ns for s, ns in data.exact_stacks["POST /order"].items()},
            "total")
        assert rows == want
        # another operation: its own stacks only (json.dumps under render, 3 ms a call)
        rows = check_nested_set(Runner(ch, data, dict(VARS, operation="GET /items")).run(sql_of(p)))
        assert rows[0][1] == 16 * MS
        assert [r for r in rows if r[3] == "json.dumps"] == [(4, 6 * MS, 6 * MS, "json.dumps")]

    def test_slowest_spans(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        res = Runner(ch, data, VARS).run(sql_of(panel(dash, "Slowest spans")))
        got = res.dicts()
        assert len(got) == 8  # checkout's spans; the orphan row has no span
        assert [d["duration"] for d in got] == sorted((d["duration"] for d in got), reverse=True)
        slow, span = got[0], data.order[3]
        assert (slow["trace_id"], slow["span_id"]) == (span.trace_id.hex(), span.span_id.hex())
        assert slow["operation"] == "POST /order" and slow["duration"] == 1000 * MS
        assert (slow["self_cpu"], slow["inclusive_cpu"], slow["off_cpu"]) == \
            (420 * MS, 420 * MS, 580 * MS)
        assert slow["samples"] == 42 and slow["top_function"] == "json.dumps"
        assert slow["top_function_cpu"] == 300 * MS
        root = next(d for d in got if d["span_id"] == data.items[0][0].span_id.hex())
        assert (root["self_cpu"], root["inclusive_cpu"], root["off_cpu"]) == \
            (8 * MS, 15 * MS, 35 * MS)

    def test_every_query_runs(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        r = Runner(ch, data, VARS)
        for sql in all_sql(dash):
            r.run(sql)
        assert len(r.ran) == len(all_sql(dash)) >= 8


class TestTraceDashboard:
    @pytest.fixture
    def dash(self) -> dict[str, Any]:
        return dashboards()["spanprof-trace.json"]

    def test_spans(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        root, child = data.items[0]
        r = Runner(ch, data, {"trace_id": root.trace_id.hex()})
        got = r.run(sql_of(panel(dash, "Spans of trace"))).dicts()
        assert [(d["span_id"], d["operation"], d["start_offset"]) for d in got] == \
            [(root.span_id.hex(), "GET /items", 0), (child.span_id.hex(), "db.query", 5 * MS)]
        assert (got[0]["self_cpu"], got[0]["inclusive_cpu"], got[0]["off_cpu"]) == \
            (8 * MS, 15 * MS, 35 * MS)
        assert (got[1]["self_cpu"], got[1]["off_cpu"], got[1]["top_function"]) == \
            (7 * MS, 13 * MS, "psycopg.execute")
        assert got[1]["parent_span_id"] == root.span_id.hex()
        slow = data.order[3]
        got = Runner(ch, data, {"trace_id": slow.trace_id.hex()}).run(
            sql_of(panel(dash, "Spans of trace"))).dicts()
        assert [(d["self_cpu"], d["approximate_cpu"], d["samples"]) for d in got] == \
            [(420 * MS, APPROX_CPU, 42)]

    def test_flame_graph(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        root, _child = data.items[0]
        p = panel(dash, "Flame graph")
        rows = check_nested_set(Runner(ch, data, {"trace_id": root.trace_id.hex()}).run(
            sql_of(p)))
        assert rows[0] == (0, 15 * MS, 0, "trace")
        assert [r for r in rows if r[0] == 1] == [
            (1, 8 * MS, 0, "checkout: GET /items"), (1, 7 * MS, 0, "checkout: db.query")]
        want = {("checkout: GET /items", *reversed(STACKS[104])): 5 * MS,
                ("checkout: GET /items", *reversed(STACKS[105])): 3 * MS,
                ("checkout: db.query", *reversed(STACKS[107])): 7 * MS}
        assert rows == reference_nested_set(want, "trace")

    def test_functions(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        slow = data.order[3]
        got = Runner(ch, data, {"trace_id": slow.trace_id.hex()}).run(
            sql_of(panel(dash, "Functions of trace"))).rows
        assert got == [("json.dumps", 300 * MS, 1), ("compute_price", 100 * MS, 1),
                       ("handle_order", 20 * MS, 1)]

    def test_every_query_runs(self, ch: Any, data: Dataset, dash: dict[str, Any]) -> None:
        r = Runner(ch, data, {"trace_id": data.order[0].trace_id.hex()})
        for sql in all_sql(dash):
            r.run(sql)
        assert len(r.ran) == len(all_sql(dash)) >= 3


def test_every_dashboard_query_is_exercised(ch: Any, data: Dataset) -> None:
    """A dashboard added under deploy/grafana/ runs too, with the variables known here."""
    values = dict(VARS, tenant=A.name, trace_id=data.order[0].trace_id.hex())
    for name, dash in dashboards().items():
        names = {v["name"] for v in dash["templating"]["list"]} - {"datasource"}
        r = Runner(ch, data, {k: values[k] for k in names})
        for sql in all_sql(dash):
            r.run(sql)
        assert r.ran, name


# -- tenants -------------------------------------------------------------------------------

TENANT_FILTER = "tenant = ${tenant:sqlstring}"
# a filter that only narrows where another read looks (the time window of a trace, taken
# from otel_traces_trace_id_ts for the otel_traces read, itself filtered by tenant): without
# it the read costs more, its answer is the same, so no dataset can tell it was removed
NARROWING_ONLY = {"otel_traces_trace_id_ts"}
# per dashboard, the variable sets every query is run with: between them, each query's
# every tenant filter shows in an answer (both operations: GET /items' child differs)
VARIABLE_SETS: dict[str, Callable[[Dataset], list[dict[str, str]]]] = {
    "spanprof.json": lambda d: [VARS, dict(VARS, operation="GET /items")],
    "spanprof-trace.json": lambda d: [{"trace_id": d.order[3].trace_id.hex()},
                                      {"trace_id": d.items[0][0].trace_id.hex()}],
}


def tenant_variable(dash: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in dash["templating"]["list"] if v["name"] == "tenant")


def tenant_queries(dash: dict[str, Any]) -> list[str]:
    """Every query of the dashboard but the one listing the tenants."""
    listing = variable_sql(tenant_variable(dash))
    return [sql for sql in all_sql(dash) if sql != listing]


def answers(ch: Any, data: Dataset, name: str, sql: str, tenant: str,
            database: str = "spanprof") -> list[Result]:
    return [Runner(ch, data, variables, tenant, database).run(sql)
            for variables in VARIABLE_SETS[name](data)]


def blank(value: Any) -> bool:
    return value in (0, "", None) or (isinstance(value, float) and math.isnan(value))


class TestTenants:
    """Two tenants with the same trace, span and stack ids and other figures, frames and
    names: every panel of a tenant is what that tenant's data alone gives."""

    @pytest.fixture(params=sorted(VARIABLE_SETS))
    def name(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    def test_every_dashboard_is_covered(self) -> None:
        """A dashboard added under deploy/grafana/ needs its variable sets here."""
        assert set(VARIABLE_SETS) == set(dashboards())

    def test_tenant_variable(self, ch: Any, data: Dataset, name: str) -> None:
        """First after the data source, one value, `default` unless chosen; lists the
        tenants of the range, and the variables after it read only its tenant's rows."""
        dash = dashboards()[name]
        listed = [v["name"] for v in dash["templating"]["list"]]
        assert listed[:2] == ["datasource", "tenant"]
        var = tenant_variable(dash)
        assert var["type"] == "query" and not var["multi"] and not var["includeAll"]
        assert var["current"]["value"] == "default" and var["refresh"] == 2
        assert Runner(ch, data, {}).run(variable_sql(var)).rows == [(A.name,), (B.name,)]
        for v in dash["templating"]["list"][2:]:
            if v["type"] == "query":
                assert TENANT_FILTER in variable_sql(v), v["name"]

    def test_every_table_read_is_filtered(self, name: str) -> None:
        """Each table or view a query names, in subqueries and joins too, is followed by
        the tenant filter before the next one is named."""
        for sql in tenant_queries(dashboards()[name]):
            reads = list(re.finditer(r"\bspanprof\.(\w+)", sql))
            assert reads, sql
            for read, after in zip(reads, [*reads[1:], None], strict=True):
                part = sql[read.end():after.start() if after else len(sql)]
                assert TENANT_FILTER in part, f"{read.group(1)} read without tenant:\n{sql}"

    def test_each_tenant_sees_its_own_data_only(self, ch: Any, data: Dataset,
                                                name: str) -> None:
        """Every query answers for a tenant what the same query answers on a database
        holding that tenant's data only, and the two tenants' answers differ (or the
        comparison would prove nothing)."""
        for sql in tenant_queries(dashboards()[name]):
            got = {t.name: answers(ch, data, name, sql, t.name) for t in TENANTS}
            for t in TENANTS:
                alone = answers(ch, data, name, sql, t.name, only_database(t.name))
                assert got[t.name] == alone, f"tenant {t.name} sees other rows:\n{sql}"
            assert got[A.name] != got[B.name], f"the tenants look alike to:\n{sql}"

    def test_a_tenant_without_data_sees_nothing(self, ch: Any, data: Dataset,
                                                name: str) -> None:
        for sql in tenant_queries(dashboards()[name]):
            for res in answers(ch, data, name, sql, NO_DATA):
                assert all(blank(v) for row in res.rows for v in row), (res.rows, sql)

    def test_every_tenant_filter_shows(self, ch: Any, data: Dataset, name: str) -> None:
        """Each tenant filter removed in turn (made `1 = 1`), some tenant's answer
        changes: the dataset tells every filter's absence (but NARROWING_ONLY's)."""
        checked = 0
        for sql in tenant_queries(dashboards()[name]):
            want = {t.name: answers(ch, data, name, sql, t.name) for t in TENANTS}
            at = [m.start() for m in re.finditer(re.escape(TENANT_FILTER), sql)]
            for i in at:
                table = re.findall(r"\bspanprof\.(\w+)", sql[:i])[-1]
                if table in NARROWING_ONLY:
                    continue
                cut = sql[:i] + "1 = 1" + sql[i + len(TENANT_FILTER):]
                got = {t.name: answers(ch, data, name, cut, t.name) for t in TENANTS}
                assert got != want, f"removing the filter on {table} changes nothing:\n{cut}"
                checked += 1
        assert checked >= {"spanprof.json": 14, "spanprof-trace.json": 6}[name]

    def test_figures_of_the_other_tenant(self, ch: Any, data: Dataset) -> None:
        """A few of B's figures by hand: 3x the CPU, its own services, names and frames."""
        main, trace = dashboards()["spanprof.json"], dashboards()["spanprof-trace.json"]
        v = {x["name"]: x for x in main["templating"]["list"]}
        r = Runner(ch, data, dict(VARS, tenant=B.name))
        assert r.run(variable_sql(v["service"])).rows == [("checkout",), ("payments",)]
        assert r.run(variable_sql(v["operation"])).rows == \
            [("GET /items",), ("POST /order",), ("cache.get",)]
        # 4 shared calls (672 ms in A) times 3, and B's fifth call (42 ms x 5, times 3)
        assert r.run(sql_of(panel(main, "${operation}: CPU"))).dicts() == \
            [{"cpu": 3 * (672 + 210) * MS, "spans": 5, "cpu_per_call": 3 * 882 * MS / 5}]
        rows = check_nested_set(r.run(sql_of(panel(main, "Flame graph"))))
        assert rows[0] == (0, 3 * 882 * MS, 0, "total")
        # B never stored stack 103: its frames are missing, not borrowed from A's 103
        assert (1, 3 * 42 * MS, 3 * 42 * MS, "(stack not stored)") in rows
        assert {r[3] for r in rows} & {f for fns in STACKS.values() for f in fns} == {"main"}
        root, child = data.tenants[B.name].items[0]
        got = Runner(ch, data, {"trace_id": root.trace_id.hex()}, B.name).run(
            sql_of(panel(trace, "Spans of trace"))).dicts()
        assert [(d["operation"], d["start_offset"], d["duration"], d["self_cpu"],
                 d["inclusive_cpu"], d["top_function"]) for d in got] == [
            ("GET /items", 0, 100 * MS, 24 * MS, 45 * MS, "redis.get"),
            ("cache.get", 5 * MS, 40 * MS, 21 * MS, 21 * MS, "redis.execute")]

"""Each query sees only its tenant (issue #17): two tenants' data with the very same trace,
span and stack ids in the real embedded engine, and every function of
``pipeline/admin/queries.py`` and ``function_queries.py`` asked for one of them, or for a
tenant no one has, or for a name holding SQL. Then the admin API: the tenant of a request
is its token's."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from pipeline.admin import function_queries, queries
from pipeline.admin.params import tenant_of as _tenant
from pipeline.admin.server import AdminServer
from pipeline.auth import AuthConfig, TokenAuth
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.graph import Graph, Node
from pipeline.records import (
    Attribution,
    AttributionBatch,
    ProfileBatch,
    Sample,
    Span,
    SpanBatch,
    Stack,
)
from pipeline.registry import Context

MS = 1_000_000
NOW_S = int(time.time()) // 60 * 60 - 600  # whole minutes, ten minutes ago
T0 = NOW_S * 1_000_000_000
TID, ROOT, CHILD, EXTRA = b"\x0a" * 16, b"\x0b" * 8, b"\x0c" * 8, b"\x0d" * 8
EXTRA_CPU = {"a": 2 * MS, "b": 0}  # a's extra span has CPU, b's none
STACK = 7
HOSTILE = ["x' OR 1=1 --", "default' --", "a\\' OR '1'='1", "') OR ('1'='1", "*", ""]


def batches(tenant: str, cpu_ms: int, fn: str) -> list[Any]:
    """One trace of ``tenant`` (ids the same for every tenant): GET / with a child span,
    ``cpu_ms`` of CPU in function ``fn`` (stack 7) on the root and half that on the child,
    and an approximate (thread) row on the root; and a span ``extra``, a second root in a,
    a child of GET / in b (so that one tenant's span tree cannot stand for another's)."""
    cpu, half = cpu_ms * MS, cpu_ms * MS // 2
    spans = [Span(TID, ROOT, b"", f"GET /{tenant}", 2, "api", T0, T0 + 500 * MS),
             Span(TID, CHILD, ROOT, "query", 3, "api", T0 + 100 * MS, T0 + 300 * MS),
             Span(TID, EXTRA, ROOT if tenant == "b" else b"", "extra", 1, "api",
                  T0 + 350 * MS, T0 + 400 * MS)]
    stack = Stack(STACK, [fn, "main"], ["a.py", "a.py"], [1, 2])
    samples = [Sample(TID, ROOT, "api", T0 + 50 * MS, STACK, "cpu", cpu, 1, "cpu", "ns"),
               Sample(TID, CHILD, "api", T0 + 150 * MS, STACK, "cpu", half, 1, "cpu", "ns")]
    attrs = [Attribution(TID, ROOT, "link", "api", f"GET /{tenant}", b"", T0, 500 * MS, True,
                         cpu, 0, 1, {fn: cpu}, {}, 1, cpu + half, {STACK: cpu}),
             Attribution(TID, CHILD, "link", "api", "query", ROOT, T0 + 100 * MS, 200 * MS,
                         True, half, 0, 1, {fn: half}, {}, 2, half, {STACK: half}),
             Attribution(TID, ROOT, "thread", "api", f"GET /{tenant}", b"", T0, 500 * MS,
                         True, MS, 0, 1, {fn: MS}, {}, 3, MS, {STACK: MS})]
    if EXTRA_CPU[tenant]:
        e = EXTRA_CPU[tenant]
        attrs.append(Attribution(TID, EXTRA, "link", "api", "extra", b"", T0 + 350 * MS,
                                 50 * MS, True, e, 0, 1, {fn: e}, {}, 4, e, {STACK: e}))
    return [SpanBatch(spans, tenant=tenant), ProfileBatch(samples, {STACK: stack}, tenant=tenant),
            AttributionBatch(attrs, tenant=tenant)]


# every test only reads the store: one store for the module, shut down at its end (chdb
# takes one engine path per process: the next module opens its own); the async tests run on
# the module's loop, as the store does (the sync ones are not marked: pytest-asyncio warns)
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ClickHouseExporter]:
    """Tenants a (10 ms in fn_a) and b (40 ms in fn_b), same ids, in the embedded engine."""
    tmp_path = tmp_path_factory.mktemp("tenants")
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                   ttl=0),
                            Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
    try:
        await ex.start()
        for tenant, cpu_ms, fn in (("a", 10, "fn_a"), ("b", 40, "fn_b")):
            for batch in batches(tenant, cpu_ms, fn):
                await ex.consume(batch)
        yield ex
    finally:
        await ex.shutdown()


RANGE = (NOW_S - 3600, NOW_S + 3600)


async def everything(db: ClickHouseExporter, tenant: str) -> dict[str, Any]:
    """What every query function answers for ``tenant``."""
    tid, root = TID.hex(), ROOT.hex()
    return {
        "top": await queries.top_spans(db, "spanprof", method="all", tenant=tenant),
        "trace": await queries.trace(db, "spanprof", tid, tenant=tenant),
        "functions": await function_queries.functions(db, "spanprof", "api", None, RANGE,
                                                      method="all", tenant=tenant),
        "diff": await function_queries.diff(db, "spanprof", "api", None, (RANGE[0], NOW_S),
                                            (NOW_S, RANGE[1]), tenant=tenant),
        "span_stacks": await function_queries.span_stacks(db, "spanprof", tid, root,
                                                          tenant=tenant),
        "op_stacks": await function_queries.operation_stacks(db, "spanprof", "api", None,
                                                             RANGE, tenant=tenant),
    }


class TestEachQuerySeesOnlyItsTenant:
    @ON_MODULE_LOOP
    async def test_one_tenant_gets_its_own_rows_and_figures(
            self, store: ClickHouseExporter) -> None:
        """Asked for a, every function answers with a's spans, names, CPU, functions and
        frames only (b's are four times as large and named after b), and likewise for b."""
        for tenant, cpu_ms, fn in (("a", 10, "fn_a"), ("b", 40, "fn_b")):
            other = "fn_b" if tenant == "a" else "fn_a"
            got = await everything(store, tenant)
            cpu, half, extra = cpu_ms * MS, cpu_ms * MS // 2, EXTRA_CPU[tenant]
            top = {s["span_id"]: s for s in got["top"]}
            assert set(top) == {ROOT.hex(), CHILD.hex(), EXTRA.hex()}
            assert top[ROOT.hex()]["name"] == f"GET /{tenant}"
            assert top[ROOT.hex()]["cpu_ns"] == cpu + MS  # link and thread rows ("all")
            assert top[ROOT.hex()]["top_functions"] == [{"name": fn, "self_ns": cpu + MS}]
            tr = got["trace"]
            assert (tr["span_count"], tr["cpu_ns"]) == (3, cpu + half + extra)
            spans = {s["span_id"]: s for s in tr["spans"]}
            assert spans[ROOT.hex()]["name"] == f"GET /{tenant}"
            assert spans[ROOT.hex()]["approximate"] == {
                "thread": {"cpu_ns": MS, "inclusive_cpu_ns": MS, "sample_count": 1}}
            fns = got["functions"]
            assert [f["name"] for f in fns["functions"]] == [fn]
            assert (fns["cpu_ns"], fns["calls"]) == (cpu + half + MS + extra, 3)
            assert [f["name"] for f in got["diff"]["functions"]] == [fn]
            # with its descendants in this tenant: a's extra span is not one
            assert got["span_stacks"]["spans"] == (2 if tenant == "a" else 3)
            assert got["span_stacks"]["stacks"] == [{"frames": ["main", fn],
                                                     "cpu_ns": cpu + half}]
            assert got["op_stacks"]["stacks"] == [{"frames": ["main", fn],
                                                   "cpu_ns": cpu + half + extra}]
            assert other not in msgspec.json.encode(got).decode()
            assert f"GET /{'b' if tenant == 'a' else 'a'}" not in msgspec.json.encode(
                got).decode()

    @ON_MODULE_LOOP
    @pytest.mark.parametrize("tenant", ["c", "default", *HOSTILE])
    async def test_another_tenant_or_sql_in_the_name_gets_nothing(
            self, store: ClickHouseExporter, tenant: str) -> None:
        """A tenant with no rows, or a name holding SQL (bound as a parameter, never part
        of the statement), gets empty answers, and no error."""
        got = await everything(store, tenant)
        assert got["top"] == []
        assert got["trace"]["spans"] == [] and got["trace"]["cpu_ns"] == 0
        assert got["functions"]["functions"] == [] and got["functions"]["calls"] == 0
        assert got["diff"]["functions"] == []
        assert got["span_stacks"]["stacks"] == [] and got["op_stacks"]["stacks"] == []

    def test_every_function_needs_a_tenant(self) -> None:
        """``tenant`` is a required keyword of every query function: none can be called
        for all tenants by leaving it out."""
        import inspect

        for module, name in ((queries, "top_spans"), (queries, "trace"),
                             (function_queries, "functions"), (function_queries, "diff"),
                             (function_queries, "span_stacks"),
                             (function_queries, "operation_stacks")):
            p = inspect.signature(getattr(module, name)).parameters["tenant"]
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
            assert p.default is inspect.Parameter.empty, name


class TestAdminApiTenant:
    def test_the_tenant_of_a_request(self) -> None:
        """The middleware's tenant, else the default tenant; never the query string's."""
        from aiohttp.test_utils import make_mocked_request

        from pipeline.receivers.authn import TENANT

        req = make_mocked_request("GET", "/api/v1/spans?tenant=b")
        assert _tenant(req) == "default"  # the query string is never read
        req[TENANT] = "a"
        assert _tenant(req) == "a"

    @ON_MODULE_LOOP
    async def test_a_token_sees_its_tenants_data_only(
            self, store: ClickHouseExporter) -> None:
        """Through the admin API with tokens: a's token gets a's trace and spans; b's token
        gets b's figures for the same trace id; without a token, 401."""
        import asyncio

        tokens = {"token-of-tenant-a-0123456789": "a", "token-of-tenant-b-0123456789": "b"}
        auth = TokenAuth(AuthConfig(tokens=tokens), "tenantauth", None)
        await auth.start()
        graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                      order=["exporter:clickhouse"])
        admin = AdminServer("127.0.0.1:0", graph, auth=auth)
        await admin.start()

        def get(path: str, token: str | None) -> tuple[int, Any]:
            req = urllib.request.Request(f"http://127.0.0.1:{admin.port}{path}")
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, msgspec.json.decode(r.read())
            except urllib.error.HTTPError as err:
                return err.code, None

        try:
            for token, tenant, cpu_ms in (("token-of-tenant-a-0123456789", "a", 10),
                                          ("token-of-tenant-b-0123456789", "b", 40)):
                status, body = await asyncio.to_thread(
                    get, f"/api/v1/traces/{TID.hex()}", token)
                assert status == 200
                assert body["cpu_ns"] == cpu_ms * MS + cpu_ms * MS // 2 + EXTRA_CPU[tenant]
                names = {f"GET /{tenant}", "query", "extra"}
                assert {s["name"] for s in body["spans"]} == names
                status, body = await asyncio.to_thread(get, "/api/v1/spans?method=all", token)
                assert {s["name"] for s in body["spans"]} == names
            status, _ = await asyncio.to_thread(get, "/api/v1/spans", None)
            assert status == 401
        finally:
            await admin.shutdown()
            await auth.shutdown()

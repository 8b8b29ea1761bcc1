"""The admin API's backfill jobs (pipeline/admin/backfill.py) with tokens on, on the real
embedded engine: a tenant re-attributes its own data only; every tenant's, or files from
the server's disk, only with an admin token; a bad body or field is a 400 naming it; a
second job while one runs is a 409; an unknown job a 404."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.admin.server import AdminServer
from pipeline.auth import AuthConfig, TokenAuth
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter
from pipeline.graph import Graph, Node
from tests.backfill.dataset import generate, write_files
from tests.backfill.test_job import open_store

A, OPS = "token-of-tenant-a-0123456789", "token-of-ops-team-0123456789"


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[AdminServer, ClickHouseExporter]]:
    store = await open_store(tmp_path, "spanprof")
    auth = TokenAuth(AuthConfig(tokens={A: "a", OPS: "ops"}, admin_tenants=["ops"]),
                     "tenantauth", None)
    await auth.start()
    graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse", store)},
                  order=["exporter:clickhouse"])
    server = AdminServer("127.0.0.1:0", graph, auth=auth)
    await server.start()
    try:
        yield server, store
    finally:
        await server.shutdown()
        await auth.shutdown()
        await store.shutdown()


def call(server: AdminServer, method: str, path: str, token: str,
         body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                        else None)
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method,
                                 data=data, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def wait_done(server: AdminServer, job: str, token: str) -> dict[str, Any]:
    for _ in range(600):
        status, st = await asyncio.to_thread(call, server, "GET", f"/api/v1/backfill/{job}",
                                             token)
        assert status == 200
        if st["state"] != "running":
            return dict(st)
        await asyncio.sleep(0.1)
    raise AssertionError("job did not end")


async def test_who_may_submit_what(admin: tuple[AdminServer, ClickHouseExporter],
                                   tmp_path: Path) -> None:
    server, store = admin
    files = write_files(generate(50), tmp_path / "files")
    post = "/api/v1/backfill"

    async def submit(token: str, body: Any = None, raw: bytes | None = None
                     ) -> tuple[int, Any]:
        return await asyncio.to_thread(call, server, "POST", post, token, body, raw)

    # files are on the server's disk: an admin's only
    status, got = await submit(A, {"source": "files", "paths": [str(files[0])]})
    assert status == 403 and "admin" in got["error"]
    status, got = await submit(A, {"source": "reattribute", "range": "2h..1h",
                                   "all_tenants": True})
    assert status == 403 and "all_tenants" in got["error"]
    for body, field in (({"source": "reattribute", "range": "1h..2h"}, "range"),
                        ({"source": "reattribute", "range": "1h", "method": "x"}, "method"),
                        ({"source": "reattribute", "range": "1h", "workers": 0}, "workers"),
                        ({"source": "tape"}, "source"),
                        ({"source": "files", "paths": []}, "paths"),
                        ({"source": "files", "paths": [str(tmp_path / "none")]}, "paths"),
                        ({"source": "reattribute", "range": "1h", "x": 1}, "x")):
        status, got = await submit(OPS, body)
        assert status == 400 and field in got["error"], (body, got)
    status, got = await submit(OPS, raw=b"{not json")
    assert status == 400 and "JSON" in got["error"]
    status, got = await asyncio.to_thread(call, server, "GET", "/api/v1/backfill/nope", OPS)
    assert status == 404

    # an admin loads the files (for its own tenant); a second job meanwhile: 409
    status, got = await submit(OPS, {"source": "files", "paths": [str(p) for p in files]})
    assert status == 202
    job = got["job"]
    status, busy = await submit(A, {"source": "reattribute", "range": "3h"})
    assert status == 409 and busy["running"] == job
    st = await wait_done(server, job, OPS)
    assert st["state"] == "done" and st["summary"]["spans"] == 150, st
    _, rows = await store.query("SELECT tenant, count() FROM spanprof.otel_traces "
                                "GROUP BY tenant")
    assert rows == [("ops", 150)]
    # tenant a re-attributes its own data (none): done, nothing of ops' touched
    status, got = await submit(A, {"source": "reattribute", "range": "3h"})
    assert status == 202
    st = await wait_done(server, got["job"], A)
    assert st["state"] == "done" and st["summary"]["cpu_in_ns"] == 0

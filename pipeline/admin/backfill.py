"""Backfill jobs submitted to a running pipeline (issue #15): the embedded engine opens in
one process only, so while ``spanprof run`` holds it, ``spanprof backfill`` hands its job
to this API and follows it::

    POST /api/v1/backfill          {"source": "files", "paths": [...], "service": "",
                                    "workers": 1}
                                   {"source": "reattribute", "range": "2h..1h",
                                    "method": "all", "all_tenants": false, "workers": 1}
                                   202 {"job": ID}; 409 while another job runs
    GET  /api/v1/backfill/{job}    {"job", "state": running|done|failed, "phase", "done",
                                    "total", "summary"}

The job runs in this process on the pipeline's own ``clickhouse`` exporter (its inserts go
through the same writer as live data) as ``pipeline.backfill.job.Job`` runs it for the
command line, with the same job id for the same arguments, so a job cut short by a restart
resumes when it is submitted again. One job runs at a time.

Whose data: a ``reattribute`` job covers the request's tenant (``_tenant``); every tenant
only with ``all_tenants`` from an admin (auth off, or a token of ``admin_tenants``). A
``files`` job reads files on this machine's disk, so it is for admins only, and loads for
the request's tenant.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog
from aiohttp import web

from pipeline.admin.ranges import parse_range
from pipeline.auth import TokenAuth
from pipeline.backfill import files, job, reattribute
from pipeline.backfill.sources import FileSource
from pipeline.errors import InvalidData
from pipeline.log import redact
from pipeline.receivers.authn import TENANT
from pipeline.records import DEFAULT_TENANT

MAX_BODY = 64 << 10
MAX_PATHS = 10_000
KEEP_DONE = 20  # finished jobs whose status is kept


class Submit(msgspec.Struct, forbid_unknown_fields=True):
    source: Literal["files", "reattribute"]
    paths: list[str] = []
    service: str = ""
    range: str = ""
    method: str = "all"
    all_tenants: bool = False
    workers: int = 1


class Tracker(job.Progress):
    """A job's progress, kept for its status answer (and logged per phase)."""

    def __init__(self) -> None:
        super().__init__(None, False)
        self.name = ""

    def phase(self, name: str, total: int, done: int) -> None:
        self.name, self.total, self.done, self.items = name, total, done, 0
        self.t0 = time.monotonic()

    def step(self, unit: str, items: int, state: str) -> None:
        self.done += 1
        self.items += items


class Running(msgspec.Struct):
    id: str
    tracker: Tracker
    summary: dict[str, Any]
    task: asyncio.Task[Any] | None = None
    state: str = "running"
    error: str = ""


class BackfillJobs:
    def __init__(self, store: Any, auth: TokenAuth | None) -> None:
        self.store = store
        self.auth = auth
        self.jobs: dict[str, Running] = {}
        self.log = structlog.get_logger().bind(component="admin", api="backfill")

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/api/v1/backfill", self.submit)
        app.router.add_get("/api/v1/backfill/{job}", self.status)

    def _admin(self, tenant: str) -> bool:
        return self.auth is None or self.auth.is_admin(tenant)

    async def submit(self, request: web.Request) -> web.Response:
        tenant = request.get(TENANT) or DEFAULT_TENANT
        if request.content_length is not None and request.content_length > MAX_BODY:
            return _error(413, f"body: at most {MAX_BODY} bytes")
        try:
            body = msgspec.json.decode(await request.content.read(MAX_BODY + 1), type=Submit)
        except msgspec.ValidationError as err:
            return _error(400, f"body: {err}")
        except msgspec.DecodeError as err:
            return _error(400, f"body: not JSON: {err}")
        if not 1 <= body.workers <= 64:
            return _error(400, "workers: expected 1..64")
        running = [j for j in self.jobs.values() if j.state == "running"]
        if running:
            return _json({"error": "another backfill job is running", "running":
                          running[0].id}, status=409)
        try:
            source, span, methods, parts, scope = self._plan(body, tenant)
            if source is not None:
                parts += [(u.id, u.spec) for u in await source.units()]
        except _Refused as err:
            return _error(err.status, str(err))
        except (ValueError, OSError) as err:
            return _error(400, str(err))
        jid = job.job_id(body.source, parts)
        tracker = Tracker()
        run = job.Job(self.store, self.store.consume, jid, methods=methods,
                      workers=body.workers, progress=tracker, tenant=scope)
        entry = Running(jid, tracker, run.summary)
        entry.task = asyncio.create_task(self._run(entry, run, source, span),
                                         name=f"backfill {jid}")
        self.jobs[jid] = entry
        self._forget_old()
        self.log.info("backfill_submitted", job=jid, source=body.source, tenant=tenant)
        return _json({"job": jid}, status=202)

    def _plan(self, body: Submit, tenant: str) -> tuple[Any, Any, tuple[str, ...],
                                                        list[object], str | None]:
        if body.source == "files":
            if not self._admin(tenant):
                raise _Refused(403, "source: files are read from this machine's disk: "
                                    "only an admin tenant may submit them")
            if not body.paths or len(body.paths) > MAX_PATHS:
                raise _Refused(400, f"paths: expected 1..{MAX_PATHS} paths")
            try:
                found = files.expand(body.paths)
            except InvalidData as err:
                raise _Refused(400, f"paths: {err}") from None
            ttl = int(self.store.cfg.ttl)
            src = FileSource([Path(p) for p in found], tenant, body.service,
                             horizon_ns=(int(time.time()) - ttl) * 10**9 if ttl else 0)
            return src, None, reattribute.METHODS, [tenant, body.service], None
        if body.all_tenants and not self._admin(tenant):
            raise _Refused(403, "all_tenants: only an admin tenant may re-attribute every "
                                "tenant's data")
        lo, hi = parse_range(body.range, time.time(), "range")
        methods = reattribute.methods_of(body.method)
        scope = None if body.all_tenants else tenant
        return None, (lo * 10**9, hi * 10**9), methods, [scope, lo, hi, methods], scope

    async def _run(self, entry: Running, run: job.Job, source: Any, span: Any) -> None:
        try:
            await run.run(source, span)
            entry.state = "failed" if entry.summary["failed"] else "done"
        except asyncio.CancelledError:
            entry.state, entry.error = "failed", "the pipeline stopped during the job"
            raise
        except Exception as err:  # a job's fault is its own, not the pipeline's
            entry.state, entry.error = "failed", redact(str(err))[:1000]
            self.log.exception("backfill_failed", job=entry.id)
        self.log.info("backfill_ended", job=entry.id, state=entry.state,
                      units=entry.summary["units"], failed=len(entry.summary["failed"]))

    def _forget_old(self) -> None:
        done = [k for k, j in self.jobs.items() if j.state != "running"]
        for k in done[:max(0, len(done) - KEEP_DONE)]:
            del self.jobs[k]

    async def status(self, request: web.Request) -> web.Response:
        entry = self.jobs.get(request.match_info["job"])
        if entry is None:
            return _error(404, "job: no such job in this process (finished jobs are kept "
                               f"for the last {KEEP_DONE})")
        t = entry.tracker
        return _json({"job": entry.id, "state": entry.state, "error": entry.error,
                      "phase": t.name, "done": t.done, "total": t.total,
                      "summary": entry.summary})

    async def stop(self) -> None:
        for entry in self.jobs.values():
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()
        await asyncio.gather(*(e.task for e in self.jobs.values() if e.task is not None),
                             return_exceptions=True)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": redact(message)}, status=status)

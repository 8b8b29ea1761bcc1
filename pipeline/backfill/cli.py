"""``spanprof backfill files|reattribute``: the command line of ``job.Job``.

The store is the config's ``clickhouse`` exporter (default ``config/local.yaml``), opened
here with its sending queue off (a unit's rows are inserted when ``consume`` returns) and
a short flush interval.

While ``spanprof run`` holds the embedded store, the job is submitted to its admin API
(``--admin``, ``SPANPROF_ADMIN``; ``SPANPROF_TOKEN`` / ``SPANPROF_CACERT`` as for the query
commands) and followed there until it ends (``pipeline/admin/backfill.py``).

Exit status: 0 when every unit is done and nothing was refused; 1 when a unit failed (its
figures in the summary) or a file held something refused (named in the summary); 2 for a
usage or configuration problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import time
from typing import Any

import msgspec

from pipeline.admin.client import request_json
from pipeline.auth import TENANT_RE
from pipeline.backfill import files, job, reattribute
from pipeline.config import load_file
from pipeline.errors import ConfigError, InvalidData
from pipeline.log import configure, redact
from pipeline.registry import default_factories

DEFAULT_CONFIG = "config/local.yaml"


def add_parser(sub: Any) -> None:
    b = sub.add_parser("backfill", help="load stored or replayed data and (re)compute "
                       "attribution over a bounded range")
    kinds = b.add_subparsers(dest="source", required=True)
    f = kinds.add_parser("files", help="the Collector's file exporter output, pprof, JFR")
    f.add_argument("paths", nargs="+", help="files, globs or directories")
    f.add_argument("--service", default="",
                   help="service of pprof/JFR samples (default: the file's name)")
    k = kinds.add_parser("kafka", help="replay a range of the gateway's Kafka topics")
    k.add_argument("--topic", action="append", required=True,
                   help="a topic (repeat for the spans and the profiles topics)")
    k.add_argument("--since", help="from (a duration ago, 2h, or an ISO time)")
    k.add_argument("--until", help="to (default: the end when the job starts)")
    k.add_argument("--offsets", help="P:FROM-TO,... per partition, FROM included, TO not")
    r = kinds.add_parser("reattribute", help="recompute the attribution of a stored range")
    r.add_argument("--range", required=True, dest="range_",
                   help="as in `spanprof hot`: 2h..1h (ago), 1h (the last hour), ISO..ISO")
    r.add_argument("--method", default="all",
                   help="rows to recompute: all (the default) or a comma-separated list of "
                        "link, link+time, link+share, thread, window")
    for c in (f, k, r):
        c.add_argument("-c", "--config", default=DEFAULT_CONFIG)
        c.add_argument("--tenant", default=None,
                       help="files: the tenant the data is loaded for (default: default); "
                            "reattribute: only this tenant (default: every tenant)")
        c.add_argument("--workers", type=int, default=1, help="units run at once")
        c.add_argument("--dry-run", action="store_true",
                       help="print the units and what they would read; write nothing")
        c.add_argument("--format", choices=["text", "json"], default="text")
        c.add_argument("--admin", default=os.environ.get("SPANPROF_ADMIN",
                                                         "http://127.0.0.1:13133"),
                       help="admin API of a `spanprof run` holding the embedded store: the "
                            "job is submitted there")
        c.add_argument("--job", default=None,
                       help="the job's id (default: derived from the arguments); a job "
                            "started again with the same id resumes")
        c.set_defaults(func=cmd_backfill)


def cmd_backfill(args: argparse.Namespace) -> int:
    configure("warning")
    if args.workers < 1:
        raise SystemExit("error: --workers: must be at least 1")
    if args.tenant is not None and not TENANT_RE.match(args.tenant):
        raise SystemExit("error: --tenant: letters, digits, '.', '_', '-', at most 64")
    try:
        cfg = load_file(args.config, default_factories())
    except ConfigError as err:
        for p in err.problems:
            print(f"error: {redact(p)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args, cfg))
    except ConfigError as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        return 2


async def _main(args: argparse.Namespace, cfg: Any) -> int:
    from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
    from pipeline.registry import Context

    ids = [k for k in cfg.exporters if k.split("/", 1)[0] == "clickhouse"]
    if not ids:
        raise ConfigError(f"{args.config}: exporters: no clickhouse exporter to backfill into")
    ch: Config = cfg.exporters[ids[0]]
    if ch.cluster:
        raise ConfigError(f"exporters.{ids[0]}.cluster: backfill does not run on a cluster "
                          "schema yet (its DELETEs need the local tables)")
    ch = msgspec.structs.replace(ch, sending_queue=msgspec.structs.replace(
        ch.sending_queue, enabled=False), flush_interval=0.05, batch_rows=50_000)
    store = ClickHouseExporter(ch, Context(ids[0], ["backfill"],
                                           data_dir=cfg.service.data_dir))
    try:
        await store.start()
    except ConfigError as err:
        if not ch.endpoint.startswith("chdb://"):
            raise
        if args.source == "kafka" or args.dry_run:
            raise ConfigError(f"{err} (the embedded store opens in one process and "
                              "`spanprof run` may hold it; submit files or reattribute jobs "
                              "to it, or stop it)") from None
        return await asyncio.to_thread(_submit, args)
    try:
        return await _run(args, store, cfg)
    finally:
        await store.shutdown()


async def _run(args: argparse.Namespace, store: Any, cfg: Any) -> int:
    source: job.Source | None = None
    span: tuple[int, int] | None = None
    methods: tuple[str, ...] = reattribute.METHODS
    if args.source == "files":
        from pipeline.backfill.sources import FileSource

        try:
            paths = files.expand(args.paths)
        except InvalidData as err:
            raise SystemExit(f"error: {err}") from None
        ttl = int(store.cfg.ttl)
        source = FileSource(paths, args.tenant or "default", args.service,
                            horizon_ns=(int(time.time()) - ttl) * 10**9 if ttl else 0)
        parts: list[object] = [args.tenant or "default", args.service,
                               *[(u.id, u.spec) for u in await source.units()]]
    elif args.source == "kafka":
        source = _kafka_source(args, cfg)
        parts = [(u.id, u.spec) for u in await source.units()]
    else:
        from pipeline.admin.ranges import parse_range

        try:
            lo, hi = parse_range(args.range_, time.time(), "--range")
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
        span = (lo * 10**9, hi * 10**9)
        try:
            methods = reattribute.methods_of(args.method)
        except ValueError as err:
            raise SystemExit(f"error: --{err}") from None
        parts = [args.tenant, lo, hi, methods]
    if args.dry_run:
        out = await job.plan_only(store, source, span, args.tenant)
        _print(args, out)
        return 0
    jid = args.job or job.job_id(args.source, parts)
    progress = job.Progress(sys.stderr, True)  # stdout is the summary
    summary = await job.Job(store, store.consume, jid, methods=methods,
                            workers=args.workers, progress=progress,
                            tenant=args.tenant).run(source, span)
    _print(args, summary)
    return 1 if summary["failed"] or summary["refused"] else 0


def _submit(args: argparse.Namespace) -> int:
    """The job, to the running pipeline's admin API; its progress followed to the end."""
    if args.source == "files":
        body: dict[str, Any] = {"source": "files", "service": args.service,
                                "paths": [os.path.abspath(p) for p in args.paths]}
    else:
        body = {"source": "reattribute", "range": args.range_, "method": args.method,
                "all_tenants": args.tenant is None}
    body["workers"] = args.workers
    print(f"the embedded store is held by `spanprof run`: submitting to {args.admin}",
          file=sys.stderr, flush=True)
    jid = _admin(args, "POST", "/api/v1/backfill", body)["job"]
    shown = ("", -1)
    while True:
        st = _admin(args, "GET", f"/api/v1/backfill/{jid}")
        if (st["phase"], st["done"]) != shown:
            shown = (st["phase"], st["done"])
            print(f"  {st['phase'] or 'planning'}: {st['done']}/{st['total']} units",
                  file=sys.stderr, flush=True)
        if st["state"] != "running":
            break
        time.sleep(1.0)
    if st["error"]:
        print(f"error: job {jid}: {st['error']}", file=sys.stderr)
        return 1
    _print(args, st["summary"])
    s = st["summary"]
    return 1 if s["failed"] or s["refused"] else 0


def _admin(args: argparse.Namespace, method: str, path: str,
           body: dict[str, Any] | None = None) -> Any:
    url = args.admin.rstrip("/") + path
    cafile = os.environ.get("SPANPROF_CACERT") or None
    context = ssl.create_default_context(cafile=cafile) if url.startswith("https:") else None
    headers = {"Content-Type": "application/json"}
    if token := os.environ.get("SPANPROF_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    if args.tenant:
        headers["X-Scope-OrgID"] = args.tenant
    return request_json(url, method=method, headers=headers, context=context, body=body,
                        unreachable=lambda reason: (
                            f"error: the embedded store is in use, and no admin API answers "
                            f"at {args.admin} ({reason}); set --admin or SPANPROF_ADMIN"))


def _kafka_source(args: argparse.Namespace, cfg: Any) -> job.Source:
    """The topics' range, read with the config's ``kafka`` receiver's (else exporter's)
    brokers and security."""
    from pipeline.admin.ranges import parse_range
    from pipeline.backfill.kafka_blocks import parse_offsets
    from pipeline.backfill.sources import KafkaSource

    client = next((c for section in (cfg.receivers, cfg.exporters)
                   for cid, c in section.items() if cid.split("/", 1)[0] == "kafka"), None)
    if client is None:
        raise ConfigError(f"{args.config}: no kafka receiver or exporter to read brokers "
                          "from (use the Kafka tier's config, e.g. config/correlator.yaml)")
    if args.offsets and (args.since or args.until):
        raise SystemExit("error: give --offsets, or --since/--until, not both")
    try:
        if args.offsets:
            return KafkaSource(client, args.topic, offsets=parse_offsets(args.offsets))
        since = until = None
        if args.since or args.until:
            now = time.time()
            lo, hi = parse_range(f"{args.since or '1970-01-01T00:00:00+00:00'}.."
                                 f"{args.until or '0s'}", now, "--since/--until")
            since = lo * 10**9
            until = hi * 10**9 if args.until else None
        return KafkaSource(client, args.topic, since=since, until=until)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def _print(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return
    if out.get("dry_run"):
        print("dry run, nothing written: " + ", ".join(f"{k} {v}" for k, v in out.items()
                                                        if k != "dry_run"))
        return
    print(f"job {out['job']}: {out['done']} of {out['units']} units done "
          f"({out['already_done']} before this run), {len(out['failed'])} failed, "
          f"{out['seconds']}s")
    print(f"  loaded {out['spans']} spans, {out['samples']} samples; CPU "
          f"{out['cpu_in_ns'] / 1e9:.3f}s in = {out['cpu_attributed_ns'] / 1e9:.3f}s on "
          f"spans + {out['cpu_unattributed_ns'] / 1e9:.3f}s unattributed; "
          f"{out['rows_written']} rows written")
    for r in out["refused"]:
        print(f"  refused: {r}")
    for f in out["failed"]:
        print(f"  FAILED {f['unit']}: {f['message']}")

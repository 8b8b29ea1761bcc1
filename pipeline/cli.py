"""``spanprof``: run | validate | schema, and the commands of two modules of their own:
top | explain | hot | diff | flamegraph | why, which ask a running ``spanprof run`` over
its admin API (``pipeline/query_cli.py``), and backfill (``pipeline/backfill/cli.py``).

Exit codes: 0 success, 1 runtime failure (e.g. the API is unreachable), 2 bad configuration
or bad usage (also an installed opentelemetry-proto whose profiles layout is too old:
``pipeline/otlp/layout.py``).

``run`` and ``validate`` take the components spanprof ships from
``pipeline.registry.default_factories()``, which imports them (grpc, aiokafka,
clickhouse-connect) only when called; the query commands and ``--help`` never do. The
service is imported in ``cmd_run`` for the same reason (aiohttp, through the admin API).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import structlog

from pipeline import query_cli
from pipeline.backfill.cli import add_parser as add_backfill_parser
from pipeline.config import RawConfig, load_file, schema_hook
from pipeline.errors import ConfigError
from pipeline.graph import build, create_extensions
from pipeline.log import configure, redact
from pipeline.registry import default_factories


def _config_errors(err: ConfigError) -> int:
    """One line per problem, secrets redacted (a client library's error may quote them)."""
    for p in err.problems:
        print(f"error: {redact(p)}", file=sys.stderr)
    return 2


def cmd_validate(args: argparse.Namespace) -> int:
    """Every problem in one run (pipeline.config collects them), exit 2; nothing starts."""
    from pipeline.otlp.layout import check_profiles_layout

    configure("warning")  # build() warns about unused components: on stderr, redacted
    factories = default_factories()
    try:
        check_profiles_layout()
        cfg = load_file(args.config, factories)
        # the listeners' auth: names an extension: hand them the created ones, as run does
        build(cfg, factories, authenticators=create_extensions(cfg, factories))
    except ConfigError as err:
        return _config_errors(err)
    print(f"{args.config}: ok ({len(cfg.service.pipelines)} pipelines)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Exit 2 on a configuration problem, including one found at start-up (a port taken,
    ClickHouse unreachable): one line naming the key; 1 if the service fails later."""
    from pipeline.otlp.layout import check_profiles_layout
    from pipeline.service import Service

    factories = default_factories()
    try:
        check_profiles_layout()
        cfg = load_file(args.config, factories)
    except ConfigError as err:
        return _config_errors(err)
    logs = cfg.service.telemetry.logs
    configure(logs.level, logs.encoding)

    async def main() -> None:
        await Service(cfg, factories).run()

    try:
        asyncio.run(main())
    except ConfigError as err:
        return _config_errors(err)
    except Exception:
        # a bug, not an operator mistake: the traceback goes through the redacting logger
        structlog.get_logger().exception("service_failed")
        return 1
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    if args.what == "config":
        import msgspec

        print(json.dumps(msgspec.json.schema(RawConfig, schema_hook=schema_hook), indent=2))
        return 0
    from pipeline.exporters.clickhouse.migrate import render
    from pipeline.exporters.clickhouse.schema import SchemaOptions

    print(render(SchemaOptions(database=args.database, ttl_seconds=args.ttl_days * 86400,
                               cluster=args.cluster)))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spanprof", description="Link traces to profiles.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a pipeline until SIGTERM/SIGINT")
    r.add_argument("-c", "--config", required=True)
    r.set_defaults(func=cmd_run)
    v = sub.add_parser("validate", help="check a config file without starting anything")
    v.add_argument("-c", "--config", required=True)
    v.set_defaults(func=cmd_validate)
    query_cli.add_parsers(sub)
    s = sub.add_parser("schema", help="print the ClickHouse DDL or the config JSON Schema")
    s.add_argument("what", choices=["print", "config"])
    s.add_argument("--database", default="spanprof")
    s.add_argument("--ttl-days", type=int, default=7)
    s.add_argument("--cluster", default="", help="emit ON CLUSTER, Replicated* and "
                   "Distributed tables for this cluster")
    s.set_defaults(func=cmd_schema)
    add_backfill_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

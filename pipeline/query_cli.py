"""``spanprof top | explain | hot | diff | flamegraph | why``: the query commands, asked of
the admin API of a running ``spanprof run`` over HTTP and printed as tables, trees, JSON or
SVG.

They import no component of the pipeline: urllib for the API, and the text renderers
(``why_text``; ``flamegraph`` when a graph is drawn). Where to reach the API and as
whom: ``--admin`` / ``SPANPROF_ADMIN``, ``--cacert`` / ``SPANPROF_CACERT``, ``--token`` /
``SPANPROF_TOKEN``, ``--tenant`` / ``SPANPROF_TENANT``. An unreachable API or an error
answer exits 1 with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.parse
from typing import Any

from pipeline import why_text
from pipeline.admin.client import request_json

DEFAULT_ADMIN = os.environ.get("SPANPROF_ADMIN", "http://127.0.0.1:13133")
# the CA that signed an https admin API's certificate (default: the system's store)
DEFAULT_CACERT = os.environ.get("SPANPROF_CACERT") or None
# the token an admin API with auth on asks for (sent as Authorization: Bearer)
DEFAULT_TOKEN = os.environ.get("SPANPROF_TOKEN") or None
# the tenant to read where the admin API has auth off (sent as X-Scope-OrgID); with auth
# on, the token's tenant is read, and naming another is refused
DEFAULT_TENANT = os.environ.get("SPANPROF_TENANT") or None
METHOD_HELP = ("rows to add up: exact (link, link+time; the default), all, or a "
               "comma-separated list of link, link+time, link+share, thread, window")


def _admin_args(c: argparse.ArgumentParser) -> None:
    """How a query command reaches the admin API of ``spanprof run``."""
    c.add_argument("--admin", default=DEFAULT_ADMIN, help="admin API of `spanprof run`")
    c.add_argument("--cacert", default=DEFAULT_CACERT,
                   help="CA file for an https admin API (SPANPROF_CACERT)")
    c.add_argument("--token", default=DEFAULT_TOKEN,
                   help="token for an admin API with auth on (SPANPROF_TOKEN)")
    c.add_argument("--tenant", default=DEFAULT_TENANT,
                   help="tenant to read where auth is off, sent as X-Scope-OrgID "
                        "(SPANPROF_TENANT; default: the default tenant)")


def _get(args: argparse.Namespace, path: str, params: dict[str, Any]) -> Any:
    q = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    url = f"{args.admin.rstrip('/')}{path}" + (f"?{q}" if q else "")
    try:
        context = ssl.create_default_context(cafile=args.cacert) \
            if url.startswith("https:") else None
    except (OSError, ssl.SSLError) as err:
        raise SystemExit(f"error: --cacert {args.cacert}: {err}") from None
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    if args.tenant:
        headers["X-Scope-OrgID"] = args.tenant
    return request_json(url, headers=headers, context=context, unreachable=lambda reason: (
        f"error: cannot reach the spanprof admin API at {args.admin} ({reason}); is "
        "`spanprof run` running? Set --admin or SPANPROF_ADMIN."))


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.1f}ms"


def cmd_top(args: argparse.Namespace) -> int:
    data = _get(args, "/api/v1/spans", {"order": args.by, "limit": args.limit,
                                        "service": args.service, "method": args.method})
    spans = data["spans"]
    if args.format == "json":
        print(json.dumps(spans, indent=2))
        return 0
    # lock wait and bytes allocated: columns only where a profile of them reached a span
    extra = any(s.get("lock_ns") or s.get("alloc_bytes") for s in spans) \
        or args.by in ("lock", "alloc")
    header = f"{'TRACE_ID':32}  {'SPAN_ID':16}  {'SERVICE':16}  {'NAME':24}  " \
             f"{'DURATION':>10}  {'CPU':>10}  {'INCL CPU':>10}  {'OFF-CPU':>10}  " + \
             (f"{'LOCK':>10}  {'ALLOC':>10}  " if extra else "") + f"{'SAMPLES':>7}  TOP FUNCTION"
    print(header)
    for s in spans:
        top = s["top_functions"][0] if s["top_functions"] else None
        topf = f"{top['name']} ({_ms(top['self_ns'])})" if top else "-"
        alloc = why_text.size(s.get("alloc_bytes", 0), "")
        more = f"{_ms(s.get('lock_ns', 0)):>10}  {alloc:>10}  " if extra else ""
        print(f"{s['trace_id']:32}  {s['span_id']:16}  {s['service'][:16]:16}  "
              f"{s['name'][:24]:24}  {_ms(s['duration_ns']):>10}  {_ms(s['cpu_ns']):>10}  "
              f"{_ms(s['inclusive_cpu_ns']):>10}  {_ms(s['off_cpu_ns']):>10}  {more}"
              f"{s['sample_count']:>7}  {topf}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    data = _get(args, f"/api/v1/traces/{args.trace_id.lower()}", {"method": args.method})
    if args.format == "json":
        print(json.dumps(data, indent=2))
        return 0
    spans = data["spans"]
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    roots = []
    for s in sorted(spans, key=lambda s: (s.get("start_time_unix_nano") or 0, s["span_id"])):
        parent = s.get("parent_span_id") or ""
        if parent and parent in ids:
            children.setdefault(parent, []).append(s)
        else:
            roots.append(s)
    print(f"trace {data['trace_id']}: {data['span_count']} spans, CPU {_ms(data['cpu_ns'])}")

    def show(s: dict[str, Any], prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        top = s["top_functions"][0] if s["top_functions"] else None
        name = s["name"] or "(span not received)"
        line = (f"{prefix}{branch}{s['service']}: {name}  duration {_ms(s['duration_ns'])}"
                f"  cpu {_ms(s['cpu_ns'])}")
        if s.get("inclusive_cpu_ns", s["cpu_ns"]) != s["cpu_ns"]:
            line += f" (with children {_ms(s['inclusive_cpu_ns'])})"
        line += f"  off-cpu {_ms(s['off_cpu_ns'])}"
        if s.get("lock_ns"):
            line += f" (lock {_ms(s['lock_ns'])})"
        if s.get("alloc_bytes"):
            line += f"  alloc {why_text.size(s['alloc_bytes'], '')}"
        line += f"  samples {s['sample_count']}"
        if top:
            line += f"  top {top['name']} {_ms(top['self_ns'])}"
        for method, a in sorted((s.get("approximate") or {}).items()):
            line += f"  ~{_ms(a['cpu_ns'])} more by {method}"
        print(line)
        pad = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        for key, label, fmt in (("top_wall_functions", "wall", "ms"),
                                ("top_lock_functions", "lock", "ms"),
                                ("top_alloc_functions", "alloc", "bytes")):
            fns = s.get(key) or []
            if fns:
                what = ", ".join(f"{f['name']} " + (_ms(f["self_ns"]) if fmt == "ms" else
                                                    why_text.size(f["bytes"], ""))
                                 for f in fns[:3])
                print(f"{pad}   {label}: {what}")
        kids = children.get(s["span_id"], [])
        ext = "" if depth == 0 else ("   " if last else "│  ")
        for i, k in enumerate(kids):
            show(k, prefix + ext, i == len(kids) - 1, depth + 1)

    for r in roots:
        show(r, "", True, 0)
    return 0


def cmd_hot(args: argparse.Namespace) -> int:
    data = _get(args, "/api/v1/functions", {"service": args.service,
                                            "operation": args.operation, "since": args.since,
                                            "limit": args.limit, "method": args.method})
    if args.format == "json":
        print(json.dumps(data, indent=2))
        return 0
    what = f"{data['service']}" + (f" / {data['operation']}" if data["operation"] else "")
    print(f"{what}: CPU {_ms(data['cpu_ns'])} in {data['calls']} calls, last {args.since}")
    print(f"{'SELF CPU':>12}  {'SHARE':>6}  {'PER CALL':>10}  FUNCTION")
    for f in data["functions"]:
        per = _ms(int(f["per_call_ns"])) if f["per_call_ns"] is not None else "-"
        print(f"{_ms(f['self_cpu_ns']):>12}  {f['share']:6.1%}  {per:>10}  {f['name']}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    data = _get(args, "/api/v1/diff", {"service": args.service, "operation": args.operation,
                                       "before": args.before, "after": args.after,
                                       "limit": args.limit, "method": args.method})
    if args.format == "json":
        print(json.dumps(data, indent=2))
        return 0
    b, a = data["before"], data["after"]
    print(f"self CPU {data['unit'].replace('_', ' ')}: before {b['calls']} calls, "
          f"after {a['calls']} calls")
    print(f"{'BEFORE':>10}  {'AFTER':>10}  {'CHANGE':>10}  {'RATIO':>7}  FUNCTION")
    for f in data["functions"]:
        ratio = f"{f['ratio']:.2f}x" if f["ratio"] is not None else "new"
        print(f"{_ms(int(f['before_ns'])):>10}  {_ms(int(f['after_ns'])):>10}  "
              f"{'+' if f['delta_ns'] >= 0 else ''}{_ms(int(f['delta_ns'])):>9}  {ratio:>7}  "
              f"{f['name']}")
    return 0


def cmd_flamegraph(args: argparse.Namespace) -> int:
    from pipeline import flamegraph

    if args.trace or args.span:
        if not (args.trace and args.span):
            raise SystemExit("error: --trace and --span go together")
        data = _get(args, "/api/v1/stacks", {"trace_id": args.trace, "span_id": args.span,
                                             "method": args.method})
        title = f"span {args.span} of trace {args.trace} (with its children)"
    elif args.service:
        data = _get(args, "/api/v1/stacks", {"service": args.service,
                                             "operation": args.operation,
                                             "since": args.since, "method": args.method})
        title = f"{args.service}" + (f" / {args.operation}" if args.operation else "") + \
            f", last {args.since}"
    else:
        raise SystemExit("error: give --trace and --span, or --service [--operation]")
    if not data["stacks"]:
        raise SystemExit("error: no CPU samples for that selection")
    root = flamegraph.build((s["frames"], s["cpu_ns"]) for s in data["stacks"])
    svg = flamegraph.render_svg(root, f"CPU: {title}")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(svg)
    print(f"wrote {args.output}: {_ms(root.value)} of CPU in {len(data['stacks'])} stacks")
    return 0


def cmd_why(args: argparse.Namespace) -> int:
    if args.slowest and args.slower_than:
        raise SystemExit("error: give --slowest or --slower-than, not both")
    params = {"service": args.service, "operation": args.operation, "range": args.range,
              "method": args.method, "limit": args.limit,
              "stacks": "1" if args.format == "svg" else None}
    if args.slower_than:
        params["slower_than"] = args.slower_than
    else:
        params["slowest"] = args.slowest or "1%"
    data = _get(args, "/api/v1/why", params)
    if args.format == "json":
        print(json.dumps(data, indent=2))
    elif args.format == "svg":
        if not data.get("stacks"):
            raise SystemExit("error: no CPU samples in the tail to draw")
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(why_text.svg(data))
        print(f"wrote {args.output}: {len(data['stacks'])} stacks, tail {data['rule']}")
    else:
        sys.stdout.write(why_text.text(data))
    return 0


def add_parsers(sub: Any) -> None:
    """The query commands, on the ``spanprof`` command's subparsers."""
    for name, helptext in (("top", "spans by CPU or duration"), ("explain", "one trace")):
        c = sub.add_parser(name, help=helptext)
        _admin_args(c)
        c.add_argument("--method", default="exact", help=METHOD_HELP)
        if name == "top":
            c.add_argument("--by", choices=["cpu", "inclusive", "duration", "off_cpu", "lock",
                                            "alloc"],
                           default="cpu")
            c.add_argument("--limit", type=int, default=20)
            c.add_argument("--service")
            c.add_argument("--format", choices=["table", "json"], default="table")
            c.set_defaults(func=cmd_top)
        else:
            c.add_argument("trace_id")
            c.add_argument("--format", choices=["tree", "json"], default="tree")
            c.set_defaults(func=cmd_explain)
    h = sub.add_parser("hot", help="functions by self CPU in a service or operation")
    d = sub.add_parser("diff", help="which functions got more expensive between two ranges")
    f = sub.add_parser("flamegraph", help="an SVG flame graph of a span or an operation")
    for c in (h, d, f):
        _admin_args(c)
        c.add_argument("--method", default="exact", help=METHOD_HELP)
    for c in (h, d):
        c.add_argument("--service", required=True)
        c.add_argument("--operation")
        c.add_argument("--limit", type=int, default=20)
        c.add_argument("--format", choices=["table", "json"], default="table")
    h.add_argument("--since", default="1h", help="how far back: 15m, 1h, 1d, or A..B")
    h.set_defaults(func=cmd_hot)
    d.add_argument("--before", required=True, help="a range: 2h..1h (ago) or ISO..ISO")
    d.add_argument("--after", required=True, help="a range: 1h (the last hour), 1h..0s, ...")
    d.set_defaults(func=cmd_diff)
    f.add_argument("--trace")
    f.add_argument("--span")
    f.add_argument("--service")
    f.add_argument("--operation")
    f.add_argument("--since", default="1h")
    f.add_argument("-o", "--output", default="flamegraph.svg")
    f.set_defaults(func=cmd_flamegraph)
    w = sub.add_parser("why", help="why an operation's slowest calls are slow: what sets "
                       "them apart from its typical calls")
    _admin_args(w)
    w.add_argument("--service", required=True)
    w.add_argument("--operation", required=True)
    w.add_argument("--range", default="1h", help="1h (the last hour), 2h..1h, ISO..ISO")
    w.add_argument("--slowest", help="the tail: this share of the calls (1%%, the default)")
    w.add_argument("--slower-than", help="the tail: calls slower than this (1s, 250ms)")
    w.add_argument("--method", default="exact", help=METHOD_HELP)
    w.add_argument("--limit", type=int, default=20)
    w.add_argument("--format", choices=["text", "json", "svg"], default="text")
    w.add_argument("-o", "--output", default="why.svg", help="with --format svg")
    w.set_defaults(func=cmd_why)

"""Attribution accuracy against ground truth: traces and profiles generated together, so
the span each sample was really taken in is known, then joined by the correlator.

Each scenario is a service with several threads, each running one request after another
(a root span with nested children, synchronous unless the scenario says otherwise), and a
profiler that samples every thread every 10 ms while it is on CPU. What the profiler knows
(labels, timestamps, threads) and how much its clock is off the tracer's is what varies;
every sample's timestamp is also off its true instant by up to 1 ms either way:

* ``sync``            root-span labels + timestamps + thread ids (``link+time``)
* ``sync-link-only``  the same, no timestamps: what labels alone give (all on the root)
* ``skew-20ms``       as ``sync``, profiler clock 20 ms ahead of the tracer
* ``short-spans``     children of 1-8 ms, under or near the 10 ms sampling interval
* ``async``           children overlap on one thread (asyncio tasks taking turns)
* ``thread``          no labels; spans carry ``thread.id``: matched by process and thread
* ``window``          no labels, no threads: time only (approximate)

Each sample's stack is what its span runs (``stack_of``: the operation's own frames under
the server's, or the event loop's for a task, with its callers' above a synchronous call;
10% runtime-only and 5% truncated stacks), which placement by stack (``frames``) reads
where the instant cannot tell: ``async`` and ``window``.

Accuracy is the share of CPU that lands on the right span, sample by sample (each sample
has a leaf frame of its own, so the rows' per-function CPU says where each one went).
``python bench/accuracy.py`` prints one line per scenario; ``make bench`` runs it.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.records import ProfileBatch, Sample, Span, Stack  # noqa: E402
from processors.correlate.state import CorrelatorState  # noqa: E402

PERIOD_NS = 10_000_000  # 100 Hz
MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
PID = 4242


# What the service runs, so that a sample's stack says what it was doing, as a real one
# does: each request is one of a few endpoints, each child span one of a few operations,
# each with its own frames (caller first) and the library functions it spends time in,
# which several operations share. Every stack starts in frames all requests share (the
# server, or the event loop of an asyncio service); a child span called synchronously (or
# awaited directly) has its callers' frames above its own, while a task of its own (an
# asyncio.gather) starts at the event loop, without its parent's.
ENDPOINTS = {
    "GET /cart": ["cart.views.get_cart"],
    "POST /checkout": ["checkout.views.place_order", "checkout.service.checkout"],
    "GET /product": ["catalog.views.product_page"],
}
OPERATIONS = {
    "SELECT orders": ["orders.repo.find_orders", "sqlalchemy.orm.Query.all",
                      "psycopg.Cursor.execute"],
    "SELECT products": ["catalog.repo.load_products", "sqlalchemy.orm.Query.all",
                        "psycopg.Cursor.execute"],
    "cache.get": ["cache.client.get_many", "redis.Connection.read_response"],
    "POST pricing": ["pricing.client.quote", "httpx.Client.send"],
    "render": ["templates.render_page", "jinja2.Template.render"],
    "recompute_promotions": ["promotions.engine.recompute", "promotions.rules.apply"],
}
LIBRARY = {  # where each operation's self time goes, beyond its own frames
    "GET /cart": ["dict.__getitem__", "json.encoder.iterencode"],
    "POST /checkout": ["decimal.Decimal.__mul__", "json.encoder.iterencode"],
    "GET /product": ["json.encoder.iterencode", "re.Pattern.match"],
    "SELECT orders": ["socket.socket.recv", "psycopg.Row.__init__"],
    "SELECT products": ["socket.socket.recv", "psycopg.Row.__init__"],
    "cache.get": ["socket.socket.recv", "pickle.loads"],
    "POST pricing": ["ssl.SSLSocket.read", "json.decoder.raw_decode"],
    "render": ["re.Pattern.sub", "str.join"],
    "recompute_promotions": ["decimal.Decimal.__mul__", "list.sort", "copy.deepcopy"],
}
SERVER = ["main", "server.serve_forever", "threading.Thread.run", "framework.dispatch"]
EVENT_LOOP = ["main", "asyncio.base_events.run_forever", "asyncio.events.Handle._run",
              "asyncio.tasks.Task.__step"]
# runtime work with no frame of any operation: the event loop's own, logging, collection
RUNTIME = [["asyncio.base_events._run_once", "selectors.EpollSelector.select"],
           ["logging.Handler.emit", "io.TextIOWrapper.write"], ["gc.collect"]]
RUNTIME_SHARE = 0.1  # of samples
TRUNCATED_SHARE = 0.05  # stacks the unwinder cut short: their two innermost frames only


@dataclass(frozen=True)
class Scenario:
    name: str
    labels: bool = True  # samples carry the local root span
    timestamps: bool = True
    threads: bool = True  # samples and spans carry thread ids
    skew_ns: int = 0  # profiler clock minus tracer clock
    jitter_ns: int = MS  # a sample's timestamp is off its instant by up to this, either way
    child_ms: tuple[int, int] = (20, 120)
    overlap: bool = False  # children of one span interleave on one thread


SCENARIOS = [
    Scenario("sync"),
    Scenario("sync-link-only", timestamps=False),
    Scenario("skew-20ms", skew_ns=20 * MS),
    Scenario("short-spans", child_ms=(1, 8)),
    Scenario("async", overlap=True),
    Scenario("thread", labels=False),
    Scenario("window", labels=False, threads=False),
]


@dataclass
class Generated:
    spans: list[Span]
    samples: list[Sample]
    stacks: dict[int, Stack]
    truth: dict[bytes, int]  # span id -> CPU ns really spent in it (self)
    where: dict[str, bytes]  # each sample's own leaf frame -> the span it was taken in


def generate(sc: Scenario, n_threads: int = 4, requests_per_thread: int = 40,
             seed: int = 1) -> Generated:
    rng = random.Random(seed)
    # what each span runs, from a generator of its own: the timeline (``rng``) is the same
    # whatever the stacks are
    names_rng = random.Random(seed + 1)
    names: dict[bytes, str] = {}  # span -> its operation (endpoint for a root)
    parent_of: dict[bytes, bytes] = {}
    tasks: set[bytes] = set()  # spans run as tasks of their own (asyncio.gather)
    spans: list[Span] = []
    samples: list[Sample] = []
    truth: dict[bytes, int] = defaultdict(int)
    where: dict[str, bytes] = {}
    stacks: dict[int, Stack] = {}
    ids = iter(range(1, 1 << 62))

    def new_id(n: int) -> bytes:
        return next(ids).to_bytes(n, "big")

    for th in range(1, n_threads + 1):
        t = T0 + rng.randrange(0, 50 * MS)
        for _ in range(requests_per_thread):
            trace = new_id(16)
            root = new_id(8)
            # timeline of this thread: (start, end, running span id), innermost; a third
            # of the time the thread waits (off CPU) and is not sampled
            running: list[tuple[int, int, bytes]] = []
            tree: list[tuple[bytes, bytes, int, int]] = []  # (span, parent, start, end)

            def build(span_id: bytes, start: int, depth: int,
                      running: list[tuple[int, int, bytes]] = running,
                      tree: list[tuple[bytes, bytes, int, int]] = tree) -> int:
                """Children one after another, with self time between; returns the end."""
                cur = start
                kids = rng.randint(1, 3) if depth < 3 else 0
                lo, hi = sc.child_ms
                if sc.overlap and kids >= 2 and depth == 1:
                    # tasks taking turns on one thread: 5 ms slices, round robin
                    cur += rng.randint(2, 10) * MS
                    kid_ids = [new_id(8) for _ in range(kids)]
                    for k in kid_ids:
                        names[k] = names_rng.choice(list(OPERATIONS))
                        parent_of[k] = span_id
                        tasks.add(k)
                    left = {k: rng.randint(lo, hi) * MS for k in kid_ids}
                    first = {k: 0 for k in kid_ids}
                    last = {k: 0 for k in kid_ids}
                    while any(left.values()):
                        for k in kid_ids:
                            if left[k] <= 0:
                                continue
                            d = min(5 * MS, left[k])
                            first[k] = first[k] or cur
                            running.append((cur, cur + d, k))
                            cur += d
                            left[k] -= d
                            last[k] = cur
                    for k in kid_ids:
                        tree.append((k, span_id, first[k], last[k]))
                    end = cur + rng.randint(2, 10) * MS
                    running.append((cur, end, span_id))  # once every task is done
                    return end
                for _ in range(kids):
                    gap = rng.randint(1, 10) * MS
                    running.append((cur, cur + gap, span_id))
                    cur += gap
                    child = new_id(8)
                    names[child] = names_rng.choice(list(OPERATIONS))
                    parent_of[child] = span_id
                    child_start = cur
                    if depth + 1 < 3:
                        cur = build(child, cur, depth + 1, running, tree)
                    else:
                        cur += rng.randint(lo, hi) * MS
                        running.append((child_start, cur, child))
                    tree.append((child, span_id, child_start, cur))
                gap = rng.randint(1, 10) * MS
                running.append((cur, cur + gap, span_id))
                return cur + gap

            names[root] = names_rng.choice(list(ENDPOINTS))
            end = build(root, t, 1)
            tree.append((root, b"", t, end))
            for sid, parent, start, stop in tree:
                attrs = {"thread.id": str(th)} if sc.threads else {}
                spans.append(Span(trace, sid, parent, names[sid], 1, "svc", start, stop,
                                  attributes=attrs,
                                  resource_attributes={"process.pid": str(PID)}))
            # the profiler: one sample per period per thread, at the true instant
            running.sort()
            tick = t - (t % PERIOD_NS) + PERIOD_NS
            i = 0
            while tick < end:
                while i < len(running) and running[i][1] <= tick:
                    i += 1
                if i < len(running) and running[i][0] <= tick and rng.random() < 0.67:
                    # each sample gets a leaf frame of its own, named after it (as an
                    # unsymbolised address would be): where its CPU lands can then be read,
                    # sample by sample, off the rows' functions; under it, what its span runs
                    stack = len(stacks) + 1
                    frames = [f"s{stack}", *stack_of(running[i][2], names, parent_of, tasks,
                                                     sc.overlap, names_rng)]
                    stacks[stack] = Stack(stack, frames, ["app.py"] * len(frames),
                                          list(range(1, len(frames) + 1)))
                    where[f"s{stack}"] = running[i][2]
                    truth[running[i][2]] += PERIOD_NS
                    samples.append(Sample(
                        trace if sc.labels else b"", root if sc.labels else b"", "svc",
                        tick + sc.skew_ns + rng.randint(-sc.jitter_ns, sc.jitter_ns)
                        if sc.timestamps else T0, stack, "cpu", PERIOD_NS,
                        1, "cpu", "nanoseconds", th if sc.threads else 0, "", "",
                        PID, "", sc.timestamps))
                tick += PERIOD_NS
            t = end + rng.randint(1, 20) * MS
    return Generated(spans, samples, stacks, dict(truth), where)


def stack_of(span: bytes, names: dict[bytes, str], parent_of: dict[bytes, bytes],
             tasks: set[bytes], asyncio: bool, rng: random.Random) -> list[str]:
    """The frames of a sample taken while ``span`` runs, leaf first: the shared frames of
    the server (or event loop), its callers' frames unless it runs as a task, its own, and
    often a library function; now and then runtime work, or a truncated stack."""
    base = EVENT_LOOP if asyncio else SERVER
    if rng.random() < RUNTIME_SHARE:
        return list(reversed(base + rng.choice(RUNTIME)))
    chain: list[str] = []
    sid = span
    while True:
        op = names[sid]
        chain = (OPERATIONS.get(op) or ENDPOINTS[op]) + chain
        if sid in tasks or sid not in parent_of:
            break
        sid = parent_of[sid]
    frames = base + ([] if span in tasks else ["framework.middleware"]) + chain
    if rng.random() < 0.6:
        frames = frames + [rng.choice(LIBRARY[names[span]])]
    out = list(reversed(frames))
    return out[:2] if rng.random() < TRUNCATED_SHARE else out


@dataclass
class Result:
    scenario: str
    accuracy: float  # share of CPU on the right span, all methods
    by_method: dict[str, tuple[int, float]]  # method -> (CPU ns, share of it right)
    unattributed_share: float


def run(sc: Scenario, **kw: int) -> Result:
    g = generate(sc, **kw)
    state = CorrelatorState(grace=1.0, orphan_timeout=5.0, max_entries=10_000_000)
    # spans first then profiles, as they usually arrive (profilers upload every 10-60 s)
    state.add_spans(g.spans, now=0.0)
    state.add_samples(ProfileBatch(g.samples, g.stacks), now=1.0)
    out = state.take_due(now=100.0, force=True)
    total = sum(g.truth.values())
    right = 0
    by_method_cpu: dict[str, int] = defaultdict(int)
    by_method_ok: dict[str, int] = defaultdict(int)
    for r in out.attributions:
        for fn, v in r.self_cpu_ns.items():
            ok = v if g.where.get(fn) == r.span_id else 0
            right += ok
            by_method_cpu[r.method] += v
            by_method_ok[r.method] += ok
    by_method = {m: (cpu, by_method_ok[m] / cpu) for m, cpu in sorted(by_method_cpu.items())
                 if cpu}
    unattributed = sum(u.cpu_ns for u in out.unattributed)
    return Result(sc.name, right / total if total else 0.0, by_method,
                  unattributed / total if total else 0.0)


def main() -> None:
    print("attribution accuracy: share of CPU on the right span (ground truth)")
    for sc in SCENARIOS:
        r = run(sc)
        methods = "  ".join(f"{m} {cpu / 1e9:.1f}s ({ok:.1%} right)"
                            for m, (cpu, ok) in r.by_method.items())
        print(f"  {r.scenario:15} {r.accuracy:6.1%}   unattributed {r.unattributed_share:5.1%}"
              f"   {methods}")


if __name__ == "__main__":
    main()

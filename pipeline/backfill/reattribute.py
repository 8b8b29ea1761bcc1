"""Attribution recomputed from what is stored: the units of a backfill's second phase.

What is replayed is what the crash recovery of the live correlator replays
(``processors.correlate.readback`` reads the raw rows, ``reconcile.expected`` runs them
through a fresh ``CorrelatorState``), so a backfill attributes exactly as the live pipeline
does with every span and sample at hand. Unlike recovery, a unit *replaces* the stored
rows of its scope instead of adding a delta: it deletes them, then inserts the replay's
rows under one fixed ``source`` (``SOURCE``). Killed anywhere, the unit is run again and
does the same; a second run of a whole job leaves every table as the first did.

Two kinds of unit split the data so that every row has exactly one writer:

* ``Labelled`` (tenant, k of n): the traces with a span, or a labelled sample, in the
  range whose ``cityHash64(trace id) % n == k``, each with *all* its spans and labelled
  samples whatever their time (so a trace is never cut by a bucket boundary), and the
  samples labelled with a span id alone whose span was never stored, by the same hash of
  the span id. It owns the ``link``, ``link+time`` and ``link+share`` rows of those.
* ``Unlabelled`` (tenant, service, [lo, hi)): the unlabelled samples of the service,
  placed by thread or time among every span open around them (``MARGIN_NS`` either side,
  and up to the end of the longest span it owns). It owns the ``thread`` and ``window``
  rows of the service's spans that *start* in [lo, hi), and the service's
  ``unattributed_cpu`` minutes in [lo, hi): a span that crosses a boundary gets all of its
  CPU from the one unit it starts in, a minute's unattributed CPU from the one unit it
  lies in.

Conservation: a unit's replay puts every nanosecond of CPU it reads on a span or into
the unattributed count (``Figures``); a unit where the two differ, or where what the
store holds after the insert differs from what was inserted, fails with the figures.

The aggregate tables the views fill from these rows are rebuilt afterwards for the span
starts the units touched (``aggregates.rebuild``, phase 3 of ``job``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from pipeline.backfill.aggregates import mutations_done
from pipeline.records import Attribution, AttributionBatch, Sample, Unattributed
from pipeline.registry import Store
from processors.correlate import readback
from processors.correlate.accumulators import LABELLED_METHODS, MINUTE_NS, THREAD, WINDOW
from processors.correlate.messages import source_id
from processors.correlate.reconcile import UNATTRIBUTED, expected

SOURCE = source_id("spanprof backfill")  # every row a backfill writes ...
SOURCE_AROUND = source_id("spanprof backfill, around")  # ... but the CPU a span owned by
# an ``Unlabelled`` unit gets from samples of a neighbouring unit's time
METHODS = ("link", "link+time", "link+share", "thread", "window")
MARGIN_NS = 60 * 10**9  # spans and samples read beyond a bucket: clock skew and grace
TRACES_PER_UNIT = 10_000  # labelled units are planned this big (a DELETE per table each)
CHUNK_TRACES = 10_000  # traces read and replayed at a time within a unit
BUCKET_NS = 600 * 10**9  # unlabelled units: 10 minutes of a service
ROW_TABLES = ("span_attribution", "span_functions", "span_stacks")


def methods_of(spec: str) -> tuple[str, ...]:
    """``all`` or a comma-separated list of ``METHODS``: the rows a job recomputes.
    ``ValueError`` naming what is allowed otherwise."""
    if spec == "all":
        return METHODS
    got = tuple(m.strip() for m in spec.split(",") if m.strip())
    if not got or [m for m in got if m not in METHODS]:
        raise ValueError(f"method: expected all or a comma-separated list of "
                         f"{', '.join(METHODS)}, got {spec[:80]!r}")
    return got


class Labelled(msgspec.Struct, tag="labelled", kw_only=True):
    tenant: str
    lo_ns: int
    hi_ns: int
    k: int
    n: int

    @property
    def id(self) -> str:
        return f"labelled/{self.tenant}/{self.k}of{self.n}"


class Unlabelled(msgspec.Struct, tag="unlabelled", kw_only=True):
    tenant: str
    service: str
    lo_ns: int
    hi_ns: int

    @property
    def id(self) -> str:
        return f"unlabelled/{self.tenant}/{self.service}/{self.lo_ns}"


class Figures(msgspec.Struct):
    cpu_in: int = 0  # CPU of the samples replayed
    cpu_attributed: int = 0  # of it, on spans
    cpu_unattributed: int = 0  # of it, counted unattributed
    rows_read: int = 0  # spans and samples read
    rows_written: int = 0
    lo_ns: int = 0  # span starts of the rows written (aggregates to rebuild)
    hi_ns: int = 0

    def touch(self, start_ns: int) -> None:
        if start_ns <= 0:
            return
        self.lo_ns = start_ns if not self.lo_ns else min(self.lo_ns, start_ns)
        self.hi_ns = max(self.hi_ns, start_ns + 1)

    def balanced(self) -> bool:
        return self.cpu_in == self.cpu_attributed + self.cpu_unattributed


class Unbalanced(Exception):
    """A unit whose CPU does not add up: its figures are in the message."""


Send = Callable[[AttributionBatch], Awaitable[None]]


async def _rows(store: Store, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    return (await store.query(sql.replace("{db}", store.database), dict(params)))[1]


def _range(lo_ns: int, hi_ns: int) -> str:
    return (f"{{col}} >= fromUnixTimestamp64Nano(toInt64({lo_ns})) AND "
            f"{{col}} < fromUnixTimestamp64Nano(toInt64({hi_ns}))")


async def plan(store: Store, lo_ns: int, hi_ns: int, tenant: str | None = None
               ) -> list[Labelled | Unlabelled]:
    """The units covering [lo_ns, hi_ns) of every tenant (or of ``tenant``), the range
    widened to whole minutes (an unattributed minute is one unit's or none's)."""
    lo_ns, hi_ns = lo_ns - lo_ns % MINUTE_NS, -(-hi_ns // MINUTE_NS) * MINUTE_NS
    where_t = "AND tenant = {tenant:String}" if tenant is not None else ""
    p = {"tenant": tenant or ""}
    span_r, smp_r = _range(lo_ns, hi_ns).format(col="Timestamp"), \
        _range(lo_ns, hi_ns).format(col="time")
    units: list[Labelled | Unlabelled] = []
    for t, count in await _rows(store, f"""
SELECT tenant, uniqExactIf(key, key != '') FROM (
    SELECT tenant, TraceId AS key FROM {{db}}.otel_traces WHERE {span_r} {where_t}
    UNION ALL
    SELECT tenant, trace_id AS key FROM {{db}}.profile_samples
    WHERE {smp_r} AND span_id != '' {where_t}
) GROUP BY tenant ORDER BY tenant""", **p):
        # units sized by traces: samples labelled with a span id alone (key '') mostly
        # belong to a stored span's trace; the others, orphans, are hashed by span id, and
        # a tenant with only those still has its one unit
        n = max(1, -(-int(count) // TRACES_PER_UNIT))
        units += [Labelled(tenant=str(t), lo_ns=lo_ns, hi_ns=hi_ns, k=k, n=n) for k in range(n)]
    # a service's buckets with a span start or an unlabelled sample in them: a bucket
    # with neither owns nothing (no span, no minute with CPU)
    bucket = f"intDiv(toUnixTimestamp64Nano(at), {BUCKET_NS})"
    for t, svc, b in await _rows(store, f"""
SELECT tenant, svc, {bucket} AS b FROM (
    SELECT tenant, ServiceName AS svc, Timestamp AS at FROM {{db}}.otel_traces
    WHERE {span_r} {where_t}
    UNION ALL
    SELECT tenant, service, time FROM {{db}}.profile_samples
    WHERE {smp_r} AND span_id = '' AND measure IN ('cpu', 'wall', 'lock', 'alloc') {where_t}
) WHERE (tenant, svc) IN (
    SELECT tenant, service FROM {{db}}.profile_samples
    WHERE {_range(lo_ns - MARGIN_NS, hi_ns + MARGIN_NS).format(col="time")}
      AND span_id = '' AND measure IN ('cpu', 'wall', 'lock', 'alloc') {where_t})
GROUP BY tenant, svc, b ORDER BY tenant, svc, b""", **p):
        units.append(Unlabelled(tenant=str(t), service=str(svc),
                                lo_ns=max(lo_ns, int(b) * BUCKET_NS),
                                hi_ns=min(hi_ns, (int(b) + 1) * BUCKET_NS)))
    return units


async def run(store: Store, unit: Labelled | Unlabelled, methods: tuple[str, ...],
              send: Send) -> Figures:
    """Replace the rows ``unit`` owns of ``methods`` with the replay's; ``send`` stores an
    ``AttributionBatch`` durably (the exporter's ``consume``). ``Unbalanced`` when the CPU
    does not add up (nothing is written then)."""
    if isinstance(unit, Labelled):
        return await _labelled(store, unit, methods, send)
    return await _unlabelled(store, unit, methods, send)


async def _labelled(store: Store, u: Labelled, methods: tuple[str, ...], send: Send
                    ) -> Figures:
    mine = "cityHash64(key) % {n:UInt64} = {k:UInt64}"
    p = {"tenant": u.tenant, "n": u.n, "k": u.k}
    span_r, smp_r = _range(u.lo_ns, u.hi_ns).format(col="Timestamp"), \
        _range(u.lo_ns, u.hi_ns).format(col="time")
    traces = sorted(str(r[0]) for r in await _rows(store, f"""
SELECT DISTINCT key FROM (
    SELECT TraceId AS key FROM {{db}}.otel_traces WHERE tenant = {{tenant:String}} AND {span_r}
    UNION ALL
    SELECT trace_id FROM {{db}}.profile_samples WHERE tenant = {{tenant:String}} AND {smp_r}
      AND trace_id != '' AND span_id != ''
    UNION ALL
    SELECT trace_id FROM {{db}}.span_index WHERE tenant = {{tenant:String}} AND span_id IN (
        SELECT span_id FROM {{db}}.profile_samples WHERE tenant = {{tenant:String}}
          AND {smp_r} AND trace_id = '' AND span_id != '')
) WHERE key != '' AND {mine}""", **p))
    orphans = sorted(str(r[0]) for r in await _rows(store, f"""
SELECT DISTINCT span_id AS key FROM {{db}}.profile_samples
WHERE tenant = {{tenant:String}} AND {smp_r} AND trace_id = '' AND span_id != ''
  AND span_id NOT IN (SELECT span_id FROM {{db}}.span_index WHERE tenant = {{tenant:String}})
  AND {mine}""", **p))
    keep = tuple(m for m in methods if m in LABELLED_METHODS)
    fig = Figures()
    for i in range(0, max(len(traces), 1), CHUNK_TRACES):
        chunk = traces[i:i + CHUNK_TRACES]
        extra = orphans if i == 0 else []
        if not chunk and not extra:
            continue
        spans, samples, stacks, _ = await readback.load(store, u.tenant, chunk,
                                                            with_stored=False)
        samples += await _orphan_samples(store, u.tenant, extra)
        if extra:
            stacks.update(await readback.stacks_of(store, u.tenant, samples))
        rows = await asyncio.to_thread(expected, spans, samples, stacks)
        _balance(fig, samples, rows, len(spans))
        out = [r for r in rows if r.method in keep]
        for r in out:
            r.source = SOURCE
        span_ids = sorted({s.span_id.hex() for s in spans} | set(extra))
        scope = ("tenant = {tenant:String} AND method IN {m:Array(String)} AND "
                 "(trace_id IN {t:Array(String)} OR "
                 "(trace_id = '' AND span_id IN {s:Array(String)}))")
        params = {"tenant": u.tenant, "m": list(keep), "t": chunk, "s": span_ids}
        # the minutes of the rows replaced count as touched, even where no new row comes
        # (a span whose CPU moved elsewhere): their aggregates are rebuilt too
        (lo, hi), = await _rows(store, "SELECT toUnixTimestamp64Nano(min(start_time)), "
                                "toUnixTimestamp64Nano(max(start_time)) FROM "
                                f"{{db}}.span_attribution WHERE {scope} AND span_known = 1",
                                **params)
        if int(hi) > 0:
            fig.touch(int(lo))
            fig.touch(int(hi))
        if deleted := await _delete(store, ROW_TABLES, scope, params):
            await mutations_done(store, deleted)
        await _write(u.tenant, out, [], send, fig)
        stored = await _rows(store, """
SELECT sum(cpu_ns) FROM {db}.span_attribution FINAL WHERE tenant = {tenant:String}
  AND method IN {m:Array(String)} AND (trace_id IN {t:Array(String)}
  OR (trace_id = '' AND span_id IN {s:Array(String)}))""",
                             tenant=u.tenant, m=list(keep), t=chunk, s=span_ids)
        _check_stored(u.id, int(stored[0][0] or 0), sum(r.cpu_ns for r in out))
    return fig


async def _unlabelled(store: Store, u: Unlabelled, methods: tuple[str, ...], send: Send
                      ) -> Figures:
    own_r = _range(u.lo_ns, u.hi_ns).format(col="Timestamp")
    p = {"tenant": u.tenant, "svc": u.service}
    (end, ), = await _rows(store, f"""
SELECT max(toUnixTimestamp64Nano(Timestamp) + Duration) FROM {{db}}.otel_traces
WHERE tenant = {{tenant:String}} AND ServiceName = {{svc:String}} AND {own_r}""", **p)
    lo, hi = u.lo_ns - MARGIN_NS, max(u.hi_ns, int(end or 0)) + MARGIN_NS
    got = await readback.load_unlabelled(store, u.tenant, u.service, lo, hi,
                                         with_stored=False)
    if got is None:
        raise Unbalanced(f"{u.id}: more spans or samples than a unit replays "
                         f"({readback.MAX_SERVICE_SPANS} spans, {readback.MAX_SERVICE_SAMPLES} "
                         "samples): split the range")
    spans, samples, stacks, _ = got
    # the unit's own samples (taken in [lo, hi): its figures, its unattributed minutes)
    # and the others read (around it: only their CPU on the spans it owns), replayed
    # apart (a sample's place does not depend on other samples) and written under two
    # sources, so that the rows of both for one span are kept side by side
    own = [s for s in samples if u.lo_ns <= s.time_ns < u.hi_ns]
    rows = await asyncio.to_thread(expected, spans, own, stacks)
    fig = Figures()
    _balance(fig, own, rows, len(spans))
    rest = await asyncio.to_thread(
        expected, spans, [s for s in samples if not u.lo_ns <= s.time_ns < u.hi_ns], stacks)
    keep = tuple(m for m in methods if m in (THREAD, WINDOW))
    owned = {(s.trace_id, s.span_id) for s in spans if u.lo_ns <= s.start_ns < u.hi_ns}
    out = []
    for source, got_rows in ((SOURCE, rows), (SOURCE_AROUND, rest)):
        for r in got_rows:
            if r.method in keep and (r.trace_id, r.span_id) in owned:
                r.source = source
                out.append(r)
    minutes = [Unattributed(u.service, int.from_bytes(r.span_id, "big"), r.cpu_ns, r.wall_ns,
                            r.sample_count, SOURCE)
               for r in rows if r.method == UNATTRIBUTED]
    deleted = await _delete(
        store, ROW_TABLES,
        "tenant = {tenant:String} AND method IN {m:Array(String)} AND "
        "(trace_id, span_id) IN (SELECT TraceId, SpanId FROM {db}.otel_traces "
        "WHERE tenant = {tenant:String} AND ServiceName = {svc:String} AND "
        f"{own_r})", {**p, "m": list(keep)})
    lo_m, hi_m = _minutes(u.lo_ns), _minutes(u.hi_ns)
    if owned:  # their rows, old and new, start in the unit
        fig.touch(u.lo_ns)
        fig.touch(u.hi_ns - 1)
    deleted += await _delete(store, ("unattributed_cpu",),
                             "tenant = {tenant:String} AND service = {svc:String} AND "
                             "minute >= toDateTime({lo:UInt32}) AND "
                             "minute < toDateTime({hi:UInt32})",
                             {**p, "lo": lo_m, "hi": hi_m})
    if deleted:
        await mutations_done(store, deleted)
    await _write(u.tenant, out, minutes, send, fig)
    (got_cpu, ), = await _rows(store, f"""
SELECT (SELECT sum(cpu_ns) FROM {{db}}.span_attribution FINAL WHERE tenant = {{tenant:String}}
          AND method IN {{m:Array(String)}} AND (trace_id, span_id) IN (SELECT TraceId, SpanId
          FROM {{db}}.otel_traces WHERE tenant = {{tenant:String}}
          AND ServiceName = {{svc:String}} AND {own_r}))
     + (SELECT sum(cpu_ns) FROM {{db}}.unattributed_cpu FINAL WHERE tenant = {{tenant:String}}
          AND service = {{svc:String}} AND minute >= toDateTime({{lo:UInt32}})
          AND minute < toDateTime({{hi:UInt32}}))""", **p, m=list(keep), lo=lo_m, hi=hi_m)
    _check_stored(u.id, int(got_cpu or 0),
                  sum(r.cpu_ns for r in out) + sum(m.cpu_ns for m in minutes))
    return fig


async def _delete(store: Store, tables: tuple[str, ...], where: str,
                  params: dict[str, Any]) -> list[str]:
    """Delete the rows ``where`` selects from each of ``tables`` that has any (those tables are
    returned): a lightweight ``DELETE`` costs a mutation of every part even when it matches
    nothing (most of a backfill's time into an empty store, were it run regardless). Not
    waited for one by one (each waited about a second for background merges): the caller
    waits for all of a unit's (``mutations_done`` on the tables returned) before it writes
    (rows written after a DELETE are never touched by it, but a DELETE that cannot be done
    must fail the unit before its rows are added, and one whose WHERE reads otel_traces
    reads it when it runs)."""
    where = where.replace("{db}", store.database)
    counts = " UNION ALL ".join(
        f"SELECT {i}, count() FROM (SELECT 1 FROM {store.database}.{t} WHERE {where} LIMIT 1)"
        for i, t in enumerate(tables))
    deleted = [tables[int(i)] for i, n in (await store.query(counts, params))[1] if n]
    for table in deleted:
        await store.command(f"DELETE FROM {store.database}.{table} WHERE {where} "
                            "SETTINGS lightweight_deletes_sync = 0", params)
    return deleted


def _minutes(ns: int) -> int:
    """The first whole minute at or after ``ns``, in seconds (unit bounds are minutes
    unless a range starts mid-minute: that minute belongs to the unit it starts in)."""
    return -(-ns // MINUTE_NS) * 60


async def _orphan_samples(store: Store, tenant: str, span_ids: list[str]) -> list[Sample]:
    """The samples labelled with one of these span ids alone (their span never stored)."""
    if not span_ids:
        return []
    return [Sample(b"", bytes.fromhex(s), svc, int(tns), int(stack), m,
                   int(v), int(c), str(st), str(un), int(th), str(tn), str(sn), int(pid),
                   str(host), bool(timed))
            for s, svc, tns, stack, m, v, c, st, un, th, tn, sn, pid, host, timed
            in await _rows(store, """
SELECT span_id, service, toUnixTimestamp64Nano(time), stack_id, measure, value, count,
       sample_type, unit, thread_id, thread_name, span_name, pid, host, timed
FROM {db}.profile_samples WHERE tenant = {tenant:String} AND trace_id = ''
  AND span_id IN {s:Array(String)} AND measure IN ('cpu', 'wall', 'lock', 'alloc')""",
                           tenant=tenant, s=span_ids)]


def _balance(fig: Figures, samples: list[Sample], rows: list[Attribution], spans: int) -> None:
    """Add a replay's figures; ``Unbalanced`` if it lost or made up CPU."""
    cpu_in = sum(s.value for s in samples if s.measure == "cpu")
    on_spans = sum(r.cpu_ns for r in rows if r.method != UNATTRIBUTED)
    left = sum(r.cpu_ns for r in rows if r.method == UNATTRIBUTED)
    fig.cpu_in += cpu_in
    fig.cpu_attributed += on_spans
    fig.cpu_unattributed += left
    fig.rows_read += spans + len(samples)
    if cpu_in != on_spans + left:
        raise Unbalanced(f"CPU in {cpu_in} ns != attributed {on_spans} + unattributed "
                         f"{left} ns")


def _check_stored(unit: str, stored: int, written: int) -> None:
    if stored != written:
        raise Unbalanced(f"{unit}: the store holds {stored} ns of CPU for the unit's rows "
                         f"after the insert, {written} ns were written")


async def _write(tenant: str, rows: list[Attribution], minutes: list[Unattributed],
                 send: Send, fig: Figures) -> None:
    for r in rows:
        if r.span_known:
            fig.touch(r.start_ns)
    for j in range(0, max(len(rows), 1), 20_000):
        batch = AttributionBatch(rows[j:j + 20_000], minutes if j == 0 else [], tenant=tenant)
        if len(batch):
            await send(batch)
    fig.rows_written += len(rows) + len(minutes)

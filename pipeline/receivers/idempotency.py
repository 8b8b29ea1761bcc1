"""A request sent again is delivered once.

OTLP exporters and Pyroscope SDKs resend a request when they got no answer in time (their
timeout) or were told to retry. When the first attempt was in fact accepted and is still on
its way to durable storage (an insert retried under its deduplication token while
ClickHouse is down), or was stored after the client gave up, delivering the resend too would
store and attribute the same spans and samples twice (seen in the fault run: 100 samples
twice after a 60 s outage).

So each receiver keys a request by a hash of what it delivers (the signal or path, and the
body as received) and:

* runs the delivery in a task of its own, which the client's cancellation (a deadline, a
  closed connection) does not stop: data accepted is either stored or refused, whatever
  the client's patience;
* lets a resend that arrives while that task runs wait for it, and share its outcome (an
  error too: then the client retries again, and nothing was stored);
* does not keep a client waiting on a store that is failing: when the store says its
  inserts are failing (``stalled``: the ``clickhouse`` exporter retrying a block that may
  have landed, under its deduplication token), the client is answered ``Retryable`` with
  the store's delay while the delivery goes on; its resend then waits again, or is answered
  at once once the delivery is done (the fault run saw 30 s client timeouts without this);
* answers a resend of a request delivered in the last ``RECENT_S`` seconds with success at
  once, without delivering it again (at most ``RECENT_MAX`` remembered).

Identical bodies are duplicates by construction: spans carry their ids, and two profile
requests with the same samples, stacks and times are one profile sent twice. The window is
one process's memory, plus what the store says: each row carries its request's id
(``request``), and a receiver whose pipeline ends in a ``clickhouse`` exporter reads the ids
stored in the last ``RECENT_S`` when it starts, so that a request stored but not yet
acknowledged when the process was killed, and resent to the restarted one, is answered
without being stored again. A resend that reaches another gateway of the Kafka tier is not
recognised (the raw tables still collapse repeated spans; samples would count twice).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import xxhash

from pipeline.errors import Retryable
from pipeline.records import DEFAULT_TENANT

RECENT_S = 600.0  # how long a delivered request is remembered (clients give up well before)
RECENT_MAX = 100_000  # at most this many remembered (oldest forgotten first)
STALL_CHECK_S = 0.2  # how often a waiting client's delivery is checked against ``stalled``


def request_key(*parts: bytes | str) -> int:
    """A 64-bit id of the request, from a digest of the parts (each length-prefixed, so
    that parts cannot run into each other); never 0, which means "not known" in the
    tables. Two different requests among the 100 000 remembered share an id with a
    probability of about 3e-10. XXH3 (64 bits): a gateway hashes every byte it receives,
    and SHA-256 cost 0.28 us per span of a 500-span request (6% of a gateway's CPU per
    span), XXH3 0.01. It is not a cryptographic hash: a client could make two of its own
    requests share an id (the second then answered as a resend, unstored), but another
    tenant's ids are apart (``tenant_request_key``), and a default tenant's clients are
    one party. Ids written by a version that used SHA-256 are not recognised after an
    upgrade: a request resent across it is stored again."""
    h = xxhash.xxh3_64()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.intdigest() or 1


def tenant_request_key(tenant: str, *parts: bytes | str) -> int:
    """``request_key`` of a tenant's request: the same bytes sent by two tenants are two
    requests. The default tenant's ids are ``request_key``'s (as before tenants were)."""
    return request_key(*parts) if tenant == DEFAULT_TENANT else request_key(*parts, tenant)


async def stored_request_ids(store: Any, seconds: float = RECENT_S,
                             limit: int = RECENT_MAX) -> list[int]:
    """The ids of the requests whose rows were stored in the last ``seconds`` (the
    ``request`` column of ``otel_traces`` and ``profile_samples``): what a receiver that
    just started has stored without, perhaps, having acknowledged it."""
    return await _stored_requests(
        store, f"ingested_at >= now() - {int(seconds)} AND request != 0", int(limit))


async def stored_among(store: Any, keys: list[int], since: float,
                       chunk: int = 2_000) -> set[int]:
    """Which of the request ids ``keys`` have rows stored since unix time ``since``
    (``otel_traces`` and ``profile_samples``), whatever their number."""
    found: set[int] = set()
    for i in range(0, len(keys), chunk):
        ids = ",".join(str(int(k)) for k in keys[i:i + chunk])
        found.update(await _stored_requests(
            store, f"ingested_at >= toDateTime({int(since)}) AND request IN ({ids})"))
    return found


async def _stored_requests(store: Any, where: str, limit: int | None = None) -> list[int]:
    """The distinct request ids of the rows of ``otel_traces`` and ``profile_samples``
    matching ``where`` (at most ``limit``)."""
    db = store.database
    sql = (f"SELECT DISTINCT request FROM {db}.otel_traces WHERE {where} UNION DISTINCT "
           f"SELECT DISTINCT request FROM {db}.profile_samples WHERE {where}")
    if limit is not None:
        sql = f"SELECT request FROM ({sql}) LIMIT {limit}"
    _, rows = await store.query(sql)
    return [int(r[0]) for r in rows]


class RecentRequests:
    """Deliveries in flight and recently done, by request key (see the module docstring)."""

    def __init__(self, recent_s: float = RECENT_S, max_entries: int = RECENT_MAX,
                 clock: Callable[[], float] = time.monotonic,
                 stalled: Callable[[], float | None] | None = None) -> None:
        self.recent_s = recent_s
        # the store's delay before its next insert attempt while its inserts fail, else None
        self.stalled = stalled
        self.max_entries = max_entries
        self.clock = clock
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._done: OrderedDict[int, float] = OrderedDict()  # key -> when delivered
        self.duplicates = 0
        self.loaded = False  # the store's recent ids read (once per instance)

    def __repr__(self) -> str:
        return (f"<RecentRequests inflight={len(self._inflight)} done={len(self._done)} "
                f"duplicates={self.duplicates}>")

    def _forget_old(self, now: float) -> None:
        done = self._done
        while done and (len(done) > self.max_entries
                        or next(iter(done.values())) + self.recent_s < now):
            done.popitem(last=False)

    def preload(self, keys: list[int]) -> None:
        """Requests already stored (by an earlier run of this process: its rows say so),
        remembered as delivered now."""
        now = self.clock()
        for key in keys:
            self._done[key] = now
        self._forget_old(now)

    async def deliver(self, key: int, deliver: Callable[[], Awaitable[None]]) -> bool:
        """Deliver once per key; True when this call was a duplicate (nothing delivered by
        it). Raises what the delivery raised, to the first caller and to resends alike."""
        self._forget_old(self.clock())
        if key in self._done:
            self.duplicates += 1
            return True
        task = self._inflight.get(key)
        if task is not None:
            self.duplicates += 1
            await self._wait(task)
            return True
        task = asyncio.ensure_future(self._run(key, deliver))
        self._inflight[key] = task
        await self._wait(task)
        return False

    async def _wait(self, task: asyncio.Task[None]) -> None:
        """The delivery's outcome; ``Retryable`` at once (the delivery going on) when the
        store says its inserts are failing."""
        if self.stalled is None:
            await asyncio.shield(task)
            return
        while True:
            done, _ = await asyncio.wait({task}, timeout=STALL_CHECK_S)  # never cancels it
            if done:
                task.result()  # raises what the delivery raised
                return
            delay = self.stalled()
            if delay is not None:
                raise Retryable("the request is accepted and being written, but the store is "
                                f"failing; retry in {delay:.0f}s to learn its outcome",
                                retry_after=delay)

    async def _run(self, key: int, deliver: Callable[[], Awaitable[None]]) -> None:
        try:
            await deliver()
            self._done[key] = self.clock()
        finally:
            del self._inflight[key]
            # a failure nobody awaits any more (its client gone) is not an unhandled error
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


async def preload_recent(recent: RecentRequests, ctx: Any, log: Any) -> None:
    """At a receiver's start: remember the requests its store holds from the last minutes
    (``ctx.store``, given by the graph when the receiver's pipelines end in a
    ``clickhouse`` exporter). A store that cannot be read is logged: resends are then
    recognised from this run on only."""
    store = getattr(ctx, "store", None)
    if store is None or recent.loaded:
        return  # no store, or read already by a server sharing ``recent``
    recent.loaded = True
    try:
        ids = await stored_request_ids(store)
    except Exception as err:
        log.warning("recent_requests_unreadable", error=str(err)[:300])
        return
    recent.preload(ids)
    log.info("recent_requests_loaded", requests=len(ids))

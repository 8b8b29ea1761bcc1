"""``batch``: merges small batches into bigger ones before the next stage.

Many SDKs export a handful of spans per request; ClickHouse wants thousands of rows per
insert. Callers still learn the truth: each one awaits the send of the merged batch that
contains its data, and gets its error if that send fails. Tenants are batched apart (a batch
is one tenant's)::

    processors:
      batch:
        send_batch_size: 8192   # send as soon as this many items are waiting
        timeout: 200ms          # or when the oldest waiting item is this old
"""

from __future__ import annotations

import asyncio

import msgspec

from pipeline.component import Consumer
from pipeline.config import NonNegDuration, PositiveInt
from pipeline.errors import ConfigError
from pipeline.records import Batch, concat
from pipeline.registry import Context, Factory


class Config(msgspec.Struct, forbid_unknown_fields=True):
    send_batch_size: PositiveInt = 8192
    timeout: NonNegDuration = NonNegDuration(0.2)  # 0: send at once

    def validate(self) -> None:
        if self.send_batch_size < 1:
            raise ConfigError("send_batch_size: must be at least 1")


class BatchProcessor:
    def __init__(self, cfg: Config, ctx: Context, signal: str) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.next: Consumer = ctx.next[signal]
        self._items: list[Batch] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sends: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<BatchProcessor {self.ctx.id} waiting={self._size} sending={len(self._sends)}>"

    async def start(self) -> None:
        pass

    async def consume(self, batch: Batch) -> None:
        if not len(batch):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._items.append(batch)
        self._waiters.append(fut)
        self._size += len(batch)
        if self._size >= self.cfg.send_batch_size:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(float(self.cfg.timeout),
                                                                self._send)
        await fut

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._items:
            return
        items, waiters = self._items, self._waiters
        self._items, self._waiters, self._size = [], [], 0
        # one batch per tenant: a batch never mixes them (pipeline.records.concat)
        groups: dict[str, tuple[list[Batch], list[asyncio.Future[None]]]] = {}
        for item, waiter in zip(items, waiters, strict=True):
            group = groups.setdefault(item.tenant, ([], []))
            group[0].append(item)
            group[1].append(waiter)
        for group_items, group_waiters in groups.values():
            task = asyncio.create_task(self._deliver(concat(group_items), group_waiters))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _deliver(self, batch: Batch, waiters: list[asyncio.Future[None]]) -> None:
        try:
            await self.next.consume(batch)
        except Exception as err:
            for w in waiters:
                if not w.done():
                    w.set_exception(err)
        else:
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def shutdown(self) -> None:
        self._send()
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)


def create(cfg: Config, ctx: Context) -> BatchProcessor:
    (signal,) = ctx.next
    return BatchProcessor(cfg, ctx, signal)


FACTORY = Factory(type="batch", kind="processor", config=Config, create=create,
                  signals=("traces", "profiles", "attributions"))

"""The in-memory broker's consumer: the only member of its group (see ``memory.py``).

At ``start`` it is assigned every partition of its subscribed topics (the listener hears
``on_partitions_assigned``) and starts from the group's committed offset, else from
``initial_offset``; ``getmany`` serves the unpaused partitions from their positions, up to
``max_poll_records`` in all (taking turns, so that no partition starves), waiting up to
``timeout_ms`` for a write; ``highwater`` is the end offset the last fetch saw;
``pause``/``resume``/``seek``/``position``/``commit`` refuse a partition that is not
assigned (``IllegalStateError``), and a commit refuses metadata over the broker's
``offset.metadata.max.bytes`` (4096), as aiokafka and Kafka do. A position past the end
is reset by ``initial_offset``, as Kafka resets an out-of-range offset.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING, Literal

from aiokafka.errors import ConsumerStoppedError, IllegalStateError, OffsetMetadataTooLargeError

from pipeline.kafka.backend import (
    Committed,
    ConsumerOptions,
    RebalanceListener,
    Record,
    TopicPartition,
)
from pipeline.kafka.memory import raised

if TYPE_CHECKING:
    from pipeline.kafka.memory import MemoryBroker

# the broker's offset.metadata.max.bytes default
MAX_METADATA_BYTES = 4096


class MemoryConsumer:
    """``backend.Consumer``: the only member of its group on a ``MemoryBroker``."""

    def __init__(self, broker: MemoryBroker, opts: ConsumerOptions) -> None:
        self.broker = broker
        self.opts = opts
        self.state: Literal["new", "started", "stopped"] = "new"
        self.topics: list[str] = []
        self.listener: RebalanceListener | None = None
        # what the component asked of it, for tests (pause, seek, commit, ...)
        self.calls: Counter[str] = Counter()
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._highwater: dict[TopicPartition, int] = {}
        self._turn = itertools.count()

    def __repr__(self) -> str:
        pos = {f"{tp.topic}/{tp.partition}": o for tp, o in sorted(self._positions.items())}
        paused = sorted(f"{tp.topic}/{tp.partition}" for tp in self._paused)
        return f"<MemoryConsumer {self.opts.group_id} {self.state} positions={pos} " \
               f"paused={paused}>"

    def subscribe(self, topics: list[str], listener: RebalanceListener) -> None:
        self.topics, self.listener = list(topics), listener

    async def start(self) -> None:
        await self.broker._gate("start")
        group = self.opts.group_id
        other = self.broker.members.get(group)
        if other is not None and other.state == "started":
            raise RuntimeError(f"MemoryBroker: group {group!r} has a live member; the fake "
                               "holds one member per group (no rebalances)")
        self.state = "started"
        self.broker.members[group] = self
        self._assigned = {TopicPartition(t, p) for t in self.topics if t in self.broker.logs
                          for p in range(len(self.broker.logs[t]))}
        if self.listener is not None:
            await self.listener.on_partitions_assigned(set(self._assigned))

    async def stop(self) -> None:
        if self.state == "started" and self.broker.members.get(self.opts.group_id) is self:
            del self.broker.members[self.opts.group_id]
        self.state = "stopped"

    def partitions(self, topic: str) -> set[int] | None:
        parts = self.broker.logs.get(topic)
        return set(range(len(parts))) if parts is not None else None

    async def refresh_metadata(self) -> None:
        await self.broker._gate("metadata")

    async def committed(self, tps: Collection[TopicPartition]
                        ) -> dict[TopicPartition, tuple[int, str]]:
        await self.broker._gate("fetch")
        group = self.broker.groups.get(self.opts.group_id, {})
        return {tp: group[tp] for tp in tps if tp in group}

    async def commit(self, offsets: Committed) -> None:
        self.calls["commit"] += 1
        for tp, (_, metadata) in offsets.items():
            self._check(tp)
            if len(metadata.encode()) > MAX_METADATA_BYTES:
                raise OffsetMetadataTooLargeError(f"{tp}: {len(metadata.encode())} bytes")
        fault = await self.broker._gate("commit")
        self.broker.groups.setdefault(self.opts.group_id, {}).update(offsets)
        if fault is not None and fault.error is not None:  # stored, the answer lost
            raise raised(fault.error)

    async def getmany(self, *, timeout_ms: int) -> dict[TopicPartition, list[Record]]:
        self.calls["getmany"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while True:
            if self.state == "stopped":
                raise ConsumerStoppedError()
            await self.broker._gate("fetch")
            got = self._take()
            left = deadline - loop.time()
            if got or left <= 0:
                return got
            await self.broker._wait(left)

    def _take(self) -> dict[TopicPartition, list[Record]]:
        tps = sorted(self._assigned - self._paused)
        if not tps:
            return {}
        turn = next(self._turn) % len(tps)
        budget = self.opts.max_poll_records
        out: dict[TopicPartition, list[Record]] = {}
        for tp in tps[turn:] + tps[:turn]:
            log = self.broker._log(tp)
            at = self._position(tp)
            if at > len(log):  # out of range: reset as a new group would
                at = self._positions[tp] = 0 if self.opts.initial_offset == "earliest" \
                    else len(log)
            self._highwater[tp] = len(log)
            recs = log[at:at + budget]
            if recs:
                out[tp] = list(recs)
                self._positions[tp] = at + len(recs)
                budget -= len(recs)
        return out

    def _position(self, tp: TopicPartition) -> int:
        if tp not in self._positions:
            got = self.broker.committed(self.opts.group_id, tp)
            if got is not None and got[0] >= 0:
                self._positions[tp] = got[0]
            else:
                end = len(self.broker._log(tp))
                self._positions[tp] = 0 if self.opts.initial_offset == "earliest" else end
        return self._positions[tp]

    def _check(self, tp: TopicPartition) -> None:
        if self.state == "stopped":
            raise ConsumerStoppedError()
        if tp not in self._assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def highwater(self, tp: TopicPartition) -> int | None:
        self._check(tp)
        return self._highwater.get(tp)

    async def position(self, tp: TopicPartition) -> int:
        self._check(tp)
        return self._position(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._check(tp)
        if offset < 0:
            raise ValueError("Offset must be a positive integer")
        self.calls["seek"] += 1
        self._positions[tp] = offset
        self.broker._wake()

    def pause(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._check(tp)
        self.calls["pause"] += 1
        self._paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._check(tp)
        self.calls["resume"] += 1
        self._paused.difference_update(tps)
        self.broker._wake()

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)


"""Insert blocks of a Kafka partition that come out the same after any crash.

The correlator tier writes what it derives from Kafka messages into ClickHouse before it
commits their offsets. A worker that dies between the two leaves the messages to be read
again, by itself or by whichever worker takes the partition; their rows must then not count
twice. Raw tables deduplicate by key (``ReplacingMergeTree``), but the aggregates that
ClickHouse maintains by materialized views add every inserted block, so a block must reach
them once: it is inserted under an ``insert_deduplication_token``, which ClickHouse drops on
a second sight (and then does not feed the views), and the second worker must build *the
same block*, message for message.

One block per message would make that trivial and throughput miserable (each block is an
insert into several tables and views). So blocks span many messages, and their boundaries
are recorded before the insert in the one place every worker of the group reads on
assignment: the offset commit's metadata. The sequence per partition is

1. plan: commit the current offset again, with metadata naming the ranges about to be
   inserted (``spb1:FIRST-LAST,FIRST-LAST``);
2. insert each range as one block whose token names the partition, the range and a CRC of
   the messages' bytes (a recreated topic that reuses offsets does not collide);
3. commit the offset after the last range, with empty metadata.

A worker that starts on a partition whose committed metadata holds a plan first rebuilds
those ranges exactly (waiting for their last message if one fetch did not bring it), and
only then cuts new ones. An operator's offset reset writes no plan, so a deliberate replay
is cut afresh: spans and per-span totals still come out once (tables keyed by span id, and
each message's rows carry the message's own ``source``), but raw samples and the
per-operation aggregates of blocks cut differently count again.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PLAN_PREFIX = "spb1:"
# Kafka's default offset.metadata.max.bytes is 4096: leave room
MAX_PLAN_CHARS = 3_000


@dataclass(slots=True)
class Entry:
    """One message: its offset, its decoded batch (None: malformed or empty), its items,
    its Kafka timestamp (ms)."""

    offset: int
    value: bytes
    batch: Any
    items: int
    timestamp: int = 0


@dataclass(slots=True)
class Block:
    topic: str
    partition: int
    first: int
    last: int
    entries: list[Entry]

    @property
    def token(self) -> str:
        crc = 0
        for e in self.entries:
            crc = zlib.crc32(e.value, crc)
        return f"{self.topic}/{self.partition}/{self.first}-{self.last}/{crc:08x}"

    @property
    def items(self) -> int:
        return sum(e.items for e in self.entries)


def encode_plan(ranges: Iterable[tuple[int, int]]) -> str:
    text = PLAN_PREFIX + ",".join(f"{f}-{last}" for f, last in ranges)
    return "" if text == PLAN_PREFIX else text


def decode_plan(metadata: str | None) -> list[tuple[int, int]]:
    """The ranges a previous owner planned; anything else (another tool's metadata, a
    damaged value) is no plan."""
    if not metadata or not metadata.startswith(PLAN_PREFIX):
        return []
    out: list[tuple[int, int]] = []
    try:
        for part in metadata[len(PLAN_PREFIX):].split(","):
            f, last = part.split("-")
            out.append((int(f), int(last)))
    except ValueError:
        return []
    if any(f > last for f, last in out) or any(
            a[1] >= b[0] for a, b in zip(out, out[1:], strict=False)):
        return []
    return out


@dataclass
class PartitionBlocks:
    """The blocks of one partition this worker owns: the plan it must honour, and the
    messages read but not yet in a block."""

    topic: str
    partition: int
    block_items: int
    plan: deque[tuple[int, int]] = field(default_factory=deque)
    held: list[Entry] = field(default_factory=list)
    loaded: bool = False

    def cut(self, entries: list[Entry], until: float = float("inf")) -> list[Block]:
        """Add the messages just read; return the blocks that are complete, in order.

        Planned ranges come first and exactly; then new blocks of about ``block_items``
        items (a message is never split), of messages up to the first whose timestamp is
        after ``until``. Messages of an incomplete planned range stay held for the next
        fetch. New blocks are cut only while their plan fits in the commit metadata; what
        does not fit, or is after ``until``, stays held too.
        """
        pending = self.held + entries
        self.held = []
        blocks: list[Block] = []
        i = 0
        while i < len(pending) and self.plan:
            f, last = self.plan[0]
            if pending[i].offset > last:  # the planned messages are gone (retention)
                self.plan.popleft()
                continue
            if pending[i].offset < f:  # read from before the plan: it is not ours to honour
                self.plan.clear()
                break
            j = i
            while j < len(pending) and pending[j].offset <= last:
                j += 1
            if j == len(pending) and (j == i or pending[j - 1].offset < last):
                self.held = pending[i:]  # wait for the rest of the planned range
                return blocks
            blocks.append(Block(self.topic, self.partition, pending[i].offset,
                                pending[j - 1].offset, pending[i:j]))
            self.plan.popleft()
            i = j
        planned = [(b.first, b.last) for b in blocks]
        end = i
        while end < len(pending) and pending[end].timestamp <= until:
            end += 1
        while i < end:
            j, items = i, 0
            while j < end and (j == i or items + pending[j].items <= self.block_items):
                items += pending[j].items
                j += 1
            block = Block(self.topic, self.partition, pending[i].offset,
                          pending[j - 1].offset, pending[i:j])
            if len(encode_plan([*planned, (block.first, block.last)])) > MAX_PLAN_CHARS:
                break
            planned.append((block.first, block.last))
            blocks.append(block)
            i = j
        self.held = pending[i:]
        return blocks

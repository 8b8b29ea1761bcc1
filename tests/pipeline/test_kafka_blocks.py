"""Block planning for the Kafka receiver (pipeline/kafka/blocks.py): the same messages give
the same blocks after a crash, however the second reader's fetches are cut."""

from __future__ import annotations

from collections import Counter

import structlog

from pipeline.kafka.blocks import (
    MAX_PLAN_CHARS,
    Entry,
    PartitionBlocks,
    decode_plan,
    encode_plan,
)
from pipeline.receivers.kafka_batches import decode


def _entries(offsets: range, items: int = 10) -> list[Entry]:
    return [Entry(o, f"message {o}".encode(), object(), items) for o in offsets]


def _part(block_items: int = 35) -> PartitionBlocks:
    return PartitionBlocks("spans", 3, block_items)


class TestPlanText:
    def test_round_trip_and_foreign_metadata(self) -> None:
        assert decode_plan(encode_plan([(5, 9), (10, 40)])) == [(5, 9), (10, 40)]
        assert encode_plan([]) == ""
        for other in (None, "", "written by another tool", "spb1:9-5", "spb1:1-5,3-8",
                      "spb1:x-y"):
            assert decode_plan(other) == []


class TestCut:
    def test_blocks_of_about_block_items_never_splitting_a_message(self) -> None:
        blocks = _part(35).cut(_entries(range(100, 110)))
        assert [(b.first, b.last) for b in blocks] == [(100, 102), (103, 105), (106, 108),
                                                       (109, 109)]
        big = _part(5).cut(_entries(range(0, 2), items=50))
        assert [(b.first, b.last) for b in big] == [(0, 0), (1, 1)]  # one message each

    def test_a_plan_is_rebuilt_exactly_whatever_the_fetches(self) -> None:
        """The first reader cut blocks from one fetch of 10 messages and crashed after
        inserting them; the second reads one message per fetch and more messages exist:
        it builds the very same blocks (same tokens), then cuts new ones."""
        first = _part().cut(_entries(range(100, 110)))
        plan = decode_plan(encode_plan((b.first, b.last) for b in first))
        second = _part()
        second.plan.extend(plan)
        rebuilt = []
        for o in range(100, 116):
            rebuilt += second.cut(_entries(range(o, o + 1)))
        assert [b.token for b in rebuilt[:4]] == [b.token for b in first]
        assert [(b.first, b.last) for b in rebuilt[4:]] == [(110, 110), (111, 111),
                                                            (112, 112), (113, 113),
                                                            (114, 114), (115, 115)]
        assert not second.plan and not second.held

    def test_incomplete_planned_range_is_held_not_delivered(self) -> None:
        p = _part()
        p.plan.extend([(0, 4)])
        assert p.cut(_entries(range(0, 3))) == []
        assert [e.offset for e in p.held] == [0, 1, 2]
        (b,) = p.cut(_entries(range(3, 5)))
        assert (b.first, b.last, len(b.entries)) == (0, 4, 5)

    def test_offset_gaps_inside_a_plan(self) -> None:
        """Offsets are not contiguous (transaction markers, compaction): a range is whole
        once a message at or past its last offset was read."""
        p = _part(1000)
        p.plan.extend([(0, 6), (7, 9)])
        got = p.cut([*_entries(range(0, 3)), *_entries(range(5, 7)), *_entries(range(8, 12))])
        assert [(b.first, b.last, len(b.entries)) for b in got] == [(0, 6, 5), (8, 9, 2),
                                                                  (10, 11, 2)]

    def test_planned_messages_gone_and_reading_before_the_plan(self) -> None:
        gone = _part(1000)
        gone.plan.extend([(0, 4), (5, 9)])  # 0-9 deleted by retention before the rebuild
        assert [(b.first, b.last) for b in gone.cut(_entries(range(20, 23)))] == [(20, 22)]
        before = _part(1000)  # an offset reset to before the plan: the plan does not apply
        before.plan.extend([(50, 60)])
        assert [(b.first, b.last) for b in before.cut(_entries(range(40, 55)))] == [(40, 54)]
        assert not before.plan

    def test_the_plan_fits_in_commit_metadata(self) -> None:
        p = _part(1)
        blocks = p.cut(_entries(range(10**9, 10**9 + 1000), items=1))
        assert len(encode_plan((b.first, b.last) for b in blocks)) <= MAX_PLAN_CHARS
        assert blocks and len(p.held) == 1000 - len(blocks)
        assert p.held[0].offset == blocks[-1].last + 1  # what did not fit waits, in order

    def test_token_names_the_content(self) -> None:
        a = _part().cut(_entries(range(0, 3)))[0]
        other = [Entry(e.offset, e.value + b"!", e.batch, e.items) for e in a.entries]
        b = _part().cut(other)[0]
        assert (a.first, a.last) == (b.first, b.last) and a.token != b.token

    def test_messages_after_until_wait_but_a_plan_does_not(self) -> None:
        """New blocks stop at the first message newer than ``until`` (the rest is held and
        cut later); a planned range is rebuilt whatever its timestamps."""
        part = _part(35)
        entries = [Entry(o, b"m", object(), 10, timestamp=1000 + o) for o in range(6)]
        blocks = part.cut(entries, until=1002)
        assert [(b.first, b.last) for b in blocks] == [(0, 2)]
        assert [e.offset for e in part.held] == [3, 4, 5]
        assert part.cut([], until=1002) == [] and len(part.held) == 3
        assert [(b.first, b.last) for b in part.cut([])] == [(3, 5)]
        planned = _part(35)
        planned.plan.extend([(0, 1)])
        assert [(b.first, b.last) for b in planned.cut(entries[:3], until=0)] == [(0, 1)]
        assert [e.offset for e in planned.held] == [2]


class TestWaves:
    def test_groups_of_about_the_budget_in_order(self) -> None:
        from pipeline.receivers.kafka_batches import waves

        batches = [[0] * n for n in (8, 5, 5, 30, 1, 1)]
        got = waves(batches, 10)  # type: ignore[arg-type]
        assert [[len(b) for b in w] for w in got] == [[8], [5, 5], [30], [1, 1]]
        assert waves([], 10) == []


class TestDecode:
    def test_tombstone_is_malformed_not_fatal(self) -> None:
        """A record with no value at all (a tombstone, written by any producer) is counted
        and skipped: it once raised TypeError out of the poll loop, at every restart."""
        metrics: Counter[str] = Counter()
        for signal in ("traces", "profiles"):
            assert decode(signal, "t", None, metrics, structlog.get_logger()) is None
        assert metrics["malformed_messages"] == 2

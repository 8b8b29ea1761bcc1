"""Reading the sending queue's log back at start (``queue.py``): what waits, and how.

Every segment is scanned in order (``queue_log.scan``). What comes out is the records not
yet in ClickHouse (where each is in the log, not its tables: those are read when it is
inserted), the groups logged before a crash that are not done (each to be inserted again
as it was, under its token, with those of its records still waiting), each segment's count
of what it holds that is not done, and the next free sequence and group numbers. A torn
tail (a record the process died writing, never acknowledged: the last segment's only) is
reported and cut off, the same in an older segment is damage, reported as an error; a
record damaged since it was written, with good ones after it, is reported lost and the
ones after it are read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.disklog.segments import FORGET, Segment, segments
from pipeline.exporters.clickhouse.queue_log import (
    DATA,
    DONE,
    GROUP,
    Group,
    QueueError,
    Record,
    read_tables,
    scan,
)
from pipeline.records import DEFAULT_TENANT


@dataclass
class Replay:
    segments: list[Segment] = field(default_factory=list)
    records: dict[int, Record] = field(default_factory=dict)  # by sequence number
    groups: list[Group] = field(default_factory=list)  # not done, by group number
    next_seq: int = 1
    next_gid: int = 1


def read_back(directory: str, log: Any) -> Replay:
    out = Replay()
    logged: dict[int, Group] = {}
    done: set[int] = set()
    forgotten: set[int] = set()
    group_at: dict[int, tuple[int, int]] = {}  # where each GROUP record is (segment, byte)
    damaged_at: list[tuple[int, int]] = []
    files = segments(directory)
    for i, (number, path) in enumerate(files):
        seg = Segment(number, path)
        out.segments.append(seg)
        with open(path, "rb") as f:
            data = f.read()
        records = scan(data)
        try:
            for kind, payload, size, offset in records:
                _apply(out, kind, payload, seg, size, offset, logged, done)
                if kind == FORGET:
                    forgotten.update(payload)
                if kind == GROUP:
                    group_at[payload[0]] = (number, offset)
        except (msgspec.DecodeError, ValueError, TypeError, KeyError) as err:
            raise QueueError(f"{path}: record at byte {records.end} cannot be read: "
                             f"{err}") from err
        for offset, size in records.damaged:
            # acknowledged, and lost: which batch it was cannot be read either (a group
            # naming it goes without it)
            log.error("queue_record_damaged", segment=path, offset=offset, bytes=size)
            damaged_at.append((number, offset))
        at = records.end
        if at != len(data):
            if i == len(files) - 1:
                log.warning("queue_torn_tail", segment=path, offset=at,
                            dropped_bytes=len(data) - at)
            else:
                # an older segment was synced and closed before the next one began: what
                # does not check out there was damaged after it was written, acknowledged
                # and lost
                log.error("queue_segment_damaged", segment=path, offset=at,
                          dropped_bytes=len(data) - at)
            with open(path, "r+b") as f:
                f.truncate(at)
    by_number = {s.number: s for s in out.segments}
    for seq in forgotten:  # refused when they were put: their senders sent them again
        if (r := out.records.pop(seq, None)) is not None:
            by_number[r.segment].pending -= 1
    _done_without_group(out, done, logged, group_at, damaged_at, by_number, log)
    for gid in done:
        g = logged.pop(gid, None)
        if g is not None:
            for s in g.seqs:
                if (r := out.records.pop(s, None)) is not None:
                    by_number[r.segment].pending -= 1
    for g in sorted(logged.values(), key=lambda g: g.gid):
        seqs = [s for s in g.seqs if s in out.records]
        if seqs:
            out.groups.append(Group(g.gid, seqs, g.token, g.segment))
            by_number[g.segment].pending += 1
    return out


def _done_without_group(out: Replay, done: set[int], logged: dict[int, Group],
                        group_at: dict[int, tuple[int, int]],
                        damaged_at: list[tuple[int, int]], by_number: dict[int, Segment],
                        log: Any) -> None:
    """A group marked done whose GROUP record was damaged: its batches are not inserted
    again (under a new token they would be stored twice). A GROUP record follows the DATA
    records it names and the GROUP record before it, so its batches are those written
    between the previous GROUP record and the damaged record, that no GROUP record names
    (a crash between a group's DONE and the next group's forming could put a waiting
    batch among them: lost then, rather than doubled)."""
    named = {s for g in logged.values() for s in g.seqs}
    damaged = sorted(damaged_at)
    for gid in sorted(g for g in done if g not in group_at):
        lo = max((at for g, at in group_at.items() if g < gid), default=(-1, -1))
        hi = next((d for d in damaged if d > lo), None)
        if hi is None:
            continue  # its DONE outlived every trace of it: nothing of it waits
        members = [r for r in out.records.values()
                   if r.seq not in named and lo < (r.segment, r.offset) < hi]
        for r in members:
            del out.records[r.seq]
            by_number[r.segment].pending -= 1
        log.error("queue_group_damaged", group=gid, batches=len(members),
                  rows=sum(r.rows for r in members))


def with_tables(recs: list[Record], paths: dict[int, str],
                final: bool = False) -> list[Record | QueueError]:
    """``recs`` with their tables, those on disk only (``Record.tables`` None) read from
    their segment (``paths``: by number) as copies; in place of a record that is not
    there any more (its segment or its file gone, or something else at its place), the
    error. The disk failing to read (another ``OSError``), or anything else, is raised,
    unless ``final``: then it too is that record's error."""
    out: list[Record | QueueError] = []
    for r in recs:
        if r.tables is not None:
            out.append(r)
            continue
        try:
            path = paths.get(r.segment)
            if path is None:
                raise QueueError(f"segment {r.segment} is gone")
            tables = with_tenant(read_tables(path, r.offset, r.size, r.seq))
        except QueueError as err:
            out.append(err)
            continue
        except (FileNotFoundError, NotADirectoryError) as err:
            out.append(QueueError(str(err)))
            continue
        except Exception as err:
            if not final:
                raise
            out.append(QueueError(f"{type(err).__name__}: {err}"))
            continue
        out.append(dataclasses.replace(r, tables=tables))
    return out


def _stack_keys(stacks: list[Any]) -> set[tuple[str, int]]:
    """(tenant, stack id) pairs as logged; a bare id, as logged before tenants (migration
    11), is the default tenant's."""
    return {(DEFAULT_TENANT, int(s)) if isinstance(s, int) else (str(s[0]), int(s[1]))
            for s in stacks}


def with_tenant(tables: dict[str, Any]) -> dict[str, Any]:
    """Rows logged before tenants have no tenant column: the default tenant's, as migration
    11 made the rows already stored."""
    for cols in tables.values():
        if cols and "tenant" not in cols:
            n = len(next(iter(cols.values())))
            cols["tenant"] = [DEFAULT_TENANT] * n
    return tables


def _apply(out: Replay, kind: int, p: Any, seg: Segment, size: int, offset: int,
           logged: dict[int, Group], done: set[int]) -> None:
    if kind == DATA:
        seq, token, rows, stacks = p
        # its tables stay on disk until its turn comes (``queue.py``): a log of a
        # gigabyte read back whole took several in memory
        out.records[seq] = Record(seq, None, rows, _stack_keys(stacks), token, size,
                                  seg.number, offset)
        seg.pending += 1
        out.next_seq = max(out.next_seq, seq + 1)
    elif kind == GROUP:
        gid, seqs, token = p
        logged[gid] = Group(gid, list(seqs), token, seg.number)
        out.next_gid = max(out.next_gid, gid + 1)
        out.next_seq = max(out.next_seq, max(seqs, default=0) + 1)
    elif kind == DONE:
        done.add(p)
        # numbers are never used twice while a record names them
        out.next_gid = max(out.next_gid, p + 1)
    elif kind == FORGET:
        # a number named here is never given again: its batch's record may be gone (its
        # segment deleted) while this one stays and would drop a new batch under it
        out.next_seq = max(out.next_seq, max(p, default=0) + 1)
    else:
        raise ValueError(f"unknown record kind {kind}")

"""The ClickHouse exporter's sending queue: acknowledged once logged, inserted behind in
groups, exactly once across crashes (a group logged before a crash is inserted again
under the same token), torn tails ignored, bounded, disk errors refused as retryable."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.disklog import writer as queue_writer
from pipeline.errors import Retryable
from pipeline.exporters.clickhouse import queue as q
from pipeline.exporters.clickhouse import queue_replay
from pipeline.exporters.clickhouse.queue import SendingQueue


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _rec(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    info = warning = error = _rec


class Store:
    """Stands in for the writer: records each group (tables, rows, token); can be made to
    refuse (retryable) or to block."""

    def __init__(self) -> None:
        self.groups: list[tuple[dict[str, Any], int, str]] = []
        self.tokens: set[str] = set()
        self.refuse = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def submit(self, tables: dict[str, Any], rows: int, stacks: set[int],
                     token: str) -> None:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse:
            self.refuse -= 1
            raise Retryable("clickhouse down", retry_after=0.01)
        if token in self.tokens:  # ClickHouse drops a block it has under this token
            return
        self.tokens.add(token)
        self.groups.append((tables, rows, token))

    def values(self) -> list[int]:
        return [v for t, _, _ in self.groups for v in t["t"]["v"]]


def batch(*vs: int) -> dict[str, Any]:
    return {"t": {"v": list(vs), "tenant": ["default"] * len(vs)}}


OPENED: list[SendingQueue] = []


def make(tmp: Path, store: Store, max_bytes: int = 1 << 30, batch_rows: int = 1_000,
         flush_interval: float = 0.01, memory_bytes: int = q.MEMORY_BYTES,
         metrics: dict[str, int] | None = None) -> SendingQueue:
    counts = metrics if metrics is not None else {}

    def metric(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n

    qu = SendingQueue(str(tmp / "queue"), max_bytes, batch_rows, flush_interval,
                      store.submit, Log(), metric, memory_bytes=memory_bytes)
    OPENED.append(qu)
    return qu


@pytest.fixture(autouse=True)
async def _close_queues() -> Any:
    yield
    while OPENED:
        qu = OPENED.pop()
        if qu._log._fd >= 0:
            await qu.close(within=0.1)


def crash(queue: SendingQueue) -> None:
    """As a SIGKILL would leave it: nothing more reaches the disk, nothing is closed."""
    if queue._task is not None:
        queue._task.cancel()
    os.close(queue._log._fd)
    queue._log._fd = -1


def fail_next_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next fsync fails (EIO), the ones after it do not."""
    real = os.fsync
    fail = [True]

    def fsync(fd: int) -> None:
        if fail[0]:
            fail[0] = False
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(q.os, "fsync", fsync)


def zero_from(path: str, at: int) -> None:
    """Zeros in place of a file's bytes from ``at`` on (what a failed writeback leaves)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(at)
        f.write(bytes(size - at))


class TestQueue:
    async def test_acknowledged_then_inserted_in_groups(self, tmp_path: Path) -> None:
        """Puts return once logged; what comes while a group is being inserted goes in the
        next group, as one insert."""
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        store.gate = asyncio.Event()
        await qu.put(batch(1), 1, set(), None)
        await asyncio.wait_for(store.entered.wait(), 2)  # the first group is in flight
        for v in (2, 3, 4):
            await qu.put(batch(v), 1, set(), None)  # acknowledged while it waits
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 2)
        assert [sorted(t["t"]["v"]) for t, _, _ in store.groups] == [[1], [2, 3, 4]]
        await qu.close(within=1)
        assert os.listdir(tmp_path / "queue") == ["000000000001.log"] or \
            len(os.listdir(tmp_path / "queue")) == 1

    async def test_a_segment_that_cannot_be_deleted_stops_nothing(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A done segment the disk refuses to delete (EIO) is logged and left; the
        drainer goes on inserting what comes after (it used to end there)."""
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        qu._log.segment_bytes = 300  # a segment or two per batch
        real, failed = os.unlink, []

        def unlink(path: Any) -> None:
            if not failed:
                failed.append(path)
                raise OSError(errno.EIO, "Input/output error")
            real(path)

        monkeypatch.setattr(os, "unlink", unlink)
        for v in range(1, 9):
            await qu.put(batch(v), 1, set(), None)
            await asyncio.wait_for(qu.wait_empty(), 2)
        assert failed and sorted(v for t, _, _ in store.groups for v in t["t"]["v"]) == \
            list(range(1, 9))
        assert any(e == "log_segment_not_deleted" for e, _ in qu.log.events)

    async def test_crash_replays_exactly_once(self, tmp_path: Path) -> None:
        """Killed while a group was being inserted and with more logged behind it: the next
        start inserts the group again under its token (dropped if it had landed) and the
        rest once; nothing lost, nothing twice."""
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        store.gate = asyncio.Event()
        await qu.put(batch(1, 2), 2, set(), None)
        await asyncio.wait_for(store.entered.wait(), 2)
        await qu.put(batch(3), 1, set(), None)
        # the group in flight lands in ClickHouse, but the process dies before it knows
        in_flight = next(iter(qu._groups))
        store.tokens.add(in_flight.token)
        store.groups.append((batch(1, 2), 2, in_flight.token))
        crash(qu)

        store.gate = None
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [1, 2, 3]
        await again.close(within=1)
        third = make(tmp_path, store)
        await third.open(replay_timeout=2)  # all done: nothing replayed
        assert sorted(store.values()) == [1, 2, 3]
        await third.close(within=1)

    async def test_torn_tail_is_ignored(self, tmp_path: Path) -> None:
        """A record cut short by a crash (never acknowledged) ends the log; what came
        before it is inserted."""
        store = Store()
        store.refuse = 10 ** 6  # nothing gets in before the crash
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        await qu.put(batch(7), 1, set(), None)
        crash(qu)
        (seg,) = sorted((tmp_path / "queue").iterdir())
        good = seg.read_bytes()
        seg.write_bytes(good + b"\x40\x00\x00\x00garbage")
        again = make(tmp_path, store)
        await again.open(replay_timeout=0.1)  # still refused: the segment stays
        # cut off: at the next start it is an older segment, and a bad end there is damage
        assert seg.read_bytes() == good
        store.refuse = 0
        await asyncio.wait_for(again.wait_empty(), 5)
        assert store.values() == [7]
        await again.close(within=1)

    async def test_bounded(self, tmp_path: Path) -> None:
        """Beyond max_mib a put is refused as retryable; an empty queue takes any batch."""
        store = Store()
        store.gate = asyncio.Event()
        qu = make(tmp_path, store, max_bytes=200)
        await qu.open(replay_timeout=1)
        await qu.put(batch(*range(1000)), 1000, set(), None)  # bigger than the bound alone
        with pytest.raises(Retryable, match="max_mib"):
            await qu.put(batch(1), 1, set(), None)
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 2)
        await qu.put(batch(1), 1, set(), None)
        await qu.close(within=1)

    @pytest.mark.parametrize(("fault", "refusal"), [("write", "No space left"),
                                                    ("fsync", "cannot fsync")])
    async def test_a_refused_put_is_never_inserted_and_the_next_goes_in(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str,
            refusal: str) -> None:
        """A write the disk refuses (full), or an fsync that fails, is answered retryable
        and its batch forgotten: never inserted, not after a restart either (the client
        sends it again: a refused write leaves no record, a failed fsync a FORGET one);
        the next put goes in, once."""
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        real = os.write

        def full(fd: int, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        if fault == "write":
            monkeypatch.setattr(q.os, "write", full)
        else:
            fail_next_fsync(monkeypatch)
        with pytest.raises(Retryable, match=refusal):
            await qu.put(batch(5), 1, set(), None)
        monkeypatch.setattr(q.os, "write", real)
        await qu.put(batch(6), 1, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 2)
        assert store.values() == [6]
        crash(qu)
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert store.values() == [6]
        await again.close(within=1)

    async def test_a_write_cut_short_leaves_no_hole(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The disk takes half a record and then refuses: the half is cut off, and what is
        logged after it is read back after a crash (no hole that would end the log)."""
        store = Store()
        store.refuse = 10 ** 6  # nothing inserted before the crash: all from the log
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        await qu.put(batch(1), 1, set(), None)
        real = os.write

        def half(fd: int, data: bytes) -> int:
            return real(fd, data[:len(data) // 2])

        monkeypatch.setattr(q.os, "write", half)
        with pytest.raises(Retryable, match="short write"):
            await qu.put(batch(2), 1, set(), None)
        monkeypatch.setattr(q.os, "write", real)
        await qu.put(batch(3), 1, set(), None)
        crash(qu)
        store.refuse = 0
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [1, 3]

    async def test_retries_until_clickhouse_takes_it(self, tmp_path: Path) -> None:
        """A group ClickHouse refuses is retried (same token) until it goes in."""
        store = Store()
        store.refuse = 3
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        await qu.put(batch(9), 1, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [9]
        await qu.close(within=1)

    async def test_close_leaves_what_clickhouse_refuses_for_the_next_start(
            self, tmp_path: Path) -> None:
        store = Store()
        store.refuse = 10 ** 6
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        await qu.put(batch(4), 1, set(), None)
        await qu.close(within=0.2)
        store.refuse = 0
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert store.values() == [4]
        await again.close(within=1)

    async def test_segments_are_deleted_once_done(self, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(queue_writer, "SEGMENT_BYTES", 300)
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        for v in range(20):
            await qu.put(batch(*range(v * 10, v * 10 + 10)), 10, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 5)
        await qu.close(within=1)
        assert len(store.values()) == 200
        assert len(os.listdir(tmp_path / "queue")) <= 1


class TestFsync:
    """What an acknowledgement waits for: an fsync that began after its record was
    written, shared by the puts that came meanwhile (group commit)."""

    async def test_acknowledged_only_after_an_fsync_that_covers_it(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        real_write, real_fsync = os.write, os.fsync
        writes = [0]
        fsyncs: list[tuple[int, int]] = []  # (writes when it began, when it ended)
        ended: list[int] = []  # writes covered by the fsyncs ended so far

        def write(fd: int, data: Any) -> int:
            writes[0] += 1
            return real_write(fd, data)

        def fsync(fd: int) -> None:
            began = writes[0]
            time.sleep(0.01)  # a slow disk: puts pile up behind each fsync
            real_fsync(fd)
            fsyncs.append((began, writes[0]))
            ended.append(began)

        monkeypatch.setattr(q.os, "write", write)
        monkeypatch.setattr(q.os, "fsync", fsync)

        async def put_and_check(v: int) -> None:
            before = writes[0]
            await qu.put(batch(v), 1, set(), None)
            # an fsync that began once this record was written has ended
            assert any(b > before for b in ended), (v, before, ended)

        await asyncio.gather(*(put_and_check(v) for v in range(40)))
        assert len(fsyncs) < 40  # shared: far fewer fsyncs than puts
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert sorted(store.values()) == list(range(40))

    def test_a_forgotten_number_is_not_given_again(self, tmp_path: Path) -> None:
        """A FORGET record whose batch's record is gone (its segment deleted) still keeps
        its sequence number from being given to a new batch after a restart: else the next
        replay would drop that batch under it."""
        from pipeline.disklog.segments import FORGET, record, segment_path

        directory = tmp_path / "queue"
        directory.mkdir()
        Path(segment_path(str(directory), 3)).write_bytes(record(FORGET, [7]))
        replay = queue_replay.read_back(str(directory), Log())
        assert replay.next_seq == 8 and not replay.records

    async def test_what_a_failed_fsync_left_does_not_cut_off_later_batches(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Batch 2's fsync fails and its bytes never reach the disk (zeros where its record
        was, header too: read back as a torn tail). Batch 3, acknowledged after, is in a
        new segment, so it is not cut off with them; batch 2 is not inserted."""
        store = Store()
        store.gate = asyncio.Event()
        qu = make(tmp_path, store, flush_interval=1000)
        await qu.open(replay_timeout=1)
        await qu.put(batch(1), 1, set(), None)
        fail_next_fsync(monkeypatch)
        with pytest.raises(Retryable, match="cannot fsync"):
            await qu.put(batch(20), 1, set(), None)
        await qu.put(batch(3), 1, set(), None)  # acknowledged
        first = qu._segments[0].path
        crash(qu)
        # batch 2's record, and anything after it
        zero_from(first, len(q.record(q.DATA, [1, None, 1, [], batch(1)])))
        store.gate = None
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [1, 3]

    @pytest.mark.parametrize("creatable", [True, False])
    async def test_an_fsync_error_taken_by_a_new_segment_is_not_an_acknowledgement(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, creatable: bool) -> None:
        """Linux reports a writeback error once per open file, to whichever fsync of it
        comes first. Batch 1's writeback fails while its group commit's fsync waits in the
        thread; a put that starts a new segment fsyncs the same file on the loop and gets
        the error (and, not ``creatable``, the new file cannot be made either: a failing
        disk); the group commit's fsync then succeeds: batch 1 must still be refused (and
        forgotten on disk), not acknowledged."""
        monkeypatch.setattr(queue_writer, "SEGMENT_BYTES", 300)
        store = Store()
        qu = make(tmp_path, store, flush_interval=1000)
        await qu.open(replay_timeout=1)
        real = os.fsync
        real_open = os.open
        fail_open = [0 if creatable else 1]

        def open_(path: Any, flags: int, mode: int = 0o777) -> int:
            if fail_open[0] and str(path).endswith(".log"):
                fail_open[0] -= 1
                raise OSError(errno.EROFS, "Read-only file system")
            return real_open(path, flags, mode)

        monkeypatch.setattr(q.os, "open", open_)
        pending_error: set[int] = set()  # descriptors with a writeback error not reported
        in_thread = threading.Event()
        release = threading.Event()

        def fsync(fd: int) -> None:
            if threading.current_thread() is not threading.main_thread():
                in_thread.set()
                release.wait(5)
            if fd in pending_error:
                pending_error.discard(fd)
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        monkeypatch.setattr(q.os, "fsync", fsync)
        first = asyncio.create_task(qu.put(batch(1), 1, set(), None))
        while not in_thread.is_set():
            await asyncio.sleep(0.001)
        pending_error.add(qu._log._fd)  # batch 1's writeback failed
        with pytest.raises(Retryable):  # starts a new segment, whose fsync gets the EIO
            await qu.put(batch(*range(100)), 100, set(), None)
        release.set()
        with pytest.raises(Retryable):
            await first
        await qu.put(batch(7), 1, set(), None)
        crash(qu)
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert store.values() == [7]

    async def test_a_batch_after_a_failed_rollover_is_not_failed_with_the_old_file(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The group commit's fsync of file A (batch 1) runs in the thread; a new
        segment's fsync of A fails on the loop (batch 1 failed, a FORGET in file B).
        Batch 3, appended to B, waits for that fsync of A, which then fails too: batch 3
        is not failed with it (its record is in B, after the FORGET): another fsync
        covers it, it is acknowledged and inserted once."""
        monkeypatch.setattr(queue_writer, "SEGMENT_BYTES", 300)
        store = Store()
        store.gate = asyncio.Event()
        qu = make(tmp_path, store, flush_interval=1000)
        await qu.open(replay_timeout=1)
        real = os.fsync
        in_thread, release = threading.Event(), threading.Event()
        fail = {"loop": 1, "thread": 1}

        def fsync(fd: int) -> None:
            if threading.current_thread() is not threading.main_thread():
                in_thread.set()
                release.wait(5)
                if fail["thread"]:
                    fail["thread"] -= 1
                    raise OSError(errno.EIO, "Input/output error")
            elif fail["loop"]:
                fail["loop"] -= 1
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        monkeypatch.setattr(q.os, "fsync", fsync)
        first = asyncio.create_task(qu.put(batch(1), 1, set(), None))
        while not in_thread.is_set():
            await asyncio.sleep(0.001)
        with pytest.raises(Retryable):  # a new segment, whose fsync of A fails
            await qu.put(batch(*range(100)), 100, set(), None)
        third = asyncio.create_task(qu.put(batch(3), 1, set(), None))
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(Retryable):
            await first
        await third  # acknowledged
        await qu.put(batch(4), 1, set(), None)
        crash(qu)
        store.gate = None
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [3, 4]

    async def test_a_new_segment_that_cannot_be_made_is_tried_again(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """After a failed fsync the next file cannot be created once (EMFILE): the next
        put makes it, and the queue goes on (no descriptor left at -1 for good)."""
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        real_fsync, real_open = os.fsync, os.open
        fail = {"fsync": 1, "open": 1}

        def fsync(fd: int) -> None:
            if fail["fsync"]:
                fail["fsync"] -= 1
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(fd)

        def open_(path: Any, flags: int, mode: int = 0o777) -> int:
            if fail["open"] and str(path).endswith(".log"):
                fail["open"] -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return real_open(path, flags, mode)

        monkeypatch.setattr(q.os, "fsync", fsync)
        monkeypatch.setattr(q.os, "open", open_)
        with pytest.raises(Retryable):
            await qu.put(batch(1), 1, set(), None)
        await qu.put(batch(2), 1, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 2)
        assert store.values() == [2]

    async def test_a_new_segment_while_an_fsync_runs(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Appends move to a new file while the fsync of the old one runs: that file is
        closed only after it (an fsync of a closed descriptor fails, or syncs another file
        given its number), and every put is acknowledged."""
        monkeypatch.setattr(queue_writer, "SEGMENT_BYTES", 300)
        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        real_fsync, real_write = os.fsync, os.write
        file_of: dict[int, str] = {}  # descriptor -> the file last written through it
        wrong: list[str] = []

        def write(fd: int, data: Any) -> int:
            file_of[fd] = os.readlink(f"/proc/self/fd/{fd}")
            return real_write(fd, data)

        def slow(fd: int) -> None:
            if threading.current_thread() is not threading.main_thread():
                meant = file_of.get(fd)
                time.sleep(0.03)  # the group commit's (a new segment's own is at once)
                try:
                    now = os.readlink(f"/proc/self/fd/{fd}")
                except OSError as err:
                    now = str(err)
                if now != meant:
                    wrong.append(f"{meant} -> {now}")
            real_fsync(fd)

        monkeypatch.setattr(q.os, "write", write)
        monkeypatch.setattr(q.os, "fsync", slow)

        async def put(v: int) -> None:
            await asyncio.sleep(v * 0.004)  # some while the fsync of an earlier one runs
            await qu.put(batch(*range(v * 10, v * 10 + 10)), 10, set(), None)

        await asyncio.gather(*(put(v) for v in range(20)))
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert sorted(store.values()) == list(range(200))
        assert not wrong, wrong


async def backlogged(tmp: Path, memory_bytes: int = 1
                     ) -> tuple[Store, SendingQueue, dict[str, int]]:
    """An open queue whose first group (batch 0) is being inserted and held there until
    ``store.gate`` is set (ClickHouse slow): what is put next waits, beyond
    ``memory_bytes`` on disk only; ``metrics`` counts what the queue reports."""
    store = Store()
    store.gate = asyncio.Event()
    metrics: dict[str, int] = {}
    qu = make(tmp, store, memory_bytes=memory_bytes, batch_rows=10 ** 6, metrics=metrics)
    await qu.open(replay_timeout=1)
    await qu.put(batch(0), 1, set(), None)
    await asyncio.wait_for(store.entered.wait(), 2)
    return store, qu, metrics


class TestMemory:
    """Only ``memory_mib`` of what waits is kept in memory; the rest is on disk only and
    read again when its group is inserted, in order, each batch once."""

    async def test_a_backlog_waits_on_disk(self, tmp_path: Path) -> None:
        store, qu, metrics = await backlogged(tmp_path, memory_bytes=300)
        for v in range(1, 40):
            await qu.put(batch(*range(v * 10, v * 10 + 10)), 10, {("default", v)}, None)
        in_memory = [r for r in qu._records.values() if r.tables is not None]
        assert qu.resident_bytes == sum(r.size for r in in_memory) <= 300
        assert len(in_memory) < 10 < len(qu._records)
        assert metrics["queue_spilled_rows"] == 10 * (40 - len(in_memory))
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0, *range(10, 400)]  # in order, each once
        assert qu.resident_bytes == 0
        await qu.close(within=1)

    async def test_read_back_at_start_without_its_tables(self, tmp_path: Path) -> None:
        """After a crash the log is read back as where each batch is, not its tables: a
        log of a gigabyte read whole took several in memory."""
        store = Store()
        store.refuse = 10 ** 6
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        for v in range(5):
            await qu.put(batch(v, v + 100), 2, set(), None)
        crash(qu)
        store.refuse = 0
        store.gate = asyncio.Event()
        again = make(tmp_path, store)
        opening = asyncio.create_task(again.open(replay_timeout=5))
        await asyncio.wait_for(store.entered.wait(), 2)
        assert len(again._records) == 5
        assert all(r.tables is None for r in again._records.values())
        assert again.resident_bytes == 0
        store.gate.set()
        await asyncio.wait_for(opening, 5)
        assert sorted(store.values()) == sorted([*range(5), *range(100, 105)])

    async def test_a_batch_that_cannot_be_read_again_is_reported_not_retried(
            self, tmp_path: Path) -> None:
        """A batch on disk only whose bytes changed under the queue (a disk fault) is
        logged as lost with its rows counted; the others of its group are inserted and the
        queue goes on (retrying it forever would stop every batch behind it)."""
        store, qu, metrics = await backlogged(tmp_path)
        for v in (1, 2, 3):
            await qu.put(batch(v, v), 2, set(), None)
        lost = qu._records[3]
        assert lost.tables is None
        seg = tmp_path / "queue" / f"{lost.segment:012d}.log"
        data = bytearray(seg.read_bytes())
        data[lost.offset + lost.size - 1] ^= 0xFF
        seg.write_bytes(bytes(data))
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0, 1, 1, 3, 3]
        assert metrics["queue_lost_rows"] == 2
        assert [e for e, _ in qu.log.events if e == "queue_record_lost"] == ["queue_record_lost"]
        await qu.put(batch(4), 1, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values()[-1] == 4
        await qu.close(within=1)

    @pytest.mark.parametrize("fault", [OSError(errno.EMFILE, "Too many open files"),
                                       MemoryError()], ids=["emfile", "memory"])
    async def test_a_read_that_fails_for_now_is_tried_again(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            fault: BaseException) -> None:
        """The disk failing to read a batch back for now (or anything else raised there)
        is logged and tried again: the batch is inserted once, nothing counted lost, and
        the drainer goes on."""
        store, qu, metrics = await backlogged(tmp_path)
        await qu.put(batch(1, 1), 2, set(), None)
        assert qu._records[2].tables is None
        real = queue_replay.read_tables
        fails = [2]

        def flaky(*args: Any) -> Any:
            if fails[0]:
                fails[0] -= 1
                raise fault
            return real(*args)

        monkeypatch.setattr(queue_replay, "read_tables", flaky)
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0, 1, 1]
        assert "queue_lost_rows" not in metrics
        assert [e for e, _ in qu.log.events if e == "queue_read_failed"] == \
            ["queue_read_failed"] * 2
        await qu.close(within=1)

    async def test_another_batch_in_its_place_is_not_taken_for_it(self, tmp_path: Path) -> None:
        """A record that checks out but is another batch (the file changed under the queue)
        is not inserted in place of the one asked for: that one is reported lost."""
        store, qu, metrics = await backlogged(tmp_path)
        await qu.put(batch(5), 1, set(), None)
        await qu.put(batch(6), 1, set(), None)
        a, b = qu._records[2], qu._records[3]
        assert a.size == b.size and a.segment == b.segment
        seg = tmp_path / "queue" / f"{a.segment:012d}.log"
        data = bytearray(seg.read_bytes())
        data[a.offset:a.offset + a.size] = data[b.offset:b.offset + b.size]
        seg.write_bytes(bytes(data))
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0, 6]
        assert metrics["queue_lost_rows"] == 1
        await qu.close(within=1)

    async def test_a_damaged_record_at_start_loses_only_itself(self, tmp_path: Path) -> None:
        """A record damaged on disk, with good records after it, is not a torn tail: the
        next start reports it lost and inserts the acknowledged records after it (they
        were cut off with it before)."""
        store = Store()
        store.refuse = 10 ** 6
        qu = make(tmp_path, store, batch_rows=10 ** 6, flush_interval=3600)
        await qu.open(replay_timeout=1)
        for v in (1, 2, 3):
            await qu.put(batch(v), 1, set(), None)
        bad = qu._records[1]
        seg = tmp_path / "queue" / f"{bad.segment:012d}.log"
        data = bytearray(seg.read_bytes())
        data[bad.offset + bad.size - 1] ^= 0xFF
        seg.write_bytes(bytes(data))
        crash(qu)
        store.refuse = 0
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [2, 3]
        assert [kw["offset"] for e, kw in again.log.events
                if e == "queue_record_damaged"] == [bad.offset]
        assert not [e for e, _ in again.log.events if e == "queue_torn_tail"]
        await again.close(within=1)

    async def test_a_file_gone_is_lost_not_a_wedge(self, tmp_path: Path) -> None:
        """A segment file deleted under the queue: its batches are reported lost and the
        batches behind them inserted (retrying it for ever stopped the queue)."""
        store, qu, metrics = await backlogged(tmp_path)
        qu._log.new_segment()  # the next batches in a file of their own
        await qu.put(batch(1), 1, set(), None)
        await qu.put(batch(2), 1, set(), None)
        os.unlink(tmp_path / "queue" / f"{qu._records[2].segment:012d}.log")
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0]
        assert metrics["queue_lost_rows"] == 2
        qu._log.new_segment()  # (the file written to was the one deleted)
        await qu.put(batch(3), 1, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0, 3]
        await qu.close(within=1)

    async def test_a_read_that_keeps_failing_is_given_up(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A batch whose read fails every time (a bad sector: EIO) is retried READ_TRIES
        times, then reported lost; the batches behind it go in."""
        monkeypatch.setattr(q, "READ_TRIES", 2)
        store, qu, metrics = await backlogged(tmp_path)
        await qu.put(batch(1, 1), 2, set(), None)
        real = queue_replay.read_tables

        def bad_sector(path: str, offset: int, size: int, seq: int) -> Any:
            if seq == 2:
                raise OSError(errno.EIO, "Input/output error")
            return real(path, offset, size, seq)

        monkeypatch.setattr(queue_replay, "read_tables", bad_sector)
        store.gate.set()
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0]
        assert metrics["queue_lost_rows"] == 2
        assert [e for e, _ in qu.log.events].count("queue_read_failed") == 2
        await qu.put(batch(3), 1, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 5)
        assert store.values() == [0, 3]
        await qu.close(within=1)

    async def test_a_done_group_whose_group_record_is_damaged_is_not_inserted_again(
            self, tmp_path: Path) -> None:
        """A GROUP record damaged after its group went in (its DONE intact): its batches
        are not inserted again at the next start (under a new token they would be stored
        twice); the batches of the groups after it are as they were."""
        from pipeline.disklog.segments import Scan
        from pipeline.exporters.clickhouse.queue_log import GROUP

        store = Store()
        qu = make(tmp_path, store)
        await qu.open(replay_timeout=1)
        await qu.put(batch(1, 2), 2, set(), None)
        await asyncio.wait_for(qu.wait_empty(), 2)
        store.refuse = 10 ** 6  # the next group is logged, not inserted
        await qu.put(batch(3), 1, set(), None)
        await asyncio.wait_for(store.entered.wait(), 2)
        await asyncio.sleep(0.05)
        crash(qu)
        seg = next((tmp_path / "queue").iterdir())
        data = bytearray(seg.read_bytes())
        off, size = next((o, n) for k, _, n, o in Scan(bytes(data)) if k == GROUP)
        data[off + size - 1] ^= 0xFF  # the first group's record
        seg.write_bytes(bytes(data))
        store.refuse = 0
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [1, 2, 3]
        events = [e for e, _ in again.log.events]
        assert "queue_group_damaged" in events and "queue_record_damaged" in events
        await again.close(within=1)

    async def test_a_bad_end_of_an_older_segment_is_damage_not_a_torn_tail(
            self, tmp_path: Path) -> None:
        """Only the last segment can end in a torn write (the older ones were synced and
        closed): a bad record at the end of an older one is reported as an error (its
        batch was acknowledged), the segments after it read as they are."""
        store = Store()
        store.refuse = 10 ** 6
        qu = make(tmp_path, store, batch_rows=10 ** 6, flush_interval=3600)
        await qu.open(replay_timeout=1)
        await qu.put(batch(1), 1, set(), None)
        await qu.put(batch(2), 1, set(), None)
        bad = qu._records[2]
        qu._log.new_segment()
        await qu.put(batch(3), 1, set(), None)
        crash(qu)
        seg = tmp_path / "queue" / f"{bad.segment:012d}.log"
        data = bytearray(seg.read_bytes())
        data[bad.offset + bad.size - 1] ^= 0xFF
        seg.write_bytes(bytes(data))
        store.refuse = 0
        again = make(tmp_path, store)
        await again.open(replay_timeout=2)
        assert sorted(store.values()) == [1, 3]
        events = [e for e, _ in again.log.events]
        assert "queue_segment_damaged" in events and "queue_torn_tail" not in events
        await again.close(within=1)

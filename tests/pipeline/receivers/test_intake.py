"""The intake log (pipeline/receivers/intake.py): answered once logged, delivered behind,
once, across crashes and failing disks."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.component import Fanout
from pipeline.disklog.segments import HEADER
from pipeline.errors import InvalidData, Retryable
from pipeline.otlp.traces import Decoded
from pipeline.receivers import intake as intake_mod
from pipeline.receivers.intake import DONE, Intake, IntakeConfig
from pipeline.records import SpanBatch
from tests.pipeline.exporters.test_queue import fail_next_fsync


def decode(signal: str, fmt: str, body: bytes) -> Decoded:
    """A request's 'spans': its body's lines; a line 'bad' is refused."""
    lines = body.split(b"\n")
    return Decoded(SpanBatch([x for x in lines if x != b"bad"]),  # type: ignore[misc]
                   lines.count(b"bad"), "")


class Pipeline:
    """Records what it is given, per request of a batch; ``gate`` holds deliveries;
    ``fail`` is raised when a batch holds that body."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes, str, int]] = []
        self.batches = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: dict[bytes, list[Exception]] = {}
        self.running = 0
        self.most = 0

    async def deliver(self, signal: str, batch: SpanBatch) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.gate.wait()
            lines: list[Any] = list(batch.spans)
            bodies = []
            for key, n in batch.requests:
                bodies.append((key, b"\n".join(lines[:n])))
                lines = lines[n:]
            for _, body in bodies:
                errs = self.fail.get(body)
                if errs:
                    raise errs.pop(0)
            self.batches += 1
            self.got += [(signal, body, batch.tenant, key) for key, body in bodies]
        finally:
            self.running -= 1


def make(tmp: Path, pipe: Pipeline, store: Any = None, segment_bytes: int | None = None,
         **cfg: Any) -> Intake:
    return Intake(str(tmp / "intake"), IntakeConfig(**cfg), decode, pipe.deliver, store,
                  _Log(), segment_bytes=segment_bytes)


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((event, kw))


async def crash(intake: Intake) -> None:
    """What a SIGKILL leaves: the log as written, nothing delivered or closed after."""
    assert intake._task is not None
    for t in [intake._task, *intake._running]:
        t.cancel()
    await asyncio.sleep(0)
    intake._log.close()
    intake._io.shutdown(wait=True)


async def put(intake: Intake, body: bytes, key: int | None = None,
              rejected: int = 0) -> None:
    await intake.put("traces", "t1", key if key is not None else hash(body) & 0xFFFF,
                     "pb", rejected, body)


class TestIntake:
    async def test_answered_once_logged_then_delivered_in_order(self, tmp_path: Path) -> None:
        """``put`` returns while the pipeline holds every delivery; what was logged is then
        delivered in order, with its tenant and key, and the log's files go once done."""
        pipe = Pipeline()
        pipe.gate.clear()
        intake = make(tmp_path, pipe, concurrency=1)
        assert await intake.open() == []
        for i in range(5):
            await asyncio.wait_for(put(intake, b"span%d" % i, key=100 + i), 2)
        assert pipe.got == [] and len(intake) == 5
        pipe.gate.set()
        await asyncio.wait_for(intake.wait_idle(), 5)
        assert [g[1] for g in pipe.got] == [b"span%d" % i for i in range(5)]
        assert {(g[2], g[3]) for g in pipe.got} == {("t1", 100 + i) for i in range(5)}
        await intake.close()
        assert len(os.listdir(tmp_path / "intake")) == 1  # the current segment only

    async def test_crash_before_delivery_delivered_at_next_start(
            self, tmp_path: Path) -> None:
        """Logged, answered, then killed before the pipeline had it: the next start
        delivers each request once (and says which it read back); the pipeline's refusal
        of an item is as the check said."""
        pipe = Pipeline()
        pipe.gate.clear()
        first = make(tmp_path, pipe)
        await first.open()
        await put(first, b"a\nbad", key=1, rejected=1)
        await put(first, b"b", key=2)
        await crash(first)
        assert pipe.got == []
        pipe2 = Pipeline()
        second = make(tmp_path, pipe2)
        assert sorted(await second.open()) == [1, 2]
        await asyncio.wait_for(second.wait_idle(), 5)
        assert sorted(g[1] for g in pipe2.got) == [b"a", b"b"]
        assert not [e for e, _ in second.log.events if e == "intake_check_differs"]
        await second.close()
        pipe3 = Pipeline()
        third = make(tmp_path, pipe3)
        assert await third.open() == []  # done: never again
        await third.close()
        assert pipe3.got == []

    async def test_delivered_before_the_crash_not_again(self, tmp_path: Path) -> None:
        """Delivered (its rows in the store) but killed before its done record: the next
        start asks the store, once the store's own queue has inserted what it held, and
        delivers only what the store lacks."""
        pipe = Pipeline()
        first = make(tmp_path, pipe)
        await first.open()
        first._done = lambda *recs: None  # type: ignore[method-assign]  # no done record
        await put(first, b"stored", key=7)
        await put(first, b"lost", key=8)
        for _ in range(100):
            if len(pipe.got) == 2:
                break
            await asyncio.sleep(0.01)
        await crash(first)
        store = FakeStore(stored=[7])
        pipe2 = Pipeline()
        second = make(tmp_path, pipe2, store=store)
        assert sorted(await second.open()) == [7, 8]
        await asyncio.sleep(0.05)
        assert pipe2.got == [] and store.calls == ["settled"]  # waits for the store first
        store.settle.set()
        await asyncio.wait_for(second.wait_idle(), 5)
        assert [g[1] for g in pipe2.got] == [b"lost"]
        assert store.calls == ["settled", "query"]
        await second.close()

    async def test_failed_fsync_refused_and_never_delivered(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A request whose fsync fails is refused (retry), and neither this process nor
        the next start delivers it, though its bytes are on disk beside a request the next
        start does deliver."""
        pipe = Pipeline()
        pipe.gate.clear()
        intake = make(tmp_path, pipe)
        await intake.open()
        await put(intake, b"held", key=1)  # same file as the refused one, not done
        fail_next_fsync(monkeypatch)
        with pytest.raises(Retryable, match="cannot fsync"):
            await put(intake, b"refused", key=2)
        await put(intake, b"next", key=3)
        await asyncio.sleep(0.05)
        await crash(intake)
        assert pipe.got == []
        pipe2 = Pipeline()
        again = make(tmp_path, pipe2)
        assert sorted(await again.open()) == [1, 3]
        await asyncio.wait_for(again.wait_idle(), 5)
        await again.close()
        assert sorted(g[1] for g in pipe2.got) == [b"held", b"next"]

    async def test_full_is_refused_with_a_delay(self, tmp_path: Path) -> None:
        """Beyond max_mib waiting to be delivered: Retryable with a delay; room again once
        the pipeline takes what waits."""
        pipe = Pipeline()
        pipe.gate.clear()
        intake = make(tmp_path, pipe, max_mib=1)
        await intake.open()
        await put(intake, b"x" * 700_000, key=1)
        with pytest.raises(Retryable, match="intake is full") as err:
            await put(intake, b"y" * 700_000, key=2)
        assert err.value.retry_after > 0
        pipe.gate.set()
        await asyncio.wait_for(intake.wait_idle(), 5)
        await put(intake, b"y" * 700_000, key=2)
        await asyncio.wait_for(intake.wait_idle(), 5)
        assert len(pipe.got) == 2 and intake.metrics["intake_refused_requests"] == 1
        await intake.close()

    async def test_retryable_retried_permanent_quarantined(self, tmp_path: Path) -> None:
        """A retryable refusal is tried again after its delay; a permanent one is not
        retried forever: the requests handed on with it go again one by one, its bytes
        are kept under quarantine/, logged, and the requests behind it go on."""
        pipe = Pipeline()
        pipe.fail[b"later"] = [Retryable("busy", retry_after=0.01)] * 2
        pipe.fail[b"never"] = [InvalidData("refused for good")] * 10
        intake = make(tmp_path, pipe, concurrency=1)
        await intake.open()
        for body in (b"later", b"never", b"after"):
            await put(intake, body)
        await asyncio.wait_for(intake.wait_idle(), 5)
        assert [g[1] for g in pipe.got] == [b"later", b"after"]
        assert intake.metrics["intake_delivery_retries"] == 2
        kept = os.listdir(tmp_path / "intake" / "quarantine")
        assert len(kept) == 1 and kept[0].endswith("-traces.pb")
        assert (tmp_path / "intake" / "quarantine" / kept[0]).read_bytes() == b"never"
        (event, kw), = [e for e in intake.log.events if e[0] == "intake_request_quarantined"]
        assert "refused for good" in kw["error"] and kw["path"].endswith(kept[0])
        await intake.close()
        pipe2 = Pipeline()
        again = make(tmp_path, pipe2)
        assert await again.open() == []
        await again.close()

    async def test_concurrency_bounded(self, tmp_path: Path) -> None:
        """At most ``concurrency`` requests are in the pipeline at once."""
        pipe = Pipeline()
        pipe.gate.clear()
        intake = make(tmp_path, pipe, concurrency=3)
        await intake.open()
        for i in range(10):
            await put(intake, b"r%d" % i)
        await asyncio.sleep(0.05)
        assert pipe.running == 3
        pipe.gate.set()
        await asyncio.wait_for(intake.wait_idle(), 5)
        assert pipe.most == 3 and len(pipe.got) == 10
        await intake.close()

    async def test_a_burst_goes_in_few_batches_never_mixing_tenants(
            self, tmp_path: Path) -> None:
        """Requests waiting together are handed on together (one batch per signal and
        tenant), so a burst of small requests costs a few passes through the pipeline."""
        pipe = Pipeline()
        pipe.gate.clear()
        intake = make(tmp_path, pipe, concurrency=2)
        await intake.open()
        for i in range(200):
            await intake.put("traces", "t1" if i % 4 else "t2", i + 1, "pb", 0, b"s%d" % i)
        pipe.gate.set()
        await asyncio.wait_for(intake.wait_idle(), 5)
        assert sorted(g[3] for g in pipe.got) == list(range(1, 201))
        assert all(g[2] == ("t1" if (g[3] - 1) % 4 else "t2") for g in pipe.got)
        assert pipe.batches <= 6, pipe.batches
        await intake.close()

    async def test_close_leaves_what_cannot_be_delivered(self, tmp_path: Path) -> None:
        """At shutdown a pipeline that keeps refusing does not hold the process: what is
        left stays logged, refused to new requests, and goes at the next start."""
        pipe = Pipeline()
        pipe.fail[b"stuck"] = [Retryable("down", retry_after=0.05)] * 1000
        intake = make(tmp_path, pipe)
        await intake.open()
        pipe.gate.clear()
        await put(intake, b"slow", key=4)
        await put(intake, b"stuck", key=5)
        asyncio.get_running_loop().call_later(0.1, pipe.gate.set)
        await asyncio.wait_for(intake.close(within=0.3), 3)
        assert [g[1] for g in pipe.got] == [b"slow"]  # delivered while closing
        with pytest.raises(Retryable, match="shutting down"):
            await put(intake, b"late")
        pipe2 = Pipeline()
        again = make(tmp_path, pipe2)
        assert await again.open() == [5]
        await asyncio.wait_for(again.wait_idle(), 5)
        assert [g[1] for g in pipe2.got] == [b"stuck"]
        await again.close()

    async def test_segments_roll_over_and_go_once_done(self, tmp_path: Path) -> None:
        """Many requests across small segments: all delivered once, after a crash too, and
        only segments holding undelivered requests stay."""
        pipe = Pipeline()
        pipe.gate.clear()
        intake = make(tmp_path, pipe, segment_bytes=4096, concurrency=2)
        await intake.open()
        for i in range(40):
            await put(intake, b"%03d" % i + b"." * 500, key=i + 1)
        assert len(os.listdir(tmp_path / "intake")) > 4
        pipe.gate.set()
        for _ in range(200):
            if len(pipe.got) >= 20:
                break
            await asyncio.sleep(0.005)
        await crash(intake)
        pipe2 = Pipeline()
        again = make(tmp_path, pipe2, segment_bytes=4096)
        replayed = await again.open()
        await asyncio.wait_for(again.wait_idle(), 5)
        assert sorted({g[3] for g in pipe.got} | {g[3] for g in pipe2.got}) == \
            list(range(1, 41))
        assert not {g[3] for g in pipe.got} & set(replayed)
        await again.close()
        assert len(os.listdir(tmp_path / "intake")) == 1


class TestIntakeRecovery:
    """What the first review found (each fails on f942b31)."""

    async def test_done_refused_by_the_disk_is_written_later(self, tmp_path: Path) -> None:
        """A DONE record the disk refuses once is written with the next one: a later start
        (an hour on, beyond any store lookback) delivers nothing again."""
        pipe = Pipeline()
        a = make(tmp_path, pipe)
        await a.open()
        real = a._log.append
        failed: list[int] = []

        def append(rec: bytearray, seq: int | None = None) -> int:
            if rec[HEADER.size] == DONE and not failed:
                failed.append(1)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(rec, seq)

        a._log.append = append  # type: ignore[method-assign]
        await put(a, b"span", key=42)
        await asyncio.wait_for(a.wait_idle(), 5)
        await put(a, b"other", key=43)
        await asyncio.wait_for(a.wait_idle(), 5)
        await a.close()
        assert failed and [g[3] for g in pipe.got] == [42, 43]
        pipe2 = Pipeline()
        b = make(tmp_path, pipe2)
        assert await b.open() == []
        await b.close()

    async def test_store_unreadable_at_start_is_asked_again(self, tmp_path: Path) -> None:
        """The store failing to answer at start does not make its requests delivered
        twice: it is asked again."""
        pipe = Pipeline()
        first = make(tmp_path, pipe)
        await first.open()
        first._done = lambda *recs: None  # type: ignore[method-assign]  # killed before DONE
        await put(first, b"stored", key=7)
        for _ in range(100):
            if pipe.got:
                break
            await asyncio.sleep(0.01)
        await crash(first)
        store = FakeStore(stored=[7], fail=1)
        store.settle.set()
        pipe2 = Pipeline()
        second = make(tmp_path, pipe2, store=store)
        await second.open()
        await asyncio.wait_for(second.wait_idle(), 5)
        await second.close()
        assert pipe2.got == [] and store.calls == ["settled", "query", "settled", "query"]

    async def test_new_requests_go_while_the_replay_waits(self, tmp_path: Path) -> None:
        """While the store has not inserted its own backlog (the replay's check waits),
        new requests are delivered; the replayed ones after the check."""
        pipe = Pipeline()
        pipe.gate.clear()
        first = make(tmp_path, pipe)
        await first.open()
        await put(first, b"old", key=1)
        await crash(first)
        store = FakeStore(stored=[])
        pipe2 = Pipeline()
        second = make(tmp_path, pipe2, store=store)
        assert await second.open() == [1]
        await put(second, b"new", key=2)
        for _ in range(100):
            if pipe2.got:
                break
            await asyncio.sleep(0.01)
        assert [g[1] for g in pipe2.got] == [b"new"]
        store.settle.set()
        await asyncio.wait_for(second.wait_idle(), 5)
        assert [g[1] for g in pipe2.got] == [b"new", b"old"]
        await second.close()

    async def test_quarantined_bytes_survive_later_runs(self, tmp_path: Path) -> None:
        """Sequence numbers start again with an empty log: a quarantined request's file is
        never overwritten by a later run's."""
        for body in (b"first", b"", b"second"):  # a run without traffic in between
            pipe = Pipeline()
            pipe.fail[body] = [InvalidData("refused for good")]
            a = make(tmp_path, pipe)
            await a.open()
            if body:
                await put(a, body)
            await asyncio.wait_for(a.wait_idle(), 5)
            await a.close()
        q = tmp_path / "intake" / "quarantine"
        assert sorted((q / n).read_bytes() for n in os.listdir(q)) == [b"first", b"second"]

    async def test_a_bug_is_tried_again_then_kept(self, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        """An error neither retryable nor InvalidData (a bug) is tried ERROR_TRIES times,
        then the requests handed on together go once each, and the one failing is kept
        aside; once is not enough to lose a request from the pipeline."""
        monkeypatch.setattr(intake_mod, "ERROR_TRIES", 3)
        pipe = Pipeline()
        pipe.fail[b"once"] = [TypeError("flaky")]
        pipe.fail[b"always"] = [TypeError("broken")] * 10
        a = make(tmp_path, pipe)
        await a.open()
        a._close_ev.set()  # no waits between tries (not closing)
        await put(a, b"once")
        await put(a, b"always")
        await asyncio.wait_for(a.wait_idle(), 5)
        assert [g[1] for g in pipe.got] == [b"once"]
        assert len(pipe.fail[b"always"]) == 7
        assert a.metrics["intake_quarantined_requests"] == 1
        a._close_ev.clear()
        await a.close()

    async def test_correlator_backed_up_stores_nothing_twice(self, tmp_path: Path) -> None:
        """The intake behind a Fanout whose connector is backed up: refused before the
        exporter stores, so the retries store the request once."""
        stored: list[int] = []

        class Exporter:
            async def consume(self, batch: Any) -> None:
                stored.append(batch.requests[0][0])

        class Correlator:
            busy = 2

            def admit(self) -> None:
                if self.busy:
                    self.busy -= 1
                    raise Retryable("attribution output is backed up", retry_after=0.01)

            async def consume(self, batch: Any) -> None:
                self.admit()

        fan = Fanout([Exporter()], [Correlator()])
        a = Intake(str(tmp_path / "intake"), IntakeConfig(), decode,
                   lambda signal, batch: fan.consume(batch), None, _Log())
        await a.open()
        await put(a, b"span", key=9)
        await asyncio.wait_for(a.wait_idle(), 5)
        await a.close()
        assert stored == [9] and a.metrics["intake_delivery_retries"] == 2


class Rows:
    """An exporter storing every batch it is given: rows stored per request id."""

    def __init__(self, refuse: int = 0) -> None:
        self.rows: dict[int, int] = {}
        self.refuse = refuse  # a request id this exporter refuses for good (Kafka: too big)

    async def consume(self, batch: SpanBatch) -> None:
        if any(k == self.refuse for k, _ in batch.requests):
            raise InvalidData("one item is over producer.max_message_bytes")
        for key, n in batch.requests:
            self.rows[key] = self.rows.get(key, 0) + n


class TestIntakeStoresOnce:
    """What the second review found: paths where the intake's retries stored rows twice."""

    @staticmethod
    async def run(tmp_path: Path, fan: Fanout, keys: list[int]) -> Intake:
        a = Intake(str(tmp_path / "intake"), IntakeConfig(concurrency=1), decode,
                   lambda signal, batch: fan.consume(batch), None, _Log())
        await a.open()
        for k in keys:
            await a.put("traces", "t1", k, "pb", 0, b"x%d" % k)
        await asyncio.wait_for(a.wait_idle(), 5)
        await a.close()
        return a

    async def test_one_exporter_refusing_what_another_stored(self, tmp_path: Path) -> None:
        """Exporters [clickhouse, kafka], kafka refusing one request of a group for good:
        nothing given twice; the group is logged as partly delivered, not split."""
        ch, kafka = Rows(), Rows(refuse=13)
        a = await self.run(tmp_path, Fanout([ch, kafka]), [11, 12, 13, 14])
        assert ch.rows == {11: 1, 12: 1, 13: 1, 14: 1}
        assert a.metrics["intake_partly_delivered_requests"] >= 1
        assert not (tmp_path / "intake" / "quarantine").exists()

    async def test_connector_failing_after_the_store(self, tmp_path: Path) -> None:
        """The correlator failing (a bug) after the exporter stored: stored once."""
        class Buggy:
            def admit(self) -> None:
                pass

            async def consume(self, batch: Any) -> None:
                raise KeyError("a bug")

        ch = Rows()
        await self.run(tmp_path, Fanout([ch], [Buggy()]), [21])
        assert ch.rows == {21: 1}

    async def test_connector_backed_up_after_the_store(self, tmp_path: Path) -> None:
        """The correlator admitting the batch, then backed up by the time the exporter
        has stored it (for longer than any retry deadline): waited out, stored once."""
        class BackedUp:
            refusals = 5

            def admit(self) -> None:
                pass

            async def consume(self, batch: Any) -> None:
                if self.refusals:
                    self.refusals -= 1
                    raise Retryable("attribution output is backed up", retry_after=0.01)

        ch, conn = Rows(), BackedUp()
        await self.run(tmp_path, Fanout([ch], [conn]), [31])
        assert ch.rows == {31: 1} and conn.refusals == 0


class FakeStore:
    """The parts of the clickhouse exporter the intake uses: ``settled`` (held until
    ``settle`` is set) and ``query`` (the stored request ids)."""

    database = "db"

    def __init__(self, stored: list[int], fail: int = 0) -> None:
        self.stored = stored
        self.settle = asyncio.Event()
        self.calls: list[str] = []
        self.fail = fail  # queries refused first

    async def settled(self) -> None:
        self.calls.append("settled")
        await self.settle.wait()

    async def query(self, sql: str, parameters: Any = None) -> tuple[list[str], list[Any]]:
        self.calls.append("query")
        if self.fail:
            self.fail -= 1
            raise Retryable("clickhouse: connection refused")
        return ["request"], [(k,) for k in self.stored if f"{k}" in sql]

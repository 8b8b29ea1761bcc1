"""The intake log: a request answered once its bytes are on local disk, delivered behind.

Without it an OTLP request is answered when the whole pipeline has taken it: decoded into
records, its rows logged by the ``clickhouse`` exporter, the correlator fed. At half of
issue #16's load that made the answer wait 30-45 ms (decoding 10, columns 2, the sending
queue's fsync 11-14, the correlator 8-10), and p99 over 100 ms. With an intake
(``intake:`` under the ``otlp`` receiver) the receiver checks the request as a gateway does
(on its bytes, natively for the usual ones: the same refusals and ``partial_success``),
appends it as received to this log, and answers once an ``fsync`` covers it (group
commit: ``LogWriter``, shared with the sending queue); a drainer then decodes the logged
requests (on a thread of its own) and hands the waiting ones of one signal and tenant to
the pipeline as one batch, ``concurrency`` batches at a time, in order of arrival, and
logs them *done* once the pipeline has them.

Nothing answered is lost, nothing is delivered twice:

* a request whose fsync failed is refused (the client retries) and named in a ``FORGET``
  record: never delivered, though its bytes may be on disk;
* the drainer takes a request only once its fsync is done;
* a *done* record the disk refused is written again before the next record;
* at start the log is read back; a request not done is delivered again, unless the
  pipeline's store holds its rows already (delivered, the process killed before its *done*
  record): the store is asked, for those requests' ids, once its own sending queue has
  inserted what it held (``settled``; rows carry their request's id), and asked again
  until it answers. New requests are delivered meanwhile. A pipeline without a store (a
  gateway writing to Kafka) gets such a request again: at least once, as a resend would;
* a retryable refusal by the pipeline (the memory limiter, a full sending queue, the
  correlator backed up: ``Fanout`` asks it before storing, so a retry stores nothing
  twice) is retried with the delay it asks for, for as long as it lasts (the log then
  fills and new requests are refused: backpressure). A request refused for good
  (``InvalidData``: the check before the answer and the decoding after it disagree, which
  tests rule out), or failing with any other error ``ERROR_TRIES`` times in a row (a bug),
  is not retried forever: its bytes are kept in ``quarantine/`` beside the log, under a
  name never used before, and the error is logged with the file's name.

Backpressure: ``max_mib`` bounds the requests logged and not yet delivered (they are kept
in memory as their bytes too); beyond it a request is refused with a retryable status and
a delay, as when the disk refuses a write.

Records (``pipeline/disklog``'s framing): ``REQUEST`` ``[seq, signal, tenant, key, format,
rejected, unix time, body]``, ``DONE`` ``[seq, ...]``, ``FORGET`` ``[seq, ...]``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.config import PositiveInt
from pipeline.disklog.segments import FORGET, Scan, Segment, delete_done, record, segments
from pipeline.disklog.writer import LogWriter
from pipeline.errors import ConfigError, InvalidData, PartlyStored, Retryable
from pipeline.receivers.idempotency import stored_among
from pipeline.records import concat

REQUEST, DONE = 5, 3  # and the writer's FORGET (4)
CLOSE_WITHIN_S = 30.0  # at shutdown, delivering what is logged for at most this long
ERROR_TRIES = 5  # an error neither retryable nor InvalidData: tried this often, then kept
STORE_MARGIN_S = 60.0  # rows stored at most this long before their request was logged
# requests handed on as one batch: up to this many bytes (decoded, a span takes about 7x
# its wire size in Python objects: 8 passes of 1 MiB hold ~60 MB) ...
GROUP_BYTES = 1 << 20
GROUP_REQUESTS = 512  # ... and this many requests
LEFT = "left"  # a delivery cut short by the shutdown: the request stays logged


class IntakeConfig(msgspec.Struct, forbid_unknown_fields=True):
    directory: str = "intake"  # under the service's data_dir, one directory per receiver
    max_mib: PositiveInt = 64  # logged, not yet delivered: beyond, retry later
    concurrency: PositiveInt = 8  # batches (of waiting requests) handed on at once

    def validate(self, key: str) -> None:
        if not self.directory:
            raise ConfigError(f"{key}.directory: must not be empty")


@dataclass
class Logged:
    seq: int
    signal: str
    tenant: str
    key: int
    fmt: str  # "pb" (protobuf as received) or "json"
    rejected: int  # items the check before the answer refused
    at: float  # unix time it was logged
    body: bytes
    segment: int
    size: int


_PAYLOAD = tuple[int, str, str, int, str, int, float, bytes]  # a REQUEST record's
Decode = Callable[[str, str, bytes], Any]  # (signal, format, body) -> Decoded
Deliver = Callable[[str, Any], Awaitable[None]]  # (signal, batch)


class Intake:
    def __init__(self, directory: str, cfg: IntakeConfig, decode: Decode, deliver: Deliver,
                 store: Any, log: Any, segment_bytes: int | None = None) -> None:
        self.directory = directory
        self.max_bytes = cfg.max_mib << 20
        self._decode = decode
        self._deliver = deliver
        self.store = store
        self.log = log
        self.metrics: dict[str, int] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="intake-fsync")
        # decoding off the event loop: the interpreter then switches back to the loop
        # every few milliseconds, where a request's decoding held it for all its 5-10 ms
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="intake-decode")
        self._segments: list[Segment] = []
        self._log = LogWriter(directory, self._segments, self._io, segment_bytes)
        self._records: dict[int, Logged] = {}  # logged, not done
        self._ready: deque[Logged] = deque()  # synced, not yet handed on
        self._done_unwritten: list[int] = []  # done, their DONE record not written yet
        self._next_seq = 1
        self.waiting_bytes = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        self._close_ev = asyncio.Event()  # cuts retry waits short
        self._give_up_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<Intake {self.directory} waiting={len(self._records)}>"

    def __len__(self) -> int:
        """Requests logged and not yet delivered."""
        return len(self._records)

    def _metric(self, name: str, n: int = 1) -> None:
        self.metrics[name] = self.metrics.get(name, 0) + n

    # ---- start: read the log back --------------------------------------------------------

    async def open(self) -> list[int]:
        """Read the log back and start delivering; the keys of the requests read back (not
        done), which the receiver remembers as delivered (a resend is answered at once)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            await asyncio.get_running_loop().run_in_executor(self._io, self._read_all)
            self._log.new_segment()
        except OSError as err:
            raise ConfigError(f"intake: cannot use {self.directory}: {err}") from err
        replayed = list(self._records.values())
        self._task = asyncio.create_task(self._drain(), name=f"intake-{self.directory}")
        if replayed:
            self.log.info("intake_replay", requests=len(replayed),
                          bytes=self.waiting_bytes, directory=self.directory)
            self._replay_task = asyncio.create_task(self._replay(replayed),
                                                    name=f"intake-replay-{self.directory}")
        return [r.key for r in replayed]

    def _read_all(self) -> None:
        top = 0
        for number, path in segments(self.directory):
            seg = Segment(number, path)
            self._segments.append(seg)
            with open(path, "rb") as f:
                scan = Scan(f.read())
            for kind, payload, size, offset in scan:
                if kind == REQUEST:
                    try:
                        p = msgspec.convert(payload, _PAYLOAD)
                    except msgspec.ValidationError as err:
                        self.log.error("intake_record_unreadable", path=path, offset=offset,
                                       error=str(err)[:200])
                        continue
                    seq, signal, tenant, key, fmt, rejected, at, body = p
                    self._records[seq] = Logged(seq, signal, tenant, key, fmt, rejected, at,
                                                body, number, size)
                    seg.pending += 1
                    top = max(top, seq)
                elif kind == DONE or kind == FORGET:  # [seq, ...]
                    for seq in payload:
                        top = max(top, int(seq))
                        self._drop(int(seq))
            for at, size in scan.damaged:
                self.log.error("intake_record_damaged", path=path, offset=at, size=size)
        self._next_seq = top + 1
        self.waiting_bytes = sum(r.size for r in self._records.values())
        delete_done(self._segments, False, self.log)

    def _drop(self, seq: int) -> Logged | None:
        r = self._records.pop(seq, None)
        if r is not None:
            self.waiting_bytes -= r.size
            for s in self._segments:
                if s.number == r.segment:
                    s.pending -= 1
        return r

    # ---- appending -----------------------------------------------------------------------

    async def put(self, signal: str, tenant: str, key: int, fmt: str, rejected: int,
                  body: bytes) -> None:
        """Log a checked request; return once it is on disk (then it will be delivered,
        even after a crash). ``Retryable`` when the log is full or the disk refuses."""
        if self._closing:
            raise Retryable("intake: shutting down")
        at = time.time()
        framed = record(REQUEST, [self._next_seq, signal, tenant, key, fmt, rejected, at, body])
        if self._records and self.waiting_bytes + len(framed) > self.max_bytes:
            self._metric("intake_refused_requests")
            raise Retryable(f"intake is full ({self.waiting_bytes >> 20} MiB waiting to be "
                            f"delivered, intake.max_mib={self.max_bytes >> 20})",
                            retry_after=1.0)
        seq = self._next_seq
        self._write_done()
        try:
            size = self._log.append(framed, seq)
        except OSError as err:
            self._metric("intake_refused_requests")
            raise Retryable(f"intake: cannot write {self.directory}: {err}",
                            retry_after=5.0) from err
        del framed
        self._next_seq += 1
        rec = Logged(seq, signal, tenant, key, fmt, rejected, at, body,
                     self._segments[-1].number, size)
        self._records[seq] = rec
        self._segments[-1].pending += 1
        self.waiting_bytes += size
        try:
            await self._log.sync()
        except OSError as err:
            self._drop(seq)  # named in a FORGET record by the writer: never delivered
            self._metric("intake_refused_requests")
            raise Retryable(f"intake: cannot fsync {self.directory}: {err}",
                            retry_after=5.0) from err
        except RuntimeError as err:  # closed under it (past the receivers' grace)
            if not self._closing:
                raise
            # fsynced by close and delivered at the next start, or not: a resend then is
            # a duplicate either way (its key is remembered from the log)
            raise Retryable("intake: shutting down") from err
        self._metric("intake_logged_requests")
        self._ready.append(rec)
        self._wake.set()

    # ---- delivering ----------------------------------------------------------------------

    async def _drain(self) -> None:
        while True:
            if not self._ready:
                if not self._records:
                    self._idle.set()
                if self._closing and not self._running:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()
            if not self._ready:  # taken by another pass meanwhile
                self._slots.release()
                continue
            task = asyncio.create_task(self._hand_on(self._take_group()))
            self._running.add(task)

    async def _replay(self, replayed: list[Logged]) -> None:
        """The requests read back at start, less those whose rows the store holds
        (delivered before the crash: done, not delivered again), handed on."""
        stored = await self._stored(replayed)
        skipped = [r for r in replayed if r.key in stored]
        self._done(*skipped)
        again = [r for r in replayed if r.seq in self._records]
        self._metric("intake_replayed_requests", len(again))
        self.log.info("intake_replay_checked", requests=len(replayed), stored=len(skipped))
        self._ready.extendleft(reversed(again))
        self._wake.set()

    async def _stored(self, replayed: list[Logged]) -> set[int]:
        """Which of ``replayed``'s request ids the store holds, asked once its own queue
        has inserted what it held at start; asked again until it answers (a store that
        cannot be read now must not make them delivered twice)."""
        if self.store is None:
            return set()
        delay = 0.5
        while True:
            try:
                settled = getattr(self.store, "settled", None)
                if settled is not None:
                    await settled()
                since = min(r.at for r in replayed) - STORE_MARGIN_S
                return await stored_among(self.store, [r.key for r in replayed], since)
            except Exception as err:
                self.log.warning("intake_store_unreadable", error=str(err)[:300],
                                 retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(30.0, delay * 2)

    def _take_group(self) -> list[Logged]:
        """The next requests to hand on together: the first ready one and those after it
        of the same signal and tenant, up to ``GROUP_BYTES`` / ``GROUP_REQUESTS`` (one
        batch, one pass through the pipeline: the drain keeps up with a burst of small
        requests however long each pass waits for its insert)."""
        first = self._ready.popleft()
        group, rest, size = [first], [], len(first.body)
        while self._ready and len(group) < GROUP_REQUESTS and size < GROUP_BYTES:
            r = self._ready.popleft()
            if (r.signal, r.tenant) == (first.signal, first.tenant):
                group.append(r)
                size += len(r.body)
            else:
                rest.append(r)
        self._ready.extendleft(reversed(rest))
        return group

    async def _hand_on(self, group: list[Logged]) -> None:
        try:
            loop = asyncio.get_running_loop()
            decoded: list[tuple[Logged, Any]] = []
            for rec in group:
                got = await loop.run_in_executor(self._decoder, self._decode_or_error, rec)
                batch = self._decoded(rec, got)
                if batch is not None:
                    decoded.append((rec, batch))
            await self._deliver_group(decoded)
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._running.discard(task)
            self._slots.release()
            self._wake.set()

    def _decode_or_error(self, rec: Logged) -> Any:
        """(On the decoding thread.) The request decoded, or the exception that
        refused it."""
        try:
            return self._decode(rec.signal, rec.fmt, rec.body)
        except Exception as err:
            return err

    def _decoded(self, rec: Logged, decoded: Any) -> Any:
        """The request's batch, named as its tenant's and by its id; None when it could
        not be decoded (kept aside)."""
        if isinstance(decoded, Exception):
            self._quarantine(rec, decoded)
            return None
        if decoded.rejected != rec.rejected:
            self.log.error("intake_check_differs", signal=rec.signal, seq=rec.seq,
                           checked=rec.rejected, decoded=decoded.rejected,
                           reason=str(decoded.message)[:300])
        batch = decoded.batch
        batch.tenant = rec.tenant
        batch.requests = [(rec.key, len(batch))]  # stored with the rows
        return batch

    async def _deliver_group(self, decoded: list[tuple[Logged, Any]],
                             tries: int | None = None) -> None:
        """Hand the group's batches on as one; done once the pipeline has it. Refused for
        good with nothing stored: each request alone (tried once each), so that only the
        one at fault is kept aside. Stored in part (``PartlyStored``: an exporter or the
        correlator refused for good what another consumer took): done, logged, never
        given again (it would be stored twice where it was taken)."""
        recs = [rec for rec, _ in decoded]
        batches = [b for _, b in decoded if len(b)]
        err = await self._deliver_retrying(concat(batches), recs[0],
                                           tries or ERROR_TRIES) if batches else None
        if err == LEFT:
            return
        if isinstance(err, PartlyStored):
            self.log.error("intake_partly_delivered", signal=recs[0].signal,
                           requests=[r.key for r in recs], error=str(err)[:300])
            self._metric("intake_partly_delivered_requests", len(recs))
            err = None
        if err is None:
            self._done(*recs)
            self._metric("intake_delivered_requests", len(recs))
        elif len(decoded) > 1:
            for one in decoded:
                await self._deliver_group([one], tries=1)
        else:
            assert isinstance(err, Exception)  # noqa: S101 - LEFT and None are handled
            self._quarantine(recs[0], err)

    async def _deliver_retrying(self, batch: Any, first: Logged,
                                tries: int) -> Exception | str | None:
        """Deliver ``batch``, again while the pipeline refuses it for now; None once it is
        taken, ``LEFT`` when closing cut it short (it stays logged), or the error that
        refused it for good (``InvalidData``, ``PartlyStored``, or another error ``tries``
        times)."""
        delay, errors, retries = 0.25, 0, 0
        while True:
            try:
                await self._deliver(first.signal, batch)
                return None
            except Retryable as err:
                delay = err.retry_after or min(30.0, delay * 2)
                if retries % 10 == 0:
                    self.log.warning("intake_delivery_refused", signal=first.signal,
                                     seq=first.seq, error=str(err)[:300], retries=retries)
                retries += 1
            except InvalidData as err:
                return err
            except Exception as err:  # a bug: a few more tries, then kept aside
                errors += 1
                if errors >= tries:
                    return err
                self.log.error("intake_delivery_failed", signal=first.signal, seq=first.seq,
                               error=f"{type(err).__name__}: {str(err)[:300]}", tries=errors)
                delay = min(30.0, delay * 2)
            if self._closing and self._give_up_at is not None and \
                    time.monotonic() + delay >= self._give_up_at:
                return LEFT  # left in the log: delivered at the next start
            self._metric("intake_delivery_retries")
            if self._closing:
                await asyncio.sleep(delay)
                continue
            try:  # close() cuts the wait short: one more try at once
                await asyncio.wait_for(self._close_ev.wait(), timeout=delay)
            except TimeoutError:
                pass

    def _done(self, *recs: Logged) -> None:
        """Delivered (or kept aside): one DONE record names them all."""
        self._done_unwritten += [r.seq for r in recs if self._drop(r.seq) is not None]
        self._write_done()
        delete_done(self._segments, True, self.log)
        if not self._records:
            self._idle.set()

    def _write_done(self) -> None:
        """The DONE record of what was delivered since the last one written; kept for the
        next try when the disk refuses it (lost, the request would be delivered again at
        the next start, unless the store has its rows)."""
        if not self._done_unwritten:
            return
        try:
            self._log.append(record(DONE, self._done_unwritten))
            self._done_unwritten = []
        except OSError as err:
            self.log.warning("intake_write_failed", error=str(err), directory=self.directory)

    def _quarantine(self, rec: Logged, err: Exception) -> None:
        """A request the pipeline refuses for good: its bytes kept beside the log, the
        error logged with where they are (never retried forever, never dropped unsaid)."""
        self._metric("intake_quarantined_requests")
        where = os.path.join(self.directory, "quarantine")
        # never an earlier one's name (sequence numbers start again with an empty log)
        path = os.path.join(where, f"{time.time_ns()}-{rec.seq}-{rec.signal}.{rec.fmt}")
        try:
            os.makedirs(where, exist_ok=True)
            with open(path, "xb") as f:
                f.write(rec.body)
        except OSError as werr:
            path = f"not kept: {werr}"
        self.log.error("intake_request_quarantined", signal=rec.signal, tenant=rec.tenant,
                       request=rec.key, error=f"{type(err).__name__}: {str(err)[:300]}",
                       path=path)
        self._done(rec)

    async def wait_idle(self) -> None:
        """Return once every request logged so far is delivered (or quarantined)."""
        while self._records:
            self._idle.clear()
            await self._idle.wait()

    async def close(self, within: float = CLOSE_WITHIN_S) -> None:
        """Deliver what is logged (for at most ``within`` seconds: what is left stays in the
        log for the next start), then stop. New requests are refused from now on."""
        self._closing = True
        self._give_up_at = time.monotonic() + within
        self._wake.set()
        self._close_ev.set()
        if self._replay_task is not None and not self._replay_task.done():
            self._replay_task.cancel()  # what it had not checked stays in the log
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=within + 1)
            except TimeoutError:
                self._task.cancel()
                for t in list(self._running):
                    t.cancel()
            if self._records:
                self.log.warning("intake_left_for_next_start", requests=len(self._records),
                                 bytes=self.waiting_bytes, directory=self.directory)
        self._write_done()
        self._log.close()
        self._io.shutdown(wait=True)
        self._decoder.shutdown(wait=False, cancel_futures=True)

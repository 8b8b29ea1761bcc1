"""The intake log: a request answered once its bytes are on local disk, delivered behind.

Without it an OTLP request is answered when the whole pipeline has taken it: decoded into
records, its rows logged by the ``clickhouse`` exporter, the correlator fed. At half of
issue #16's load that made the answer wait 30-45 ms (decoding 10, columns 2, the sending
queue's fsync 11-14, the correlator 8-10), and p99 over 100 ms. With an intake
(``intake:`` under the ``otlp`` receiver) the receiver checks the request as a gateway does
(on its bytes, natively for the usual ones: the same refusals and ``partial_success``),
appends it as received to this log, and answers once an ``fsync`` covers it (group
commit: ``LogWriter``, shared with the sending queue); a drainer then decodes each logged
request and hands its batch to the pipeline, ``concurrency`` at a time, in order of
arrival, and logs it *done* once the pipeline has it.

Nothing answered is lost, nothing is delivered twice:

* a request whose fsync failed is refused (the client retries) and named in a ``FORGET``
  record: never delivered, though its bytes may be on disk;
* the drainer takes a request only once its fsync is done;
* at start the log is read back; a request not done is delivered again, unless the
  pipeline's store holds its rows already (delivered, the process killed before its *done*
  record): the store is asked once its own sending queue has inserted what it held
  (``settled``), and the rows carry their request's id
  (``receivers/idempotency.stored_request_ids``). A pipeline without a store (a gateway
  writing to Kafka) gets such a request again: at least once, as a resend would be;
* a logged request the pipeline refuses for good (``InvalidData``: the check before the
  answer and the decoding after it disagree, which tests rule out, or a bug) is not
  retried forever: its bytes are kept in ``quarantine/`` beside the log and the error is
  logged with the file's name. A retryable refusal (the memory limiter, a full sending
  queue) is retried with the delay it asks for.

Backpressure: ``max_mib`` bounds the requests logged and not yet delivered (they are kept
in memory as their bytes too); beyond it a request is refused with a retryable status and
a delay, as when the disk refuses a write.

Records (``queue_log``'s framing): ``REQUEST`` ``[seq, signal, tenant, key, format,
rejected, body]``, ``DONE`` ``seq``, ``FORGET`` ``[seq, ...]``.
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
from pipeline.errors import ConfigError, Retryable
from pipeline.exporters.clickhouse.queue_log import (
    DONE,
    FORGET,
    Scan,
    Segment,
    record,
    segments,
)
from pipeline.exporters.clickhouse.queue_writer import LogWriter
from pipeline.receivers.idempotency import stored_request_ids

REQUEST = 5
CLOSE_WITHIN_S = 30.0  # at shutdown, delivering what is logged for at most this long


class IntakeConfig(msgspec.Struct, forbid_unknown_fields=True):
    directory: str = "intake"  # under the service's data_dir, one directory per receiver
    max_mib: PositiveInt = 64  # logged, not yet delivered: beyond, retry later
    concurrency: PositiveInt = 8  # requests handed to the pipeline at once

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
    body: bytes
    segment: int
    size: int


_PAYLOAD = tuple[int, str, str, int, str, int, bytes]  # a REQUEST record's
Decode = Callable[[str, str, bytes], Any]  # (signal, format, body) -> Decoded
Deliver = Callable[[str, Any], Awaitable[None]]  # (signal, batch)


class Intake:
    def __init__(self, directory: str, cfg: IntakeConfig, decode: Decode, deliver: Deliver,
                 store: Any, log: Any, segment_bytes: int | None = None) -> None:
        self.directory = directory
        self.max_bytes = cfg.max_mib << 20
        self.concurrency = cfg.concurrency
        self._decode = decode
        self._deliver = deliver
        self.store = store
        self.log = log
        self.metrics: dict[str, int] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="intake-fsync")
        self._segments: list[Segment] = []
        self._log = LogWriter(directory, self._segments, self._io, segment_bytes)
        self._records: dict[int, Logged] = {}  # logged, not done
        self._ready: deque[Logged] = deque()  # synced, not yet handed on
        self._replayed: list[Logged] = []
        self._next_seq = 1
        self.waiting_bytes = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        self._give_up_at: float | None = None
        self._task: asyncio.Task[None] | None = None

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
        self._replayed = list(self._records.values())
        if self._replayed:
            self.log.info("intake_replay", requests=len(self._replayed),
                          bytes=self.waiting_bytes, directory=self.directory)
        self._task = asyncio.create_task(self._drain(), name=f"intake-{self.directory}")
        return [r.key for r in self._replayed]

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
                    seq, signal, tenant, key, fmt, rejected, body = p
                    self._records[seq] = Logged(seq, signal, tenant, key, fmt, rejected, body,
                                                number, size)
                    seg.pending += 1
                    top = max(top, seq)
                elif kind == DONE or kind == FORGET:
                    for seq in payload if isinstance(payload, list) else [payload]:
                        top = max(top, int(seq))
                        self._drop(int(seq))
            for at, size in scan.damaged:
                self.log.error("intake_record_damaged", path=path, offset=at, size=size)
        self._next_seq = top + 1
        self.waiting_bytes = sum(r.size for r in self._records.values())
        self._delete_done_segments(keep_current=False)

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
        framed = record(REQUEST, [self._next_seq, signal, tenant, key, fmt, rejected, body])
        if self._records and self.waiting_bytes + len(framed) > self.max_bytes:
            self._metric("intake_refused_requests")
            raise Retryable(f"intake is full ({self.waiting_bytes >> 20} MiB waiting to be "
                            f"delivered, intake.max_mib={self.max_bytes >> 20})",
                            retry_after=1.0)
        seq = self._next_seq
        try:
            size = self._log.append(framed, seq)
        except OSError as err:
            self._metric("intake_refused_requests")
            raise Retryable(f"intake: cannot write {self.directory}: {err}",
                            retry_after=5.0) from err
        del framed
        self._next_seq += 1
        rec = Logged(seq, signal, tenant, key, fmt, rejected, body,
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
        self._metric("intake_logged_requests")
        self._ready.append(rec)
        self._wake.set()

    # ---- delivering ----------------------------------------------------------------------

    async def _drain(self) -> None:
        if self._replayed:
            await self._skip_stored(self._replayed)
            self._ready.extendleft(reversed([r for r in self._replayed
                                             if r.seq in self._records]))
            self._replayed = []
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
            rec = self._ready.popleft()
            task = asyncio.create_task(self._hand_on(rec))
            self._running.add(task)

    async def _skip_stored(self, replayed: list[Logged]) -> None:
        """Requests read back whose rows the store holds were delivered before the crash:
        done, not delivered again."""
        if self.store is None:
            return
        try:
            settled = getattr(self.store, "settled", None)
            if settled is not None:
                await settled()
            stored = set(await stored_request_ids(self.store))
        except Exception as err:  # delivered again: at least once rather than lost
            self.log.warning("intake_store_unreadable", error=str(err)[:300])
            return
        skipped = [r for r in replayed if r.key in stored]
        for r in skipped:
            self._done(r)
        self._metric("intake_replayed_requests", len(replayed) - len(skipped))
        self.log.info("intake_replay_checked", requests=len(replayed), stored=len(skipped))

    async def _hand_on(self, rec: Logged) -> None:
        try:
            await self._hand_on_once(rec)
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._running.discard(task)
            self._slots.release()
            self._wake.set()

    async def _hand_on_once(self, rec: Logged) -> None:
        try:
            decoded = self._decode(rec.signal, rec.fmt, rec.body)
        except Exception as err:
            self._quarantine(rec, err)
            return
        if decoded.rejected != rec.rejected:
            self.log.error("intake_check_differs", signal=rec.signal, seq=rec.seq,
                           checked=rec.rejected, decoded=decoded.rejected,
                           reason=str(decoded.message)[:300])
        batch = decoded.batch
        delay = 0.25
        while len(batch):
            batch.tenant = rec.tenant
            batch.requests = [(rec.key, len(batch))]  # stored with the rows
            try:
                await self._deliver(rec.signal, batch)
                break
            except Retryable as err:
                delay = err.retry_after or min(30.0, delay * 2)
                if self._closing and self._give_up_at is not None and \
                        time.monotonic() + delay >= self._give_up_at:
                    return  # left in the log: delivered at the next start
                self._metric("intake_delivery_retries")
                await asyncio.sleep(delay)
            except Exception as err:
                self._quarantine(rec, err)
                return
        self._done(rec)
        self._metric("intake_delivered_requests")

    def _done(self, rec: Logged) -> None:
        if self._drop(rec.seq) is None:
            return
        try:
            self._log.append(record(DONE, rec.seq))
        except OSError as err:  # a lost DONE costs a check against the store at start
            self.log.warning("intake_write_failed", error=str(err), directory=self.directory)
        self._delete_done_segments(keep_current=True)
        if not self._records:
            self._idle.set()

    def _quarantine(self, rec: Logged, err: Exception) -> None:
        """A request the pipeline refuses for good: its bytes kept beside the log, the
        error logged with where they are (never retried forever, never dropped unsaid)."""
        self._metric("intake_quarantined_requests")
        where = os.path.join(self.directory, "quarantine")
        path = os.path.join(where, f"{rec.seq:012d}-{rec.signal}.{rec.fmt}")
        try:
            os.makedirs(where, exist_ok=True)
            with open(path, "wb") as f:
                f.write(rec.body)
        except OSError as werr:
            path = f"not kept: {werr}"
        self.log.error("intake_request_quarantined", signal=rec.signal, tenant=rec.tenant,
                       request=rec.key, error=f"{type(err).__name__}: {str(err)[:300]}",
                       path=path)
        self._done(rec)

    def _delete_done_segments(self, keep_current: bool) -> None:
        while self._segments and self._segments[0].pending <= 0 and \
                (not keep_current or len(self._segments) > 1):
            seg = self._segments.pop(0)
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass

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
        self._log.close()
        self._io.shutdown(wait=True)

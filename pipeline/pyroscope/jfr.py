"""JFR recordings from the Pyroscope Java agent (``/ingest?format=jfr``) -> profile samples.

The agent uploads a multipart form: ``jfr``, a recording made by async-profiler, and
``labels``, a protobuf ``LabelsSnapshot`` (both gzipped by default: inflate them first,
within the receiver's limits). ``parse`` reads the recording, ``jfrlabels.parse_labels``
the snapshot; what they return knows nothing of spanprof's records.

A recording is one or more chunks: a 68-byte header (magic ``FLR\\0``, version 2.x, chunk
size, start time in ns, start ticks, ticks per second, features), then events, each
``size`` (varint, counting itself), ``type id`` (varint), payload. Type 0 is the metadata
(``jfrmeta.parse_metadata``), type 1 a checkpoint: constant pools (threads, stack traces,
methods, classes, symbols, strings, frame types, thread states), which events refer to by
key (``jfrpools``). Every other type is laid out as the metadata says; no offset is
assumed, and a field is used only if the metadata declares it with the expected type
(``TypeDef.field_at``).

Each event of a sample type becomes one ``JfrSample`` per measure: the event types, what
each measures, the interval, labels and stacks are in ``jfrsamples``.

Values and times are as recorded (converted to ns), not range-checked: the receiver
checks them as it checks pprof's. Hostile input: see ``jfrwire`` and ``jfrmeta``. Events
are scanned (sizes checked, counted against ``max_events``) before any is decoded, and each
is read within its own bounds, so it cannot read past its size. Events of other types are
counted, not read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from pipeline.pyroscope.jfrlabels import LabelsSnapshot
from pipeline.pyroscope.jfrmeta import STRING_TYPES, TypeDef, parse_metadata, read_fields
from pipeline.pyroscope.jfrpools import Pools
from pipeline.pyroscope.jfrsamples import MEASURES, EventPlan, JfrSample
from pipeline.pyroscope.jfrwire import (
    DEFAULT_LIMITS,
    HEADER_SIZE,
    Budget,
    JfrError,
    JfrTooLarge,
    Limits,
    read_header,
    uvar,
)

__all__ = ["Recording", "parse"]

DEFAULT_INTERVAL_NS = 10_000_000  # the agent's default profilingInterval (100 Hz)


class Recording(NamedTuple):
    samples: list[JfrSample]
    start_ns: int  # the first chunk's start, Unix ns
    end_ns: int  # the last chunk's start + duration
    event_counts: dict[str, int]  # events of each type, made into samples or not
    settings: dict[str, str]  # jdk.ActiveSetting name -> value (event, interval, alloc...)
    skipped: int  # events read but not made into samples: CPU samples of sleeping threads


def parse(data: bytes, labels: LabelsSnapshot | None = None,
          limits: Limits = DEFAULT_LIMITS, *,
          interval_ns: int = DEFAULT_INTERVAL_NS) -> Recording:
    """A whole recording -> its samples, labelled from ``labels``. ``JfrError`` (a
    ``ValueError`` and ``InvalidData``) if any of it cannot be read; ``JfrTooLarge`` if it
    is over ``limits``."""
    data = bytes(data)
    if data[:2] == b"\x1f\x8b":
        raise JfrError("jfr: the recording is gzip-compressed: inflate it first")
    if len(data) < HEADER_SIZE:
        raise JfrError(f"jfr: {len(data)} bytes, fewer than a chunk header's {HEADER_SIZE}")
    budget = Budget(limits)
    rec = Recording([], 0, 0, {}, {}, 0)
    pos, n, skipped, start_ns, end_ns = 0, 0, 0, -1, 0
    while pos < len(data):
        n += 1
        if n > limits.max_chunks:
            raise JfrTooLarge(f"jfr: more than max_chunks={limits.max_chunks} (byte {pos})")
        chunk = _Chunk(data, pos, budget, labels, interval_ns, rec)
        skipped += chunk.read()
        start_ns = chunk.header.start_ns if start_ns < 0 else start_ns
        end_ns = chunk.header.start_ns + chunk.header.duration_ns
        pos = chunk.end
    return rec._replace(start_ns=start_ns, end_ns=end_ns, skipped=skipped)


class _Chunk:
    """One chunk: its header, events scanned, metadata and pools read, samples made."""

    def __init__(self, data: bytes, pos: int, budget: Budget, labels: LabelsSnapshot | None,
                 interval_ns: int, rec: Recording) -> None:
        self.data, self.pos, self.budget, self.snapshot, self.rec = data, pos, budget, labels, rec
        self.interval_ns = interval_ns
        self.header = read_header(data, pos)
        self.end = pos + self.header.size

    def read(self) -> int:
        """Reads the whole chunk into the recording; returns how many events it skipped."""
        data, end = self.data, self.end
        events: list[tuple[int, int, int]] = []  # (payload offset, end, type id)
        metadata, checkpoints = None, []
        pos = self.pos + HEADER_SIZE
        budget = self.budget
        left = budget.limits.max_events - budget.events  # events this chunk may still have
        while pos < end:
            try:
                size, p = data[pos], pos + 1  # a size and a type of one byte: most events
                if size >= 0x80:
                    size, p = uvar(data, pos)
                tid, p = data[p], p + 1
                if tid >= 0x80:
                    tid, p = uvar(data, p - 1)
            except IndexError:
                raise JfrError(f"jfr: the event at byte {pos} runs past the data") from None
            if not p - pos <= size <= end - pos:
                raise JfrError(f"jfr: the event at byte {pos} has size {size}; it must be "
                               f"{p - pos}..{end - pos}")
            left -= 1
            if left < 0:
                raise JfrTooLarge(f"jfr: more than max_events={budget.limits.max_events} "
                                  f"(at byte {pos})")
            if tid == 0:
                metadata = (p, pos + size)  # the last one holds every type
            elif tid == 1:
                checkpoints.append((p, pos + size))
            else:
                events.append((p, pos + size, tid))
            pos += size
        budget.events = budget.limits.max_events - left
        if metadata is None:
            raise JfrError(f"jfr: the chunk at byte {self.pos} has no metadata event")
        p, e = metadata
        self.types = _guard(p, parse_metadata, data[p:e], 0, p, self.budget)
        self.pools = Pools(self.types, self.budget, self.snapshot)
        for p, e in checkpoints:
            _guard(p, self.pools.read_checkpoint, data[p:e], p)
        return self._events(events)

    def _events(self, events: list[tuple[int, int, int]]) -> int:
        counts = self.rec.event_counts
        for tid, n in Counter(e[2] for e in events).items():
            t = self.types.get(tid)
            name = t.name if t is not None else f"(type {tid}, not in the metadata)"
            counts[name] = counts.get(name, 0) + n
        setting = self.pools.by_name.get("jdk.ActiveSetting")
        if setting is not None:
            self._settings([e for e in events if e[2] == setting.id], setting)
        plans = {t.id: EventPlan(t, self.pools, self.header, self.rec.settings,
                                 self.interval_ns, self.rec.samples)
                 for t in self.types.values() if t.name in MEASURES}
        data, skipped, p = self.data, 0, 0
        try:
            for p, e, tid in events:
                plan = plans.get(tid)
                if plan is not None:
                    skipped += plan.emit(data, p, e)
        except IndexError:
            raise JfrError(f"jfr: the event at byte {p} runs past its size") from None
        return skipped

    def _settings(self, events: list[tuple[int, int, int]], t: TypeDef) -> None:
        i = t.field_at("name", self.types, STRING_TYPES)
        j = t.field_at("value", self.types, STRING_TYPES)
        if i < 0 or j < 0:
            return
        specs = [self.pools.layouts.of_field(f, 0) for f in t.fields[:max(i, j) + 1]]
        for p, e, _ in events:
            vals = _guard(p, read_fields, specs, self.data[p:e], self.budget, p)
            self.rec.settings[self.pools.text(vals[i])] = self.pools.text(vals[j])


def _guard(at: int, fn: Any, *args: Any) -> Any:
    """fn(*args) reading the event at byte ``at`` from a copy of its bytes: reading past
    the copy's end (IndexError) is the event running past its size."""
    try:
        return fn(*args)
    except IndexError:
        raise JfrError(f"jfr: the event at byte {at} runs past its size") from None

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

Samples, one per (event, measure); values in ns, bytes or counts:

=============================== ================================= =========================
event                           measures                          notes
=============================== ================================= =========================
jdk.ExecutionSample             cpu: the sampling interval        wall if the recording's
                                                                  ``event`` setting is wall;
                                                                  a sleeping thread's sample
                                                                  is not CPU (skipped)
profiler.WallClockSample        wall: interval x ``samples``      async-profiler >= 3
jdk.NativeMethodSample          wall: the sampling interval       the JDK's own JFR
jdk.ObjectAllocationInNewTLAB   alloc_objects: 1,                 async-profiler writes the
                                alloc_bytes: ``tlabSize``         sample's weight there
jdk.ObjectAllocationOutsideTLAB alloc_objects: 1, alloc_bytes: ``allocationSize``
jdk.ObjectAllocationSample      alloc_objects: 1, alloc_bytes: ``weight``
jdk.JavaMonitorEnter,           lock_count: 1, lock_ns: ``duration``
jdk.ThreadPark, profiler.NativeLock
profiler.LiveObject             live_objects: 1, live_bytes: ``allocationSize``
profiler.Malloc                 malloc_count: 1, malloc_bytes: ``size``
=============================== ================================= =========================

The sampling interval is the recording's ``interval`` setting (``jdk.ActiveSetting``; its
``wall`` setting for wall samples when it has one), else the caller's ``interval_ns`` (from
the request's ``sampleRate``). Labels: the snapshot's labels of the event's ``contextId``,
then ``span_id`` (16 hex digits) from ``spanId``, ``span_name`` (the snapshot's string
``spanName``) and ``trace_id`` (32 hex digits) from ``traceIdHi``/``traceIdLo``, where the
event has these fields and they are not 0 (the async-profiler fork in the Pyroscope agent
adds them; the span is the local root span). A context or span name the snapshot lacks
gives no label. Stacks are leaf first; a Java frame is ``package.Class.method`` with no
file, a native one (frame types Native, C++, Kernel) its symbol with its library as file.

Values and times are as recorded (converted to ns), not range-checked: the receiver
checks them as it checks pprof's. Hostile input: see ``jfrwire`` and ``jfrmeta``. Events
are scanned (sizes checked, counted against ``max_events``) before any is decoded, and each
is read within its own bounds, so it cannot read past its size. Events of other types are
counted, not read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any, NamedTuple

from pipeline.pyroscope.jfrlabels import LabelsSnapshot
from pipeline.pyroscope.jfrmeta import (
    INT_TYPES,
    K_VAR,
    LONG_TYPES,
    STRING_TYPES,
    TypeDef,
    parse_metadata,
    read_value,
)
from pipeline.pyroscope.jfrpools import Frame, JfrThread, Pools
from pipeline.pyroscope.jfrwire import (
    DEFAULT_LIMITS,
    HEADER_SIZE,
    SHORT_VARINTS,
    VARINTS,
    Budget,
    JfrError,
    JfrTooLarge,
    Limits,
    read_header,
    s32,
    s64,
    uvar,
    varint_value,
)

__all__ = ["MEASURES", "JfrError", "JfrSample", "JfrTooLarge", "Limits", "Recording", "parse"]

DEFAULT_INTERVAL_NS = 10_000_000  # the agent's default profilingInterval (100 Hz)
# event type -> its measures: (measure, the field holding its value; "" for 1 or the interval)
MEASURES: dict[str, tuple[tuple[str, str], ...]] = {
    "jdk.ExecutionSample": (("cpu", ""),),
    "profiler.WallClockSample": (("wall", "samples"),),
    "jdk.NativeMethodSample": (("wall", ""),),
    "jdk.ObjectAllocationInNewTLAB": (("alloc_objects", ""), ("alloc_bytes", "tlabSize")),
    "jdk.ObjectAllocationOutsideTLAB": (("alloc_objects", ""),
                                        ("alloc_bytes", "allocationSize")),
    "jdk.ObjectAllocationSample": (("alloc_objects", ""), ("alloc_bytes", "weight")),
    "jdk.JavaMonitorEnter": (("lock_count", ""), ("lock_ns", "duration")),
    "jdk.ThreadPark": (("lock_count", ""), ("lock_ns", "duration")),
    "profiler.NativeLock": (("lock_count", ""), ("lock_ns", "duration")),
    "profiler.LiveObject": (("live_objects", ""), ("live_bytes", "allocationSize")),
    "profiler.Malloc": (("malloc_count", ""), ("malloc_bytes", "size")),
}
# the event fields a sample is made of, and the type each must be declared with
_EVENT_FIELDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "startTime": (LONG_TYPES, False), "duration": (LONG_TYPES, False),
    "sampledThread": (("java.lang.Thread",), True), "eventThread": (("java.lang.Thread",), True),
    "stackTrace": (("jdk.types.StackTrace",), True),
    "state": (("jdk.types.ThreadState",), True),
    "samples": (INT_TYPES, False), "tlabSize": (LONG_TYPES, False),
    "allocationSize": (LONG_TYPES, False), "weight": (LONG_TYPES, False),
    "size": (LONG_TYPES, False),
    **{k: (LONG_TYPES, False) for k in ("contextId", "spanId", "spanName", "traceIdHi",
                                        "traceIdLo")},
}
_LABEL_FIELDS = ("contextId", "spanId", "spanName", "traceIdHi", "traceIdLo")


class JfrSample(NamedTuple):
    event: str  # the event type's name: jdk.ExecutionSample ...
    measure: str  # cpu, wall, alloc_objects, alloc_bytes, lock_count, lock_ns ... (MEASURES)
    value: int  # ns for cpu, wall and lock_ns; bytes for *_bytes; else a count
    time_ns: int  # the event's start, Unix ns
    thread: JfrThread | None
    stack: tuple[Frame, ...]  # leaf first; one tuple shared by the samples of a stack trace
    labels: Mapping[str, str]  # shared by the samples of one context: do not modify
    state: str  # the thread's state (STATE_RUNNABLE, STATE_SLEEPING...), or ""


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
        plans = {t.id: _Plan(self, t) for t in self.types.values() if t.name in MEASURES}
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
            vals = _guard(p, self.fields, self.data[p:e], specs, p)
            self.rec.settings[self.pools.text(vals[i])] = self.pools.text(vals[j])

    def fields(self, buf: bytes, specs: list[Any], base: int) -> list[Any]:
        """The values of the first fields of an event, as ``specs`` say they are written."""
        pos, vals = 0, []
        for spec in specs:
            v, pos = read_value(spec, buf, pos, self.budget, base)
            vals.append(v)
        return vals

    def interval(self, wall: bool) -> int:
        s = self.rec.settings
        v = (s.get("wall", "") if wall else "") or s.get("interval", "")
        ok = v.isascii() and v.isdigit() and 0 < len(v) < 19 and int(v) > 0
        return int(v) if ok else self.interval_ns


def _guard(at: int, fn: Any, *args: Any) -> Any:
    """fn(*args) reading the event at byte ``at`` from a copy of its bytes: reading past
    the copy's end (IndexError) is the event running past its size."""
    try:
        return fn(*args)
    except IndexError:
        raise JfrError(f"jfr: the event at byte {at} runs past its size") from None


class _Plan:
    """How one event type becomes samples: its fields read up to the last one needed (the
    event's size says where the next event starts).

    Most sample events are varints up to their last needed field: those are split with
    one regex (``VARINTS``), and the keys of thread, stack, state and labels are looked up
    by their bytes, so only times and values are ever turned into numbers."""

    def __init__(self, chunk: _Chunk, t: TypeDef) -> None:
        self.chunk, self.name = chunk, t.name
        measures = MEASURES[t.name]
        if t.name == "jdk.ExecutionSample" and chunk.rec.settings.get("event") == "wall":
            measures = (("wall", ""),)  # async-profiler < 3 in wall mode
        wanted = {"startTime", "duration", "sampledThread", "eventThread", "stackTrace",
                  "state", *_LABEL_FIELDS, *(f for _, f in measures if f)}
        at = {}
        for name in wanted:
            types, cpool = _EVENT_FIELDS[name]
            i = t.field_at(name, chunk.types, types, cpool=cpool)
            if i >= 0:
                at[name] = i
        self.specs = [chunk.pools.layouts.of_field(f, 0) for f in
                      t.fields[:max(at.values(), default=-1) + 1]]
        self.n = len(self.specs)
        self.all_varints = all(s[0] == K_VAR for s in self.specs)
        ticks = {f.name for f in t.fields if f.unit == "TICKS"}
        self.measures = tuple((m, at.get(f, -1) if f else -1, f in ticks) for m, f in measures)
        self.is_cpu = measures[0][0] == "cpu"
        self.interval = chunk.interval(wall=not self.is_cpu)
        self.i_time, self.time_ticks = at.get("startTime", -1), "startTime" in ticks
        self.i_state, self.i_stack = at.get("state", -1), at.get("stackTrace", -1)
        self.i_thread = at.get("sampledThread", at.get("eventThread", -1))
        have = [at[f] for f in _LABEL_FIELDS if f in at]
        # the label fields' keys, 0 for those the event lacks (in _LABEL_FIELDS' order)
        self.label_key: Callable[[list[Any]], tuple[Any, ...]] = (
            (lambda vals: ()) if not have else (lambda vals: (vals[have[0]],)) if len(have) == 1
            else itemgetter(*have))
        self.label_names = tuple(f for f in _LABEL_FIELDS if f in at)
        # resolved values by key (bytes on the fast path, ints otherwise: never equal)
        self.states: dict[Any, str] = {}
        self.threads: dict[Any, JfrThread | None] = {}
        self.stacks: dict[Any, tuple[Frame, ...]] = {}
        self.labels: dict[Any, Mapping[str, str]] = {}

    def emit(self, data: bytes, base: int, end: int) -> int:
        """Reads the event data[base:end] -> its samples, into the recording; returns 1 if
        it makes none. IndexError if it runs past ``end``."""
        chunk = self.chunk
        vals: list[Any]
        if self.all_varints:
            vals = VARINTS.findall(data, base, end)
            if len(vals) < self.n:
                raise IndexError(end)
        else:
            vals = chunk.fields(data[base:end], self.specs, base)
        state = ""
        if self.i_state >= 0:
            k = vals[self.i_state]
            got = self.states.get(k)
            state = got if got is not None else self.states.setdefault(
                k, chunk.pools.state(_int(k)))
            if self.is_cpu and state == "STATE_SLEEPING":
                return 1
        if self.i_time >= 0:
            time_ns = _int(vals[self.i_time])
            if self.time_ticks:
                h = chunk.header
                time_ns = h.start_ns + (time_ns - h.start_ticks) * 1_000_000_000 // h.tps
        else:
            time_ns = chunk.header.start_ns
        thread = None
        if self.i_thread >= 0:
            k = vals[self.i_thread]
            thread = self.threads.get(k)
            if thread is None:
                thread = self.threads[k] = chunk.pools.thread(_int(k), base)
        stack: tuple[Frame, ...] = ()
        if self.i_stack >= 0:
            k = vals[self.i_stack]
            got_stack = self.stacks.get(k)
            stack = got_stack if got_stack is not None else self.stacks.setdefault(
                k, chunk.pools.stack(_int(k), base))
        k = self.label_key(vals)
        labels = self.labels.get(k)
        if labels is None:
            named = dict(zip(self.label_names, map(_int, k), strict=True))
            labels = self.labels[k] = chunk.pools.labels(*(named.get(f, 0)
                                                             for f in _LABEL_FIELDS))
        samples = chunk.rec.samples
        for measure, i, ticks in self.measures:
            if i < 0:
                value = self.interval if measure in ("cpu", "wall") else 1
            elif measure == "wall":
                value = s32(_int(vals[i])) * self.interval
            else:
                value = s64(_int(vals[i]))
                if ticks:
                    value = value * 1_000_000_000 // chunk.header.tps
            samples.append(JfrSample(self.name, measure, value, time_ns, thread, stack,
                                     labels, state))
        return 0


def _int(v: Any) -> int:
    """A varint's value from its bytes (the fast path) or as already read."""
    if v.__class__ is int:
        return int(v)
    return SHORT_VARINTS[v] if len(v) < 3 else varint_value(v)

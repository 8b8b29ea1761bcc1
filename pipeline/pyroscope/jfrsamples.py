"""JFR events -> ``JfrSample``s: the event types that are samples (``MEASURES``), what each
measures, and how an event of each type is read into samples (``EventPlan``, made once per
type and chunk; ``jfr`` runs it on each event).

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any, NamedTuple

from pipeline.pyroscope.jfrmeta import INT_TYPES, K_VAR, LONG_TYPES, TypeDef, read_fields
from pipeline.pyroscope.jfrpools import Frame, JfrThread, Pools
from pipeline.pyroscope.jfrwire import SHORT_VARINTS, VARINTS, ChunkHeader, s32, s64, varint_value

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


def _interval_ns(s: Mapping[str, str], wall: bool, default_ns: int) -> int:
    """The sampling interval the recording's settings ``s`` give (the module docstring says
    which), else ``default_ns``."""
    v = (s.get("wall", "") if wall else "") or s.get("interval", "")
    ok = v.isascii() and v.isdigit() and 0 < len(v) < 19 and int(v) > 0
    return int(v) if ok else default_ns


class EventPlan:
    """How one event type becomes samples: its fields read up to the last one needed (the
    event's size says where the next event starts).

    Most sample events are varints up to their last needed field: those are split with
    one regex (``VARINTS``), and the keys of thread, stack, state and labels are looked up
    by their bytes, so only times and values are ever turned into numbers."""

    def __init__(self, t: TypeDef, pools: Pools, header: ChunkHeader,
                 settings: Mapping[str, str], interval_ns: int,
                 samples: list[JfrSample]) -> None:
        """``settings``: the recording's so far; ``interval_ns``: the sampling interval when
        they have none; ``samples``: the recording's, which ``emit`` appends to."""
        self.pools, self.header, self.samples, self.name = pools, header, samples, t.name
        measures = MEASURES[t.name]
        if t.name == "jdk.ExecutionSample" and settings.get("event") == "wall":
            measures = (("wall", ""),)  # async-profiler < 3 in wall mode
        wanted = {"startTime", "duration", "sampledThread", "eventThread", "stackTrace",
                  "state", *_LABEL_FIELDS, *(f for _, f in measures if f)}
        at = {}
        for name in wanted:
            types, cpool = _EVENT_FIELDS[name]
            i = t.field_at(name, pools.types, types, cpool=cpool)
            if i >= 0:
                at[name] = i
        self.specs = [pools.layouts.of_field(f, 0) for f in
                      t.fields[:max(at.values(), default=-1) + 1]]
        self.n = len(self.specs)
        self.all_varints = all(s[0] == K_VAR for s in self.specs)
        ticks = {f.name for f in t.fields if f.unit == "TICKS"}
        self.measures = tuple((m, at.get(f, -1) if f else -1, f in ticks) for m, f in measures)
        self.is_cpu = measures[0][0] == "cpu"
        self.interval = _interval_ns(settings, not self.is_cpu, interval_ns)
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
        """Reads the event data[base:end] -> its samples, appended to ``samples``; returns 1
        if it makes none. IndexError if it runs past ``end``."""
        pools = self.pools
        vals: list[Any]
        if self.all_varints:
            vals = VARINTS.findall(data, base, end)
            if len(vals) < self.n:
                raise IndexError(end)
        else:
            vals = read_fields(self.specs, data[base:end], pools.budget, base)
        state = ""
        if self.i_state >= 0:
            k = vals[self.i_state]
            got = self.states.get(k)
            state = got if got is not None else self.states.setdefault(
                k, pools.state(_int(k)))
            if self.is_cpu and state == "STATE_SLEEPING":
                return 1
        if self.i_time >= 0:
            time_ns = _int(vals[self.i_time])
            if self.time_ticks:
                h = self.header
                time_ns = h.start_ns + (time_ns - h.start_ticks) * 1_000_000_000 // h.tps
        else:
            time_ns = self.header.start_ns
        thread = None
        if self.i_thread >= 0:
            k = vals[self.i_thread]
            thread = self.threads.get(k)
            if thread is None:
                thread = self.threads[k] = pools.thread(_int(k), base)
        stack: tuple[Frame, ...] = ()
        if self.i_stack >= 0:
            k = vals[self.i_stack]
            got_stack = self.stacks.get(k)
            stack = got_stack if got_stack is not None else self.stacks.setdefault(
                k, pools.stack(_int(k), base))
        k = self.label_key(vals)
        labels = self.labels.get(k)
        if labels is None:
            named = dict(zip(self.label_names, map(_int, k), strict=True))
            labels = self.labels[k] = pools.labels(*(named.get(f, 0) for f in _LABEL_FIELDS))
        samples = self.samples
        for measure, i, ticks in self.measures:
            if i < 0:
                value = self.interval if measure in ("cpu", "wall") else 1
            elif measure == "wall":
                value = s32(_int(vals[i])) * self.interval
            else:
                value = s64(_int(vals[i]))
                if ticks:
                    value = value * 1_000_000_000 // self.header.tps
            samples.append(JfrSample(self.name, measure, value, time_ns, thread, stack,
                                     labels, state))
        return 0


def _int(v: Any) -> int:
    """A varint's value from its bytes (the fast path) or as already read."""
    if v.__class__ is int:
        return int(v)
    return SHORT_VARINTS[v] if len(v) < 3 else varint_value(v)

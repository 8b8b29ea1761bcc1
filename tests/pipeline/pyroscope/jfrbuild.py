"""Writes small JFR recordings for tests: a chunk header, a metadata event declaring the
types async-profiler declares (or others), checkpoint events and sample events, laid out
as the JFR file format says (compressed integers). Independent of the parser under test:
it shares no code with ``pipeline/pyroscope/jfr*.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

START_NS = 1_796_460_404_790_061_000
START_TICKS = 5_000_000
TPS = 1_000_000_000  # ticks are ns: easy to check


def var(v: int) -> bytes:
    """A JFR varint: 7 bits a byte, low first; the 9th byte whole (v: a u64 pattern)."""
    v &= (1 << 64) - 1
    out = bytearray()
    for _ in range(8):
        if v < 0x80:
            out.append(v)
            return bytes(out)
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def padded(v: int) -> bytes:
    """A 5-byte varint, as writers patch sizes in later."""
    return bytes([(v & 0x7F) | 0x80, ((v >> 7) & 0x7F) | 0x80, ((v >> 14) & 0x7F) | 0x80,
                  ((v >> 21) & 0x7F) | 0x80, (v >> 28) & 0x7F])


def utf8(s: str | None) -> bytes:
    if s is None:
        return b"\x00"
    if s == "":
        return b"\x01"
    raw = s.encode()
    return b"\x03" + var(len(raw)) + raw


def latin1(s: str) -> bytes:
    raw = s.encode("latin-1")
    return b"\x05" + var(len(raw)) + raw


def chars(units: Sequence[int]) -> bytes:
    """A UTF-16 char array (any code units, lone surrogates included)."""
    return b"\x04" + var(len(units)) + b"".join(var(u) for u in units)


def pool_ref(key: int) -> bytes:
    return b"\x02" + var(key)


class F(NamedTuple):
    """A field: name, type id, written as a pool key?, an array?, unit annotation."""

    name: str
    type: int
    cpool: bool = False
    array: bool = False
    unit: str = ""


class C(NamedTuple):
    id: int
    name: str
    fields: Sequence[F] = ()
    super_type: str = ""


# type ids as async-profiler numbers them (any distinct numbers would do)
BOOLEAN, CHAR, FLOAT, DOUBLE, BYTE, SHORT, INT, LONG = 4, 5, 6, 7, 8, 9, 10, 11
STRING, CLASS, THREAD, FRAME_TYPE, THREAD_STATE, STACK_TRACE, STACK_FRAME, METHOD = (
    20, 21, 22, 24, 25, 26, 27, 28)
PACKAGE, SYMBOL = 30, 31
TIMESTAMP, TIMESPAN = 200, 201
EXECUTION_SAMPLE, ALLOC_IN_TLAB, MONITOR_ENTER, WALL, SETTING = 101, 102, 104, 118, 110
UNKNOWN_EVENT = 150


def standard_types(span_fields: bool = True) -> list[C]:
    """async-profiler's declarations of the types the parser reads."""
    spans = [F(n, LONG) for n in ("spanId", "spanName", "contextId", "traceIdHi",
                                  "traceIdLo")] if span_fields else []
    ticks = "TICKS"
    prims = [C(i, n) for i, n in ((BOOLEAN, "boolean"), (CHAR, "char"), (FLOAT, "float"),
                                  (DOUBLE, "double"), (BYTE, "byte"), (SHORT, "short"),
                                  (INT, "int"), (LONG, "long"), (STRING, "java.lang.String"))]
    return prims + [
        C(CLASS, "java.lang.Class", [F("classLoader", 99, True), F("name", SYMBOL, True),
                                     F("package", PACKAGE, True), F("modifiers", INT)]),
        C(99, "jdk.types.ClassLoader", [F("type", CLASS, True), F("name", SYMBOL, True)]),
        C(THREAD, "java.lang.Thread", [F("osName", STRING), F("osThreadId", LONG),
                                       F("javaName", STRING), F("javaThreadId", LONG)]),
        C(FRAME_TYPE, "jdk.types.FrameType", [F("description", STRING)]),
        C(THREAD_STATE, "jdk.types.ThreadState", [F("name", STRING)]),
        C(STACK_TRACE, "jdk.types.StackTrace", [F("truncated", BOOLEAN),
                                                F("frames", STACK_FRAME, array=True)]),
        C(STACK_FRAME, "jdk.types.StackFrame", [F("method", METHOD, True),
                                                F("lineNumber", INT), F("bytecodeIndex", INT),
                                                F("type", FRAME_TYPE, True)]),
        C(METHOD, "jdk.types.Method", [F("type", CLASS, True), F("name", SYMBOL, True),
                                       F("descriptor", SYMBOL, True), F("modifiers", INT),
                                       F("hidden", BOOLEAN)]),
        C(PACKAGE, "jdk.types.Package", [F("name", SYMBOL, True)]),
        C(SYMBOL, "jdk.types.Symbol", [F("string", STRING)]),
        C(TIMESTAMP, "jdk.jfr.Timestamp", [F("value", STRING)],
          "java.lang.annotation.Annotation"),
        C(TIMESPAN, "jdk.jfr.Timespan", [F("value", STRING)], "java.lang.annotation.Annotation"),
        C(EXECUTION_SAMPLE, "jdk.ExecutionSample",
          [F("startTime", LONG, unit=ticks), F("sampledThread", THREAD, True),
           F("stackTrace", STACK_TRACE, True), F("state", THREAD_STATE, True), *spans],
          "jdk.jfr.Event"),
        C(ALLOC_IN_TLAB, "jdk.ObjectAllocationInNewTLAB",
          [F("startTime", LONG, unit=ticks), F("eventThread", THREAD, True),
           F("stackTrace", STACK_TRACE, True), F("objectClass", CLASS, True),
           F("allocationSize", LONG), F("tlabSize", LONG), *spans], "jdk.jfr.Event"),
        C(MONITOR_ENTER, "jdk.JavaMonitorEnter",
          [F("startTime", LONG, unit=ticks), F("duration", LONG, unit=ticks),
           F("eventThread", THREAD, True), F("stackTrace", STACK_TRACE, True),
           F("monitorClass", CLASS, True), F("previousOwner", THREAD, True),
           F("address", LONG), *spans], "jdk.jfr.Event"),
        C(WALL, "profiler.WallClockSample",
          [F("startTime", LONG, unit=ticks), F("sampledThread", THREAD, True),
           F("stackTrace", STACK_TRACE, True), F("state", THREAD_STATE, True),
           F("samples", INT), F("timeSpan", LONG, unit=ticks), *spans], "jdk.jfr.Event"),
        C(SETTING, "jdk.ActiveSetting", [F("startTime", LONG, unit=ticks), F("id", LONG),
                                         F("name", STRING), F("value", STRING)],
          "jdk.jfr.Event"),
        C(UNKNOWN_EVENT, "vendor.SomethingElse", [F("startTime", LONG), F("blob", STRING)],
          "jdk.jfr.Event"),
    ]


def event(type_id: int, payload: bytes, pad: bool = False) -> bytes:
    """size (counting itself), type id, payload."""
    body = var(type_id) + payload
    if pad:
        return padded(len(body) + 5) + body
    for n in range(1, 10):
        if len(var(len(body) + n)) == n:
            return var(len(body) + n) + body
    raise AssertionError("no size")


def metadata(types: Iterable[C]) -> bytes:
    strings: dict[str, int] = {}

    def s(x: str) -> bytes:
        return var(strings.setdefault(x, len(strings)))

    def element(name: str, attrs: dict[str, str], children: list[bytes]) -> bytes:
        return (s(name) + var(len(attrs)) + b"".join(s(k) + s(v) for k, v in attrs.items())
                + var(len(children)) + b"".join(children))

    classes = []
    for c in types:
        fields = []
        for f in c.fields:
            attrs = {"name": f.name, "class": str(f.type)}
            if f.cpool:
                attrs["constantPool"] = "true"
            if f.array:
                attrs["dimension"] = "1"
            notes = []
            if f.unit:
                note = TIMESPAN if f.name in ("duration", "timeSpan") else TIMESTAMP
                notes.append(element("annotation", {"class": str(note), "value": f.unit}, []))
            fields.append(element("field", attrs, notes))
        attrs = {"name": c.name, "id": str(c.id)}
        if c.super_type:
            attrs["superType"] = c.super_type
        classes.append(element("class", attrs, fields))
    tree = element("root", {}, [element("metadata", {}, classes),
                                element("region", {"locale": "en_US"}, [])])
    table = sorted(strings, key=strings.__getitem__)
    payload = (var(START_TICKS) + var(0) + var(0x7FFFFFFF) + var(len(table))
               + b"".join(utf8(x) for x in table) + tree)
    return event(0, payload, pad=True)


def checkpoint(pools: Sequence[tuple[int, Sequence[tuple[int, bytes]]]]) -> bytes:
    """Constant pools: (type id, [(key, encoded value)])."""
    payload = var(START_TICKS) + var(0) + var(0) + b"\x01" + var(len(pools))
    for tid, entries in pools:
        payload += var(tid) + var(len(entries)) + b"".join(var(k) + v for k, v in entries)
    return event(1, payload, pad=True)


def chunk(events: Iterable[bytes], start_ns: int = START_NS, start_ticks: int = START_TICKS,
          tps: int = TPS, duration_ns: int = 3 * 10**9, features: int = 1,
          version: int = 2) -> bytes:
    body = b"".join(events)
    size = 68 + len(body)
    header = (b"FLR\0" + struct.pack(">HH", version, 0)
              + struct.pack(">QQQQQQQ", size, 0, 0, start_ns, duration_ns, start_ticks, tps)
              + struct.pack(">I", features))
    return header + body


def standard_pools(stack_depth: int = 3, method_name: str = "spin") -> list[
        tuple[int, list[tuple[int, bytes]]]]:
    """Threads 1 (Java, 'worker') and 2 (OS only); stack 1 of ``stack_depth`` frames
    (``method_name`` on top, then ``run``), stack 2 one native frame; states 1 running, 2
    sleeping; frame types 1 JIT compiled, 2 Native."""
    frames = [var(1) + var(42) + var(7) + var(1)]  # method 1, line 42, bci 7, type JIT
    frames += [var(2) + var(10 + i) + var(0) + var(1) for i in range(stack_depth - 1)]
    return [
        (FRAME_TYPE, [(1, utf8("JIT compiled")), (2, utf8("Native"))]),
        (THREAD_STATE, [(1, utf8("STATE_RUNNABLE")), (2, utf8("STATE_SLEEPING"))]),
        (THREAD, [(1, utf8("worker") + var(1234) + utf8("worker") + var(25)),
                  (2, utf8("GC Thread#0") + var(1235) + utf8(None) + var(0))]),
        (STACK_TRACE, [(1, b"\x00" + var(len(frames)) + b"".join(frames)),
                       (2, b"\x00" + var(1) + var(3) + var(0) + var(0) + var(2))]),
        (METHOD, [(1, var(1) + var(1) + var(3) + var(8) + b"\x00"),
                  (2, var(1) + var(2) + var(3) + var(8) + b"\x00"),
                  (3, var(2) + var(4) + var(3) + var(256) + b"\x00")]),
        (CLASS, [(1, var(0) + var(5) + var(0) + var(1)), (2, var(0) + var(6) + var(0) + var(0))]),
        (SYMBOL, [(1, utf8(method_name)), (2, utf8("run")), (3, utf8("()V")),
                  (4, utf8("os::malloc")), (5, utf8("app/Main")), (6, utf8("libjvm.so"))]),
        (STRING, [(1, utf8("pooled string"))]),
    ]


def sample(tid: int = EXECUTION_SAMPLE, ticks: int = START_TICKS + 1000, thread: int = 1,
           stack: int = 1, state: int = 1, spans: Sequence[int] = (0, 0, 0, 0, 0),
           extra: Sequence[int] = ()) -> bytes:
    """An ExecutionSample (or WallClockSample with ``extra`` = samples, timeSpan)."""
    return event(tid, var(ticks) + var(thread) + var(stack) + var(state)
                 + b"".join(var(v) for v in extra) + b"".join(var(v) for v in spans))


def setting(name: str, value: str, event_id: int = EXECUTION_SAMPLE) -> bytes:
    return event(SETTING, var(START_TICKS) + var(event_id) + utf8(name) + utf8(value))


def recording(events: Sequence[bytes] = (), types: Sequence[C] | None = None,
              pools: Any = None, **header: Any) -> bytes:
    """One chunk: metadata, the given events, then one checkpoint (as async-profiler
    writes them)."""
    return chunk([metadata(types if types is not None else standard_types()), *events,
                  checkpoint(pools if pools is not None else standard_pools())], **header)

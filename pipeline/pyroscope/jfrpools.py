"""What one chunk's events refer to by key, each resolved once: the constant pools of its
checkpoint events, and the agent's labels snapshot.

A checkpoint event (type 1) holds constant pools, per type a count then entries ``key,
value``, each value written as the type's layout says (``jfrmeta.Layouts``). An event holds
keys into them (thread, stack trace, thread state); a stack trace's frames hold keys of
methods, which hold keys of classes and symbols, and of frame types. The agent's
async-profiler adds context and span-name ids, keys into the labels snapshot
(``jfrlabels``). ``Pools`` turns each key into what a sample holds: a ``JfrThread``, a stack
of ``Frame``s (leaf first), a thread state, labels; samples of one key share the value.

An entry's field is used only if declared as expected (``TypeDef.field_at``); one the type
lacks or declares otherwise reads as absent. A thread or stack trace key in no pool is a
``JfrError`` (but stack trace 0 is no stack); a missing method, class, symbol or state
reads as an empty name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from pipeline.pyroscope.jfrlabels import LabelsSnapshot
from pipeline.pyroscope.jfrmeta import (
    INT_TYPES,
    LONG_TYPES,
    STRING_TYPES,
    Layouts,
    TypeDef,
    read_value,
)
from pipeline.pyroscope.jfrwire import Budget, JfrError, PoolString, s32, s64, uvar

NATIVE_FRAMES = ("Native", "C++", "Kernel")


class Frame(NamedTuple):
    function: str
    file: str
    line: int


class JfrThread(NamedTuple):
    os_id: int  # the OS thread id
    java_id: int  # the java.lang.Thread id; 0 for a thread that is not a Java thread
    name: str  # the Java name, else the OS name


class Pools:
    """One chunk's constant pools (read from its checkpoint events) and labels snapshot;
    each key an event holds resolved once."""

    def __init__(self, types: dict[int, TypeDef], budget: Budget,
                 snapshot: LabelsSnapshot | None) -> None:
        self.types, self.budget, self.snapshot = types, budget, snapshot
        self.layouts = Layouts(types)
        self.by_name = {t.name: t for t in types.values()}
        self.entries: dict[int, dict[int, Any]] = {}  # type id -> key -> value
        # what events share, made once: stacks, threads, frames, labels
        self._stacks: dict[int, tuple[Frame, ...]] = {}
        self._threads: dict[int, JfrThread | None] = {0: None}
        self._frames: dict[tuple[int, int, int], Frame] = {}
        self._labels: dict[tuple[int, ...], Mapping[str, str]] = {}

    def read_checkpoint(self, buf: bytes, base: int) -> None:
        """The pools of a checkpoint event whose payload (after size and type) is ``buf``,
        at byte ``base`` of the recording, added to the chunk's."""
        pos = 0
        for _ in range(3):  # start time, duration, delta to the previous checkpoint
            _, pos = uvar(buf, pos)
        pos += 1  # the checkpoint's type (JDK 14+) or 'flush' flag (JDK 11): one byte
        n, pos = uvar(buf, pos)
        if n > len(buf) - pos:
            raise JfrError(f"jfr: {n} constant pools at byte {base + pos}, "
                           f"{len(buf) - pos} bytes left")
        for _ in range(n):
            tid, p = uvar(buf, pos)
            count, p = uvar(buf, p)
            spec = self.layouts.of_type(tid, base + pos)
            if count > (len(buf) - p) // (1 + spec[2]):
                raise JfrError(f"jfr: a pool of {count} entries at byte {base + pos}, "
                               f"{len(buf) - p} bytes left")
            self.budget.take_entries(count, base + pos)
            pool = self.entries.setdefault(tid, {})
            for _ in range(count):
                key, p = uvar(buf, p)
                pool[key], p = read_value(spec, buf, p, self.budget, base)
            pos = p

    def text(self, v: Any) -> str:
        """A string value as read: a pool reference looked up, null -> ""."""
        if isinstance(v, PoolString):
            v = self.pool("java.lang.String").get(int(v))
        return v if isinstance(v, str) else ""

    def pool(self, type_name: str) -> dict[int, Any]:
        t = self.by_name.get(type_name)
        return self.entries.get(t.id, {}) if t is not None else {}

    def _entry(self, type_name: str, key: Any, fields: tuple[tuple[str, tuple[str, ...], bool],
                                                             ...]) -> list[Any]:
        """The values of ``fields`` (name, types, is a pool key) of a pool entry; None for a
        field the type lacks or declares otherwise, all None for an absent entry."""
        t = self.by_name.get(type_name)
        raw = self.pool(type_name).get(key)
        if t is None or not isinstance(raw, tuple):
            return [None] * len(fields)
        out = []
        for name, types, cpool in fields:
            i = t.field_at(name, self.types, types, cpool=cpool)
            out.append(raw[i] if i >= 0 else None)
        return out

    def thread(self, key: int, at: int) -> JfrThread | None:
        if key in self._threads:
            return self._threads[key]
        if key not in self.pool("java.lang.Thread"):
            raise JfrError(f"jfr: the event at byte {at} refers to thread {key}, in no pool")
        os_name, os_id, java_name, java_id = self._entry("java.lang.Thread", key, (
            ("osName", STRING_TYPES, False), ("osThreadId", LONG_TYPES, False),
            ("javaName", STRING_TYPES, False), ("javaThreadId", LONG_TYPES, False)))
        th = self._threads[key] = JfrThread(s64(os_id or 0), s64(java_id or 0),
                                            self.text(java_name) or self.text(os_name))
        return th

    def stack(self, key: int, at: int) -> tuple[Frame, ...]:
        got = self._stacks.get(key)
        if got is not None:
            return got
        if key not in self.pool("jdk.types.StackTrace"):
            if key == 0:
                return ()
            raise JfrError(f"jfr: the event at byte {at} refers to stack trace {key}, "
                           f"in no pool")
        t = self.by_name["jdk.types.StackTrace"]
        ft = self.by_name.get("jdk.types.StackFrame")
        i = t.field_at("frames", self.types, ("jdk.types.StackFrame",), array=True)
        raw = self.pool("jdk.types.StackTrace")[key]
        frames = raw[i] if i >= 0 and ft is not None and isinstance(raw, tuple) else []
        im = ft.field_at("method", self.types, ("jdk.types.Method",), cpool=True) if ft else -1
        il = ft.field_at("lineNumber", self.types, INT_TYPES) if ft else -1
        it = ft.field_at("type", self.types, ("jdk.types.FrameType",), cpool=True) if ft else -1
        out = []
        for f in frames:
            k = (f[im] if im >= 0 else -1, f[il] if il >= 0 else 0, f[it] if it >= 0 else -1)
            frame = self._frames.get(k)
            if frame is None:
                frame = self._frames[k] = self._frame(*k)
            out.append(frame)
        stack = self._stacks[key] = tuple(out)
        return stack

    def _frame(self, method: int, line: int, frame_type: int) -> Frame:
        cls, name = self._entry("jdk.types.Method", method, (
            ("type", ("java.lang.Class",), True), ("name", ("jdk.types.Symbol",), True)))
        cname, = self._entry("java.lang.Class", cls, (("name", ("jdk.types.Symbol",), True),))
        kind, = self._entry("jdk.types.FrameType", frame_type,
                            (("description", STRING_TYPES, False),))
        cname, mname = self._symbol(cname), self._symbol(name)
        if self.text(kind) in NATIVE_FRAMES:
            return Frame(mname, cname, 0)
        cname = cname.replace("/", ".")
        return Frame(f"{cname}.{mname}" if cname else mname, "", s32(line))

    def _symbol(self, key: Any) -> str:
        s, = self._entry("jdk.types.Symbol", key, (("string", STRING_TYPES, False),))
        return self.text(s)

    def state(self, key: int) -> str:
        s, = self._entry("jdk.types.ThreadState", key, (("name", STRING_TYPES, False),))
        return self.text(s)

    def labels(self, ctx: int, span: int, name: int, hi: int, lo: int) -> Mapping[str, str]:
        k = (ctx, span, name, hi, lo)
        got = self._labels.get(k)
        if got is not None:
            return got
        snap = self.snapshot
        out: dict[str, str] = dict(snap.contexts.get(s64(ctx), {})) if snap and ctx else {}
        if span:
            out["span_id"] = f"{span:016x}"
        if name and snap is not None and snap.strings.get(s64(name)):
            out["span_name"] = snap.strings[s64(name)]
        if hi or lo:
            out["trace_id"] = f"{hi:016x}{lo:016x}"
        self._labels[k] = out
        return out

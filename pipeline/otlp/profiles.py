"""ExportProfilesServiceRequest (v1development) -> ``ProfileBatch``.

Every dictionary index is checked; a profile that references something out of range, or a
link whose ids have the wrong length, is rejected whole (the unit ``partial_success``
counts), the other profiles of the request are accepted.

Values are normalised to nanoseconds of one *measure* (see ``classify``), so that CPU from a
``cpu/nanoseconds`` profile, a ``samples/count`` profile with a CPU period (eBPF agents) and
a timestamps-only sample all add up in the same unit.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any, NamedTuple

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)

from pipeline.otlp.common import Rejections, attributes_dict, is_zero, service_name
from pipeline.records import Measure, ProfileBatch, Sample, Stack

TIME_UNITS = {
    "nanoseconds": 1, "ns": 1, "nanosecond": 1,
    "microseconds": 1_000, "us": 1_000, "microsecond": 1_000,
    "milliseconds": 1_000_000, "ms": 1_000_000, "millisecond": 1_000_000,
    "seconds": 1_000_000_000, "s": 1_000_000_000, "second": 1_000_000_000,
}
MEASURES: dict[str, Measure] = {
    "cpu": "cpu", "wall": "wall", "off_cpu": "off_cpu", "off-cpu": "off_cpu", "offcpu": "off_cpu",
    "itimer": "cpu",  # async-profiler's setitimer-driven CPU sampling (Java agents)
}


class Kind(NamedTuple):
    """How to turn one sample's raw numbers into (measure, nanoseconds or raw, ticks)."""

    measure: Measure
    per_value: int  # multiply a raw value by this to get ns (1 for non-time measures)
    value_is_count: bool  # raw values count profiler ticks (samples/count)
    period_ns: int  # one tick in ns, 0 if unknown


def classify(sample_type: str, unit: str, period_type: str, period_unit: str,
             period: int) -> Kind:
    """Decide what a profile's values mean.

    * ``cpu/nanoseconds`` (any time unit) -> CPU ns as is;
    * ``samples/count`` with a ``cpu/<time>`` period -> value x period;
    * ``wall``/``off_cpu`` time types -> their own measure, never added to CPU;
    * anything else (alloc_space, ...) -> ``other``, kept raw.
    """
    period_mult = TIME_UNITS.get(period_unit.lower())
    period_ns = period * period_mult if period_mult and period > 0 else 0
    mult = TIME_UNITS.get(unit.lower())
    if mult is not None:
        return Kind(MEASURES.get(sample_type.lower(), "other"), mult, False, period_ns)
    if sample_type.lower() == "samples" and unit.lower() == "count":
        measure = MEASURES.get(period_type.lower())
        if measure is not None and period_ns:
            return Kind(measure, period_ns, True, period_ns)
        return Kind("other", 1, True, period_ns)
    return Kind("other", 1, False, period_ns)


class Decoded(NamedTuple):
    batch: ProfileBatch
    rejected: int
    message: str


class _Invalid(Exception):
    pass


# attribute keys that say where a sample was taken (semantic conventions), and the labels
# Go programs set with pprof.Do, which eBPF profilers pass on as process.context.label.*
WHERE_KEYS = frozenset({"thread.id", "thread.name", "span_name", "process.context.label.span_id",
                        "process.context.label.trace_id", "process.context.label.span_name"})


class _Where(NamedTuple):
    thread_id: int
    thread_name: str
    span_name: str
    label_trace_id: bytes  # from process.context.label.*: a link in all but name
    label_span_id: bytes



def _label_id(v: Any, size: int) -> bytes:
    """A hex id label (Go's span_id labels) as bytes, b"" when absent, malformed or zero."""
    if not isinstance(v, str) or len(v) != 2 * size:
        return b""
    try:
        out = bytes.fromhex(v)
    except ValueError:
        return b""
    return out if any(out) else b""


def stack_hash(functions: list[str], files: list[str], lines: list[int]) -> int:
    """A 63-bit id of a stack's frames, identical for identical stacks from any request."""
    h = hashlib.blake2b(digest_size=8)
    for fn, fl, ln in zip(functions, files, lines, strict=True):
        h.update(fn.encode())
        h.update(b"\x00")
        h.update(fl.encode())
        h.update(struct.pack("<q", ln))
    return int.from_bytes(h.digest(), "little") >> 1


class _Dictionary:
    """Resolves and checks indices into one request's ``ProfilesDictionary``, with caches."""

    def __init__(self, d: Any) -> None:
        self.strings = list(d.string_table)
        self.functions = d.function_table
        self.locations = d.location_table
        self.stacks_tbl = d.stack_table
        self.links = d.link_table
        self.attrs = d.attribute_table
        self.n_attrs = len(d.attribute_table)
        self._where_by_indices: dict[tuple[int, ...], _Where] = {}
        self.stacks: dict[int, Stack] = {}
        self._stack_by_index: dict[int, int] = {}
        self._link_by_index: dict[int, tuple[bytes, bytes]] = {}

    def string(self, i: int, what: str) -> str:
        if not 0 <= i < len(self.strings):
            raise _Invalid(f"{what} {i} out of range (string_table has {len(self.strings)})")
        return str(self.strings[i])

    def where(self, indices: Any) -> _Where:
        """Thread, span name and label-borne ids from a sample's (or profile's) attributes."""
        key = tuple(indices)
        got = self._where_by_indices.get(key)
        if got is not None:
            return got
        found: dict[str, Any] = {}
        for ai in key:
            if not 0 <= ai < self.n_attrs:
                raise _Invalid(f"attribute_indices {ai} out of range "
                               f"(attribute_table has {self.n_attrs})")
            kv = self.attrs[ai]
            name = self.string(kv.key_strindex, f"attribute_table[{ai}].key_strindex")
            if name in WHERE_KEYS:
                v = kv.value
                found[name] = v.int_value if v.HasField("int_value") else v.string_value
        tid = found.get("thread.id", 0)
        try:
            thread_id = int(tid)
        except ValueError:
            thread_id = 0
        span = _label_id(found.get("process.context.label.span_id", ""), 8)
        trace = _label_id(found.get("process.context.label.trace_id", ""), 16) if span else b""
        got = self._where_by_indices[key] = _Where(
            max(0, thread_id), str(found.get("thread.name", "")),
            str(found.get("span_name", "") or found.get("process.context.label.span_name", "")),
            trace, span)
        return got

    def stack(self, i: int) -> int:
        sid = self._stack_by_index.get(i)
        if sid is not None:
            return sid
        if not 0 <= i < len(self.stacks_tbl):
            raise _Invalid(f"stack_index {i} out of range (stack_table has "
                           f"{len(self.stacks_tbl)})")
        functions: list[str] = []
        files: list[str] = []
        lines: list[int] = []
        n_loc, n_fn = len(self.locations), len(self.functions)
        for li in self.stacks_tbl[i].location_indices:
            if not 0 <= li < n_loc:
                raise _Invalid(f"stack_table[{i}] location index {li} out of range "
                               f"(location_table has {n_loc})")
            loc = self.locations[li]
            if not loc.lines:
                functions.append(f"0x{loc.address:x}")
                files.append("")
                lines.append(0)
                continue
            # pprof/OTLP: several lines = inlined calls, innermost first, the caller last
            for line in loc.lines:
                fi = line.function_index
                if not 0 <= fi < n_fn:
                    raise _Invalid(f"location_table[{li}] function_index {fi} out of range "
                                   f"(function_table has {n_fn})")
                fn = self.functions[fi]
                functions.append(self.string(fn.name_strindex,
                                             f"function_table[{fi}].name_strindex"))
                files.append(self.string(fn.filename_strindex,
                                         f"function_table[{fi}].filename_strindex"))
                lines.append(int(line.line))
        sid = stack_hash(functions, files, lines)
        self.stacks.setdefault(sid, Stack(sid, functions, files, lines))
        self._stack_by_index[i] = sid
        return sid

    def link(self, i: int) -> tuple[bytes, bytes]:
        """(trace_id, span_id) or (b"", b"") for no link; index 0 is the no-link entry."""
        got = self._link_by_index.get(i)
        if got is not None:
            return got
        if not 0 <= i < len(self.links):
            if i == 0:
                return (b"", b"")  # an empty link_table: nothing links
            raise _Invalid(f"link_index {i} out of range (link_table has {len(self.links)})")
        lk = self.links[i]
        tid, sid = bytes(lk.trace_id), bytes(lk.span_id)
        if i == 0 or (is_zero(tid) and is_zero(sid)):
            got = (b"", b"")
        elif len(tid) != 16 or len(sid) != 8:
            raise _Invalid(f"link_table[{i}] needs a 16-byte trace_id and an 8-byte span_id, "
                           f"got {len(tid)} and {len(sid)} bytes")
        elif is_zero(sid):
            raise _Invalid(f"link_table[{i}] span_id must not be all zero when trace_id is set")
        elif is_zero(tid):
            # a span-only link (SDKs that label samples with span_id alone): the trace is
            # resolved by span id in ClickHouse (span_index), whichever worker has the span
            got = (b"", sid)
        else:
            got = (tid, sid)
        self._link_by_index[i] = got
        return got


def decode_profiles(req: ExportProfilesServiceRequest) -> Decoded:
    d = _Dictionary(req.dictionary)
    samples: list[Sample] = []
    refused = Rejections()
    used_stacks: set[int] = set()
    for ri, rp in enumerate(req.resource_profiles):
        resource = attributes_dict(rp.resource.attributes)
        service = service_name(resource)
        try:
            pid = int(resource.get("process.pid", "0"))
        except ValueError:
            pid = 0
        host = resource.get("host.name", "")
        for si, sp in enumerate(rp.scope_profiles):
            for pi, prof in enumerate(sp.profiles):
                try:
                    out = _decode_profile(d, prof, service, pid, host)
                except _Invalid as err:
                    refused.add((ri, si, pi), f"resource_profiles[{ri}].scope_profiles[{si}]."
                                f"profiles[{pi}]", err)
                    continue
                samples.extend(out)
                used_stacks.update(s.stack_id for s in out)
    stacks = {sid: d.stacks[sid] for sid in used_stacks}
    return Decoded(ProfileBatch(samples, stacks, sources=[(req, refused.paths)]),
                   refused.count, refused.message)


def _ticks(value_ns: int, kind: Kind) -> int:
    """How many profiler ticks a time value stands for (at least one)."""
    if kind.period_ns and kind.measure != "other":
        return max(1, round(value_ns / kind.period_ns))
    return 1


def _decode_profile(d: _Dictionary, prof: Any, service: str, pid: int = 0,
                    host: str = "") -> list[Sample]:
    st, pt = prof.sample_type, prof.period_type
    type_s = d.string(st.type_strindex, "sample_type.type_strindex")
    unit_s = d.string(st.unit_strindex, "sample_type.unit_strindex")
    ptype_s = d.string(pt.type_strindex, "period_type.type_strindex")
    punit_s = d.string(pt.unit_strindex, "period_type.unit_strindex")
    kind = classify(type_s, unit_s, ptype_s, punit_s, int(prof.period))
    whole = d.where(prof.attribute_indices)  # a per-thread profile says so here
    # a profile without a time is taken as "now": stored samples need a real time (TTL)
    t0 = int(prof.time_unix_nano) or time.time_ns()
    out: list[Sample] = []
    for k, s in enumerate(prof.samples):
        try:
            stack_id = d.stack(s.stack_index)
            trace_id, span_id = d.link(s.link_index)
            where = d.where(s.attribute_indices) if s.attribute_indices else whole
            if not span_id and where.label_span_id:
                trace_id, span_id = where.label_trace_id, where.label_span_id
        except _Invalid as err:
            raise _Invalid(f"samples[{k}]: {err}") from None
        values, stamps = s.values, s.timestamps_unix_nano
        if values and stamps and len(stamps) != len(values):
            raise _Invalid(f"samples[{k}]: {len(values)} values but {len(stamps)} timestamps")
        if values and min(values) < 0:
            raise _Invalid(f"samples[{k}]: negative value {min(values)}")
        if not values and not stamps:
            continue  # an empty sample carries nothing
        thread_id = where.thread_id or whole.thread_id
        thread_name = where.thread_name or whole.thread_name
        if stamps:
            # one record per instant: that is what lets the correlator place each one in
            # the span (and thread) that was running then; no values: one period each
            for n, ts in enumerate(stamps):
                raw = values[n] if values else 1
                if raw == 0:
                    continue
                if values and not kind.value_is_count:
                    value, ticks = raw * kind.per_value, 1  # one instant, one tick
                else:
                    value = raw * (kind.period_ns if kind.measure != "other" else 1)
                    ticks = raw
                out.append(Sample(trace_id, span_id, service, int(ts), stack_id, kind.measure,
                                  value, ticks, type_s, unit_s, thread_id, thread_name,
                                  where.span_name, pid, host, True))
            continue
        raw = sum(values)
        if raw == 0:
            continue  # a zero sample carries nothing
        value = raw * kind.per_value
        ticks = raw if kind.value_is_count else _ticks(value, kind)
        out.append(Sample(trace_id, span_id, service, t0, stack_id, kind.measure, value, ticks,
                          type_s, unit_s, thread_id, thread_name, where.span_name, pid, host))
    return out

"""ExportProfilesServiceRequest (v1development) -> ``ProfileBatch``.

Every dictionary index is checked (``dictionary.py``); a profile that references something
out of range, a link whose ids have the wrong length, or any value that could not be stored
(times outside [1970, 2106), values over 2^44 ns, counts over UInt32, pids over UInt32:
``bounds.py``) is rejected whole (the unit ``partial_success`` counts), the other profiles
of the request are accepted. So is a profile that would take the request over its budget:
``MAX_RECORDS`` sample records (timestamps make one each), the stack budget (``stacks.py``).

Values are normalised to nanoseconds of one *measure* (see ``classify``), so that CPU from a
``cpu/nanoseconds`` profile, a ``samples/count`` profile with a CPU period (eBPF agents) and
a timestamps-only sample all add up in the same unit.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)

from pipeline import native
from pipeline.otlp.bounds import (
    FRAME_FANOUT,
    FRAME_SLACK,
    MAX_COUNT,
    MAX_RECORDS,
    MAX_REQUEST_VALUE,
    MAX_SAMPLE_VALUE,
    TIME_MAX_NS,
    TIME_RANGE,
    UINT32_MAX,
    time_problem,
)
from pipeline.otlp.common import Rejections, service_name
from pipeline.otlp.dictionary import Dictionary, Invalid, Where
from pipeline.otlp.stacks import StackRefused, StackTable, stack_hash
from pipeline.records import Measure, ProfileBatch, Sample

__all__ = ["Decoded", "Kind", "classify", "decode_profiles", "stack_hash"]

TIME_UNITS = {
    "nanoseconds": 1, "ns": 1, "nanosecond": 1,
    "microseconds": 1_000, "us": 1_000, "microsecond": 1_000,
    "milliseconds": 1_000_000, "ms": 1_000_000, "millisecond": 1_000_000,
    "seconds": 1_000_000_000, "s": 1_000_000_000, "second": 1_000_000_000,
}
MEASURES: dict[str, Measure] = {
    "cpu": "cpu", "wall": "wall", "off_cpu": "off_cpu", "off-cpu": "off_cpu", "offcpu": "off_cpu",
    "itimer": "cpu",  # async-profiler's setitimer-driven CPU sampling (Java agents)
    # time waiting for a lock: Go's mutex and block profiles (delay/nanoseconds), JFR
    # monitor and park events as Pyroscope and async-profiler name them
    "delay": "lock", "lock": "lock", "lock_time": "lock", "lock_duration": "lock",
    "lock_ns": "lock", "contention": "lock",
}
# bytes allocated (never the live heap, inuse_*: a snapshot, not what a span did)
ALLOC_TYPES = frozenset({"alloc_space", "alloc_bytes", "alloc_in_new_tlab_bytes",
                         "alloc_outside_tlab_bytes", "alloc", "allocations"})
BYTE_UNITS = frozenset({"bytes", "byte"})


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
    * lock wait time types (``delay``, ``lock_time``...) -> ``lock`` ns;
    * bytes allocated (``alloc_space/bytes``...) -> ``alloc`` bytes;
    * anything else (inuse_space, contentions/count, ...) -> ``other``, kept raw.
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
    if unit.lower() in BYTE_UNITS and sample_type.lower() in ALLOC_TYPES:
        return Kind("alloc", 1, False, period_ns)
    return Kind("other", 1, False, period_ns)


class Decoded(NamedTuple):
    batch: ProfileBatch
    rejected: int
    message: str


def decode_profiles(req: ExportProfilesServiceRequest, records: bool = True,
                    max_records: int = MAX_RECORDS, stacks: StackTable | None = None,
                    wire: bytes | None = None) -> Decoded:
    """Accepted samples, and the profiles refused with why: a profile is refused whole when
    anything it references is malformed or any value it carries could not be stored
    (``pipeline/otlp/bounds.py``), or when it would take the request over ``max_records``
    sample records or over the stack budget (``stacks``). Without ``records`` the same
    checks, but the batch holds only the request and how many sample records it makes (a
    gateway passes the request on, less what was refused); with its bytes as received
    (``wire``), the usual samples are read from them by the native library."""
    d = Dictionary(req.dictionary, stacks, build=records)
    columns = native.profile_columns(wire) if wire is not None and not records else None
    if columns is not None and wire is not None:
        d.verified = _verified(d, native.dictionary_summary(wire, FRAME_FANOUT))
    ordinal = -1
    samples: list[Sample] = []
    refused = Rejections()
    used_stacks: set[int] = set()
    count = 0
    try:
        d.check_zero_entries()
        broken = ""
    except Invalid as err:
        broken = f"dictionary: {err}"
    for ri, rp in enumerate(req.resource_profiles):
        try:
            resource = d.attributes(rp.resource.attributes, "resource.attributes")
            pid, pid_problem = _pid(resource)
        except Invalid as err:
            resource, pid, pid_problem = {}, 0, str(err)
        service = service_name(resource)
        host = resource.get("host.name", "")
        for si, sp in enumerate(rp.scope_profiles):
            for pi, prof in enumerate(sp.profiles):
                ordinal += 1
                try:
                    if broken or pid_problem:
                        raise Invalid(broken or pid_problem)
                    out, n = _decode_profile(
                        d, prof, service, pid, host, max_records, records,
                        columns[ordinal] if columns and ordinal < len(columns) else None)
                except (Invalid, StackRefused) as err:
                    refused.add((ri, si, pi), f"resource_profiles[{ri}].scope_profiles[{si}]."
                                f"profiles[{pi}]", err)
                    continue
                count += n
                if records:
                    samples.extend(out)
                    used_stacks.update(s.stack_id for s in out)
    stacks_out = {sid: d.stacks[sid] for sid in used_stacks}
    return Decoded(ProfileBatch(samples, stacks_out, sources=[(req, refused.paths)],
                                items=-1 if records else count),
                   refused.count, refused.message)


def _pid(resource: dict[str, str]) -> tuple[int, str]:
    """process.pid as UInt32: not a number is "not known" (0); a number out of range is a
    problem that refuses the resource's profiles."""
    try:
        pid = int(resource.get("process.pid", "0"))
    except ValueError:
        return 0, ""
    if 0 <= pid <= UINT32_MAX:
        return pid, ""
    return 0, f"resource attribute process.pid {pid} is outside [0, {UINT32_MAX}]"


def _check_instants(values: Any, stamps: Any, kind: Kind) -> None:
    """One record per timestamp: the largest value and the last instant must fit (builtins
    over the repeated fields, no per-value Python)."""
    if max(stamps) >= TIME_MAX_NS:
        raise Invalid(f"timestamps_unix_nano {max(stamps)} is outside the storable time range "
                      f"{TIME_RANGE}")
    raw = max(values) if values else 1
    per = kind.per_value if values and not kind.value_is_count else (
        kind.period_ns if kind.measure != "other" else 1)
    if raw * per > MAX_SAMPLE_VALUE:
        raise Invalid(f"value {raw} x {per} ns is over the per-sample limit {MAX_SAMPLE_VALUE}")
    if not (values and not kind.value_is_count) and raw > MAX_COUNT:
        raise Invalid(f"value {raw} ticks is over the count column (UInt32)")


def _decode_profile(d: Dictionary, prof: Any, service: str, pid: int = 0,
                    host: str = "", max_records: int = MAX_RECORDS, records: bool = True,
                    columns: native.Columns | None = None) -> tuple[list[Sample], int]:
    """The profile's sample records and how many; without ``records`` the checks alone
    (records come back only from timestamped samples) and the count."""
    st, pt = prof.sample_type, prof.period_type
    type_s = d.string(st.type_strindex, "sample_type.type_strindex")
    unit_s = d.string(st.unit_strindex, "sample_type.unit_strindex")
    ptype_s = d.string(pt.type_strindex, "period_type.type_strindex")
    punit_s = d.string(pt.unit_strindex, "period_type.unit_strindex")
    kind = classify(type_s, unit_s, ptype_s, punit_s, int(prof.period))
    whole = d.where(prof.attribute_indices)  # a per-thread profile says so here
    # a profile without a time is taken as "now": stored samples need a real time (TTL)
    t0 = int(prof.time_unix_nano) or time.time_ns()
    problem = time_problem(t0, "time_unix_nano")
    if problem:
        raise Invalid(problem)
    room = max_records - d.records
    if len(prof.samples) > room:
        raise Invalid(f"{len(prof.samples)} samples take the request over {max_records} "
                      "sample records")
    if not records:
        usual = _usual_counts(d, prof, kind, columns)
        if usual is not None:
            return [], _account(d, [], usual[0], usual[1], max_records, room)
    out: list[Sample] = []
    plain, plain_total = 0, 0  # without records: the untimed samples' count and values
    # the per-sample loop is the decoder's cost: cached lookups inline, the profile's
    # constants hoisted, the tick count of an untimed value without a call
    stack_by, link_by = d.stack_cache, d.link_cache
    measure, per_value, is_count = kind.measure, kind.per_value, kind.value_is_count
    period = kind.period_ns if measure != "other" else 0
    for k, s in enumerate(prof.samples):
        try:
            stack_id = stack_by.get(s.stack_index)
            if stack_id is None:
                stack_id = d.stack(s.stack_index)
            link = link_by.get(s.link_index)
            trace_id, span_id = link if link is not None else d.link(s.link_index)
            where = d.where(s.attribute_indices) if s.attribute_indices else whole
            if not span_id and where.label_span_id:
                trace_id, span_id = where.label_trace_id, where.label_span_id
            values, stamps = s.values, s.timestamps_unix_nano
            if stamps:
                if values and len(stamps) != len(values):
                    raise Invalid(f"{len(values)} values but {len(stamps)} timestamps")
                if values and min(values) < 0:
                    raise Invalid(f"negative value {min(values)}")
                if len(out) + len(stamps) > room:
                    raise Invalid(f"{len(stamps)} timestamps take the request over "
                                  f"{max_records} sample records")
                _check_instants(values, stamps, kind)
            elif len(values) == 1:  # the usual sample: read without iterating
                raw = values[0]
                if raw < 0:
                    raise Invalid(f"negative value {raw}")
            elif not values:
                continue  # an empty sample carries nothing
            elif min(values) < 0:
                raise Invalid(f"negative value {min(values)}")
            else:
                raw = sum(values)
        except (Invalid, StackRefused) as err:
            raise Invalid(f"samples[{k}]: {err}") from None
        thread_id = where.thread_id or whole.thread_id
        thread_name = where.thread_name or whole.thread_name
        if stamps:
            _instants(out, values, stamps, kind, (trace_id, span_id, service, stack_id),
                      (type_s, unit_s, thread_id, thread_name, where.span_name, pid, host))
            continue
        if raw == 0:
            continue  # a zero sample carries nothing
        value = raw * per_value
        ticks = raw if is_count else (max(1, round(value / period)) if period else 1)
        if value > MAX_SAMPLE_VALUE or ticks > MAX_COUNT:
            raise Invalid(f"samples[{k}]: value {raw} ({value} after units, {ticks} ticks) is "
                          f"over the per-sample limit {MAX_SAMPLE_VALUE} or UInt32 ticks")
        if records:
            out.append(Sample(trace_id, span_id, service, t0, stack_id, measure, value, ticks,
                              type_s, unit_s, thread_id, thread_name, where.span_name, pid,
                              host))
        else:
            plain += 1
            plain_total += value
    return out, _account(d, out, plain, plain_total, max_records, room)


def _account(d: Dictionary, out: list[Sample], plain: int, plain_total: int,
              max_records: int, room: int) -> int:
    """The request's record and value budgets, with this profile's records (``out``, and
    ``plain`` more of ``plain_total`` ns not built): its record count."""
    n = len(out) + plain
    if n > room:
        raise Invalid(f"{n} sample records take the request over {max_records}")
    total = d.value_total + sum(s.value for s in out) + plain_total
    if total > MAX_REQUEST_VALUE:
        raise Invalid(f"values add up to {total}, over the request limit {MAX_REQUEST_VALUE}")
    d.records += n
    d.value_total = total
    return n


def _usual_counts(d: Dictionary, prof: Any, kind: Kind,
                  columns: native.Columns | None = None) -> tuple[int, int] | None:
    """A gateway's checks of the usual profile's samples (one value each, no timestamps,
    no attributes) column by column, with builtins over each column instead of Python per
    sample: (records, their total value), or ``None`` when a sample is unusual or anything
    is wrong, for the per-sample loop to decide and word (it then meets the same first
    problem: links and values are checked first, and the stacks, whose budget is the only
    state a check leaves, last and in the order the loop would take them). ``columns``:
    the samples' columns read from the request's bytes by the native library (only usual
    samples make them), instead of reading every sample through upb."""
    native_read = columns is not None and len(columns[0]) == len(prof.samples)
    got = (columns[0].tolist(), columns[1].tolist(), columns[2].tolist()) \
        if columns is not None and native_read else _upb_columns(prof)
    if got is None or not got[2]:
        return None
    stacks, links, raws = got
    low, high = min(raws), max(raws)
    if low < 0:
        return None
    top = high * kind.per_value
    ticks = high if kind.value_is_count else (
        max(1, round(top / kind.period_ns)) if kind.measure != "other" and kind.period_ns
        else 1)
    if top > MAX_SAMPLE_VALUE or ticks > MAX_COUNT:  # both grow with the raw value
        return None
    if d.verified and native_read:  # every entry checked natively, no use over the budget
        n_links, n_stacks = len(d.links), len(d.stacks_tbl)  # (native indices are >= 0)
        if max(stacks) < n_stacks and (
                max(links) < n_links or (n_links == 0 and max(links) == 0)):
            return len(raws) - raws.count(0), sum(raws) * kind.per_value
    try:
        for li in dict.fromkeys(links):
            d.link(li)
        for si in dict.fromkeys(stacks):
            d.stack(si)
    except (Invalid, StackRefused):
        return None
    return len(raws) - raws.count(0), sum(raws) * kind.per_value


def _verified(d: Dictionary, summary: native.Summary | None) -> bool:
    """Whether the native check of every dictionary entry (``summary``) covers what the
    profiles' samples can use: the same tables, and no use of them able to go over what is
    left of the stack budget (so the per-entry checks and charges may be skipped)."""
    t = d.table
    return summary is not None and (summary.strings, summary.links, summary.stacks) == (
        d.n_str, len(d.links), len(d.stacks_tbl)) and summary.depth <= t.max_depth and (
        t.frames - FRAME_FANOUT * t.refs + summary.excess <= FRAME_SLACK) and (
        t.text + summary.text <= t.max_text)


def _upb_columns(prof: Any) -> tuple[list[int], list[int], list[int]] | None:
    """The usual samples' stack indices, link indices and values, read through upb;
    None when a sample is unusual."""
    samples = prof.samples
    values = [s.values for s in samples]
    if not values or set(map(len, values)) != {1}:
        return None
    raws = [v[0] for v in values]
    links = [s.link_index for s in samples]
    stacks = [s.stack_index for s in samples]
    if min(raws) < 0 or not _only_these_fields(prof, stacks, links, raws):
        return None
    return stacks, links, raws


# varint sizes: a value v takes 1 + (number of these it is at least) bytes
_VARINT_STEPS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def _varint_sizes(col: Any) -> Any:
    """Bytes each value of an int64 array takes as a protobuf varint (a negative int32 or
    int64: ten)."""
    return 1 + np.searchsorted(_VARINT_STEPS, col.view(np.uint64), side="right")


def _only_these_fields(prof: Any, stacks: list[int], links: list[int], raws: list[int]
                       ) -> bool:
    """Whether every sample holds only its stack index, link index and one value (no
    timestamps, attributes or unknown fields), told by sizes instead of reading two more
    fields of every sample: the profile's encoded size is its other fields' plus each
    sample's, and a sample is never smaller than what these three take, so the sizes add up
    only when no sample has anything else."""
    rest = type(prof)()
    rest.CopyFrom(prof)
    del rest.samples[:]
    s, lk = np.array(stacks, dtype=np.int64), np.array(links, dtype=np.int64)
    # stack_index = 1 and link_index = 3 (omitted when 0), values = 4 (packed: tag, length,
    # the varint); each sample is a Profile.samples (2) entry: tag, length, its bytes
    size = ((s != 0) * (1 + _varint_sizes(s)) + (lk != 0) * (1 + _varint_sizes(lk))
            + 2 + _varint_sizes(np.array(raws, dtype=np.int64)))
    whole = int(size.sum()) + len(raws) + int(_varint_sizes(size.astype(np.int64)).sum())
    return bool(prof.ByteSize() == rest.ByteSize() + whole)


def _instants(out: list[Sample], values: Any, stamps: Any, kind: Kind,
              who: tuple[bytes, bytes, str, int], what: tuple[str, str, int, str, str, int, str]
              ) -> None:
    """One record per instant: that is what lets the correlator place each one in the span
    (and thread) that was running then; no values: one period each."""
    trace_id, span_id, service, stack_id = who
    type_s, unit_s, thread_id, thread_name, span_name, pid, host = what
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
                          value, ticks, type_s, unit_s, thread_id, thread_name, span_name,
                          pid, host, True))


__all__ += ["Where"]

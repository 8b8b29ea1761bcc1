"""pprof (``perftools.profiles.Profile``) -> ``ProfileBatch``, links taken from labels.

Pyroscope SDKs label samples with the local root span: ``span_id`` (16 hex), optionally
``trace_id`` (32 hex); older Java/Ruby integrations say ``profile_id``; Datadog's agents
``span id`` / ``local root span id`` as decimal strings or numbers. A sample with a span id
and no trace id becomes a span-only link (trace resolved by span id in ClickHouse).
``thread_id``/``thread_name`` and ``span_name`` labels are kept on the sample.
Values are normalised as for OTLP (``classify``): time measures in nanoseconds, and when a
profile has several sample types of one measure (Go: ``samples/count`` and
``cpu/nanoseconds``) only one counts, the time-unit one, so CPU is never doubled.

Decoding is two steps so that a push is bounded before anything is built from it:
``parse`` + ``prepare`` (tables checked against ``Limits``, records counted) for every
profile of a push, then ``build`` under one ``Budget`` (stacks, values) shared by the push.
Every value that becomes a column is checked (``pipeline/otlp/bounds.py``): a profile that
could not be stored is refused whole, 400 naming the field; over a limit, 413.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from pipeline.errors import InvalidData, TooLarge
from pipeline.otlp.bounds import (
    MAX_COUNT,
    MAX_REQUEST_VALUE,
    MAX_SAMPLE_VALUE,
    MAX_STACK_DEPTH,
    UINT64_MAX,
    time_problem,
)
from pipeline.otlp.profiles import Kind, classify
from pipeline.otlp.stacks import Frames, StackRefused, StackTable
from pipeline.pyroscope.messages import Profile
from pipeline.receivers.limits import gunzip_limited
from pipeline.records import ProfileBatch, Sample

SPAN_KEYS = ("span_id", "profile_id", "span id", "local root span id")
TRACE_KEYS = ("trace_id", "trace id")
THREAD_ID_KEYS = ("thread_id", "thread id", "thread.id")
THREAD_NAME_KEYS = ("thread_name", "thread name", "thread.name")
# what a label key means, looked up once per key string
_SPAN, _TRACE, _THREAD_ID, _THREAD_NAME, _SPAN_NAME, _OTHER = range(6)
_LABEL_KIND = {**dict.fromkeys(SPAN_KEYS, _SPAN), **dict.fromkeys(TRACE_KEYS, _TRACE),
               **dict.fromkeys(THREAD_ID_KEYS, _THREAD_ID),
               **dict.fromkeys(THREAD_NAME_KEYS, _THREAD_NAME), "span_name": _SPAN_NAME}


class Limits(NamedTuple):
    """What one push may hold (the pyroscope receiver's config keys, in parentheses)."""

    max_samples: int = 1_000_000  # records, all profiles of a push (max_samples_per_request)
    max_stack_depth: int = MAX_STACK_DEPTH  # frames in one stack (max_stack_depth)
    max_table_entries: int = 1_000_000  # strings, functions, locations... (max_table_entries)
    max_labels: int = 128  # labels of one sample or series (max_labels)


DEFAULT_LIMITS = Limits()


class Prepared(NamedTuple):
    """A parsed profile whose tables are within limits, and what its records will be."""

    profile: Any
    kinds: list[tuple[int, Kind, str, str]]  # value index, kind, sample type, unit
    records: int  # at most this many records (samples x kinds)


class Budget:
    """Shared by every profile of a push: stacks built and values added up so far."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.stacks = StackTable(limits.max_stack_depth, depth_key="max_stack_depth")
        self.value_total = 0


def _is_digits(v: str) -> bool:
    """ASCII digits only: ``"²".isdigit()`` is True and ``int("²")`` fails."""
    return v.isascii() and v.isdigit()


def span_id_of(value: str, num: int) -> bytes | None:
    if value:
        v = value.strip().lower()
        if len(v) == 16:
            try:
                return bytes.fromhex(v)
            except ValueError:
                pass
        if _is_digits(v) and len(v) <= 20:
            num = int(v)
        else:
            return None
    if 0 < num < 1 << 64:
        return num.to_bytes(8, "big")
    return None


def trace_id_of(value: str) -> bytes:
    v = value.strip().lower()
    if len(v) == 32:
        try:
            tid = bytes.fromhex(v)
            return b"" if not any(tid) else tid
        except ValueError:
            return b""
    return b""


def parse(data: bytes, max_bytes: int = 64 << 20) -> Any:
    """Raw or gzipped pprof bytes -> ``Profile`` (gzip inflated within ``max_bytes``)."""
    if data[:2] == b"\x1f\x8b":
        data = gunzip_limited(data, max_bytes, "pprof", "max_decompressed_bytes")
    try:
        return Profile.FromString(data)
    except DecodeError as err:
        raise InvalidData(f"pprof: not a valid profile: {err}") from None


class Strings:
    """Range-checked reads of the string table, without copying it into a list."""

    def __init__(self, p: Any) -> None:
        self.tbl = p.string_table
        self.n = len(self.tbl)

    def __call__(self, i: int, what: str) -> str:
        if not 0 <= i < self.n:
            raise InvalidData(f"pprof: {what} string index {i} out of range ({self.n})")
        return str(self.tbl[i])


def check_tables(p: Any, limits: Limits) -> None:
    for name in ("string_table", "function", "location", "mapping", "sample_type", "sample"):
        n = len(getattr(p, name))
        if n > limits.max_table_entries:
            raise TooLarge(f"pprof: {n} {name} entries, over max_table_entries="
                           f"{limits.max_table_entries}")


def prepare(p: Any, sample_types: dict[str, Any] | None = None,
            limits: Limits = DEFAULT_LIMITS) -> Prepared:
    """Tables within limits, and one sample type per measure (prefer time units over
    counts). ``sample_types``: the legacy /ingest form's ``sample_type_config`` (Pyroscope's
    Java agent): per sample type, ``display-name`` renames it and ``units: samples`` says
    its values count profiler ticks of the profile's period."""
    check_tables(p, limits)
    s = Strings(p)
    period_type = s(p.period_type.type, "period_type") if p.HasField("period_type") else ""
    period_unit = s(p.period_type.unit, "period_type") if p.HasField("period_type") else ""
    kinds: dict[str, tuple[int, Kind, str, str]] = {}
    for i, vt in enumerate(p.sample_type):
        t, u = s(vt.type, "sample_type"), s(vt.unit, "sample_type")
        override = (sample_types or {}).get(t)
        if isinstance(override, dict):
            name = override.get("display-name")
            name = name if isinstance(name, str) and name else t
            if override.get("units") == "samples":
                k = classify("samples", "count", period_type if period_type in ("cpu", "wall")
                             else name, period_unit, int(p.period))
                t, u = name, "count"
            else:
                t = name
                k = classify(t, u, period_type, period_unit, int(p.period))
        else:
            k = classify(t, u, period_type, period_unit, int(p.period))
        key = k.measure if k.measure != "other" else f"other:{t}/{u}"
        prev = kinds.get(key)
        if prev is None or (prev[1].value_is_count and not k.value_is_count):
            kinds[key] = (i, k, t, u)
    return Prepared(p, list(kinds.values()), len(p.sample) * len(kinds))


class _Locations:
    """Locations and functions by id, each resolved once. Ids are usually 1..n in order
    (Go's writer): then no dictionary of the whole table is built."""

    def __init__(self, p: Any, s: Strings, stacks: StackTable) -> None:
        self.p, self.s, self.stacks = p, s, stacks
        self.frames: dict[int, Frames] = {}
        self._by_id: dict[str, dict[int, Any]] = {}

    def _get(self, table: str, i: int) -> Any:
        tbl = getattr(self.p, table)
        if 1 <= i <= len(tbl) and tbl[i - 1].id == i:
            return tbl[i - 1]
        by_id = self._by_id.get(table)
        if by_id is None:
            by_id = self._by_id[table] = {m.id: m for m in tbl}
        return by_id.get(i)

    def __call__(self, lid: int, n: int) -> Frames:
        got = self.frames.get(lid)
        if got is not None:
            return got
        loc = self._get("location", lid)
        if loc is None:
            raise InvalidData(f"pprof: sample[{n}] references location {lid}, "
                              "which the profile does not define")
        what = f"location {lid}"
        if not loc.line:
            got = self.stacks.location([(f"0x{loc.address:x}", "", 0)], what)
        else:
            self.stacks.check_depth(len(loc.line), what)
            frames = []
            for line in loc.line:
                fn = self._get("function", line.function_id)
                if fn is None:
                    raise InvalidData(f"pprof: location {lid} references function "
                                      f"{line.function_id}, which is not defined")
                frames.append((self.s(fn.name, "function name"),
                               self.s(fn.filename, "function filename"), int(line.line)))
            got = self.stacks.location(frames, what)
        self.frames[lid] = got
        return got


class _Labels(NamedTuple):
    span: bytes
    trace: bytes
    thread_id: int
    thread_name: str
    span_name: str


def _labels(smp: Any, n: int, s: Strings, key_kind: dict[int, int], limits: Limits) -> _Labels:
    if len(smp.label) > limits.max_labels:
        raise TooLarge(f"pprof: sample[{n}] has {len(smp.label)} labels, over max_labels="
                       f"{limits.max_labels}")
    span: bytes | None = None
    trace = b""
    thread_id, thread_name, span_name = 0, "", ""
    for lb in smp.label:
        kind = key_kind.get(lb.key)
        if kind is None:
            kind = key_kind[lb.key] = _LABEL_KIND.get(s(lb.key, "label key"), _OTHER)
        if kind == _SPAN and span is None:
            span = span_id_of(s(lb.str, "label value") if lb.str else "", int(lb.num))
        elif kind == _TRACE:
            trace = trace_id_of(s(lb.str, "label value"))
        elif kind == _THREAD_ID:
            v = s(lb.str, "label value") if lb.str else ""
            thread_id = int(v) if _is_digits(v) else max(0, int(lb.num))
            if thread_id > UINT64_MAX:
                raise InvalidData(f"pprof: sample[{n}] label thread_id {v} is over UInt64")
        elif kind == _THREAD_NAME:
            thread_name = s(lb.str, "label value")
        elif kind == _SPAN_NAME:
            span_name = s(lb.str, "label value")
    return _Labels(span or b"", trace if span else b"", thread_id, thread_name, span_name)


def build(prep: Prepared, service: str, budget: Budget | None = None,
          time_ns: int = 0) -> ProfileBatch:
    """Records of a prepared profile, stacks and values within the push's ``budget``.
    pprof has no time per sample: every sample takes ``time_ns`` (the /ingest request's
    ``from``, checked by the caller) or else the profile's start (``time_nanos``) or else
    now, and is not ``timed``: it stays on the span its labels name."""
    budget = budget or Budget()
    p, kinds = prep.profile, prep.kinds
    t0 = time_ns or int(p.time_nanos) or time.time_ns()
    problem = time_problem(t0, "time_nanos")
    if problem:
        raise InvalidData(f"pprof: {problem}")
    s = Strings(p)
    stacks = budget.stacks
    locations = _Locations(p, s, stacks)
    by_locs: dict[tuple[int, ...], int] = {}
    key_kind: dict[int, int] = {}
    samples: list[Sample] = []
    total = budget.value_total
    for n, smp in enumerate(p.sample):
        try:
            stacks.check_depth(len(smp.location_id), f"sample[{n}]")
            locs = tuple(smp.location_id)
            sid = by_locs.get(locs)
            if sid is None:
                sid = by_locs[locs] = stacks.stack([locations(lid, n) for lid in locs],
                                                   f"sample[{n}]")
        except StackRefused as err:
            raise TooLarge(f"pprof: {err}") from None
        lb = _labels(smp, n, s, key_kind, budget.limits)
        values = smp.value
        for i, k, t, u in kinds:
            if i >= len(values):
                raise InvalidData(f"pprof: sample[{n}] has {len(values)} values for "
                                  f"{len(p.sample_type)} sample types")
            raw = int(values[i])
            if raw <= 0:
                continue
            value = raw * k.per_value
            ticks = raw if k.value_is_count else (
                max(1, round(value / k.period_ns)) if k.period_ns and k.measure != "other"
                else 1)
            if value > MAX_SAMPLE_VALUE or ticks > MAX_COUNT:
                raise InvalidData(f"pprof: sample[{n}].value[{i}] {raw} ({value} after units, "
                                  f"{ticks} ticks) is over the per-sample limit "
                                  f"{MAX_SAMPLE_VALUE} or UInt32 ticks")
            total += value
            samples.append(Sample(lb.trace, lb.span, service, t0, sid, k.measure, value,
                                  ticks, t, u, lb.thread_id, lb.thread_name, lb.span_name))
    if total > MAX_REQUEST_VALUE:
        raise InvalidData(f"pprof: sample values add up to {total}, over {MAX_REQUEST_VALUE}")
    budget.value_total = total
    return ProfileBatch(samples, {sid: stacks.stacks[sid]
                                  for sid in {x.stack_id for x in samples}})


def decode_pprof(data: bytes, service: str, max_bytes: int = 64 << 20,
                 sample_types: dict[str, Any] | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> ProfileBatch:
    """One profile, start to end (``max_samples`` checked before records are built)."""
    prep = prepare(parse(data, max_bytes), sample_types, limits)
    if prep.records > limits.max_samples:
        raise TooLarge(f"pprof: up to {prep.records} samples, over max_samples_per_request="
                       f"{limits.max_samples}")
    return build(prep, service, Budget(limits))

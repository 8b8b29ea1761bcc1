"""pprof (``perftools.profiles.Profile``) -> ``ProfileBatch``, links taken from labels.

Pyroscope SDKs label samples with the local root span: ``span_id`` (16 hex), optionally
``trace_id`` (32 hex); older Java/Ruby integrations say ``profile_id``; Datadog's agents
``span id`` / ``local root span id`` as decimal strings or numbers. A sample with a span id
and no trace id becomes a span-only link (trace resolved by span id in ClickHouse).
``thread_id``/``thread_name`` and ``span_name`` labels are kept on the sample.
Values are normalised as for OTLP (``classify``): time measures in nanoseconds, and when a
profile has several sample types of one measure (Go: ``samples/count`` and
``cpu/nanoseconds``) only one counts, the time-unit one, so CPU is never doubled.
"""

from __future__ import annotations

import time
from typing import Any

from google.protobuf.message import DecodeError

from pipeline.errors import InvalidData
from pipeline.otlp.profiles import classify, stack_hash
from pipeline.pyroscope.messages import Profile
from pipeline.receivers.limits import gunzip_limited
from pipeline.records import ProfileBatch, Sample, Stack

SPAN_KEYS = ("span_id", "profile_id", "span id", "local root span id")
TRACE_KEYS = ("trace_id", "trace id")
THREAD_ID_KEYS = ("thread_id", "thread id", "thread.id")
THREAD_NAME_KEYS = ("thread_name", "thread name", "thread.name")


def _span_id(value: str, num: int) -> bytes | None:
    if value:
        v = value.strip().lower()
        if len(v) == 16:
            try:
                return bytes.fromhex(v)
            except ValueError:
                pass
        if v.isdigit():
            num = int(v)
        else:
            return None
    if 0 < num < 1 << 64:
        return num.to_bytes(8, "big")
    return None


def _trace_id(value: str) -> bytes:
    v = value.strip().lower()
    if len(v) == 32:
        try:
            tid = bytes.fromhex(v)
            return b"" if not any(tid) else tid
        except ValueError:
            return b""
    return b""


def decode_pprof(data: bytes, service: str, max_bytes: int = 64 << 20,
                 sample_types: dict[str, Any] | None = None) -> ProfileBatch:
    """``sample_types``: the legacy /ingest form's ``sample_type_config`` (Pyroscope's Java
    agent): per sample type, ``display-name`` renames it and ``units: samples`` says its
    values count profiler ticks of the profile's period."""
    if data[:2] == b"\x1f\x8b":
        data = gunzip_limited(data, max_bytes, "pprof", "max_decompressed_bytes")
    try:
        p = Profile.FromString(data)
    except DecodeError as err:
        raise InvalidData(f"pprof: not a valid profile: {err}") from None
    st = list(p.string_table)

    def s(i: int, what: str) -> str:
        if not 0 <= i < len(st):
            raise InvalidData(f"pprof: {what} string index {i} out of range ({len(st)})")
        return str(st[i])

    functions = {f.id: f for f in p.function}
    locations = {loc.id: loc for loc in p.location}
    period_type = s(p.period_type.type, "period_type") if p.HasField("period_type") else ""
    period_unit = s(p.period_type.unit, "period_type") if p.HasField("period_type") else ""
    # one sample type per measure: prefer time units over counts
    kinds: dict[str, tuple[int, Any, str, str]] = {}
    for i, vt in enumerate(p.sample_type):
        t, u = s(vt.type, "sample_type"), s(vt.unit, "sample_type")
        override = (sample_types or {}).get(t)
        if isinstance(override, dict):
            name = str(override.get("display-name") or t)
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
    t0 = int(p.time_nanos) or time.time_ns()
    stacks: dict[int, Stack] = {}
    by_locs: dict[tuple[int, ...], int] = {}
    samples: list[Sample] = []
    for n, smp in enumerate(p.sample):
        locs = tuple(smp.location_id)
        sid = by_locs.get(locs)
        if sid is None:
            fns, files, lines = [], [], []
            for lid in locs:  # leaf first, as in OTLP
                loc = locations.get(lid)
                if loc is None:
                    raise InvalidData(f"pprof: sample[{n}] references location {lid}, "
                                      "which the profile does not define")
                if not loc.line:
                    fns.append(f"0x{loc.address:x}")
                    files.append("")
                    lines.append(0)
                for line in loc.line:
                    fn = functions.get(line.function_id)
                    if fn is None:
                        raise InvalidData(f"pprof: location {lid} references function "
                                          f"{line.function_id}, which is not defined")
                    fns.append(s(fn.name, "function name"))
                    files.append(s(fn.filename, "function filename"))
                    lines.append(int(line.line))
            sid = by_locs[locs] = stack_hash(fns, files, lines)
            stacks.setdefault(sid, Stack(sid, fns, files, lines))
        span: bytes | None = None
        trace = b""
        thread_id, thread_name, span_name = 0, "", ""
        for lb in smp.label:
            key = s(lb.key, "label key")
            if key in SPAN_KEYS and span is None:
                span = _span_id(s(lb.str, "label value") if lb.str else "", int(lb.num))
            elif key in TRACE_KEYS:
                trace = _trace_id(s(lb.str, "label value"))
            elif key in THREAD_ID_KEYS:
                v = s(lb.str, "label value") if lb.str else ""
                thread_id = int(v) if v.isdigit() else max(0, int(lb.num))
            elif key in THREAD_NAME_KEYS:
                thread_name = s(lb.str, "label value")
            elif key == "span_name":
                span_name = s(lb.str, "label value")
        for i, k, t, u in kinds.values():
            if i >= len(smp.value):
                raise InvalidData(f"pprof: sample[{n}] has {len(smp.value)} values for "
                                  f"{len(p.sample_type)} sample types")
            raw = int(smp.value[i])
            if raw <= 0:
                continue
            value = raw * k.per_value
            ticks = raw if k.value_is_count else (
                max(1, round(value / k.period_ns)) if k.period_ns and k.measure != "other"
                else 1)
            samples.append(Sample(trace if span else b"", span or b"", service, t0, sid,
                                  k.measure, value, ticks, t, u, thread_id, thread_name,
                                  span_name))
    return ProfileBatch(samples, {sid: stacks[sid] for sid in {x.stack_id for x in samples}})

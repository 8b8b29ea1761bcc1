"""Build OTLP profiles (v1development) from plain stacks: for tests, benchmarks and tools.

The dictionary is shared by the whole request and interned, as a real profiler does:
``link_table[0]`` and ``stack_table[0]`` are the zero entries, strings are de-duplicated.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.profiles.v1development import profiles_pb2 as pb


class ProfileBuilder:
    def __init__(self) -> None:
        self.req = ExportProfilesServiceRequest()
        d = self.req.dictionary
        self._strings: dict[str, int] = {}
        self._functions: dict[tuple[str, str], int] = {}
        self._locations: dict[tuple[int, int], int] = {}
        self._stacks: dict[tuple[int, ...], int] = {}
        self._links: dict[tuple[bytes, bytes], int] = {}
        self._attrs: dict[tuple[str, str | int], int] = {}
        self._resources: dict[tuple[object, ...], Any] = {}
        self.string("")
        d.mapping_table.add()
        d.function_table.add()
        d.location_table.add()
        d.stack_table.add()
        d.link_table.add()
        d.attribute_table.add()
        self._profile_by_service: dict[tuple[object, ...], Any] = {}

    def string(self, s: str) -> int:
        i = self._strings.get(s)
        if i is None:
            i = self._strings[s] = len(self.req.dictionary.string_table)
            self.req.dictionary.string_table.append(s)
        return i

    def stack(self, frames: list[str], file: str = "app.py",
              files: list[str] | None = None, lines: list[int] | None = None) -> int:
        """Index of a stack of function names, leaf first (``files``: one per frame)."""
        d = self.req.dictionary
        locs = []
        for n, fn in enumerate(frames):
            file = files[n] if files is not None else file
            key = (fn, file)
            fi = self._functions.get(key)
            if fi is None:
                fi = self._functions[key] = len(d.function_table)
                d.function_table.add(name_strindex=self.string(fn),
                                     filename_strindex=self.string(file))
            line = lines[n] if lines is not None else 1
            li = self._locations.get((fi, line))
            if li is None:
                li = self._locations[(fi, line)] = len(d.location_table)
                d.location_table.add(lines=[pb.Line(function_index=fi, line=line)])
            locs.append(li)
        t = tuple(locs)
        si = self._stacks.get(t)
        if si is None:
            si = self._stacks[t] = len(d.stack_table)
            d.stack_table.add(location_indices=locs)
        return si

    def link(self, trace_id: bytes, span_id: bytes) -> int:
        if not trace_id and not span_id:
            return 0
        trace_id = trace_id or bytes(16)  # a span-only link: all-zero trace id
        key = (trace_id, span_id)
        i = self._links.get(key)
        if i is None:
            i = self._links[key] = len(self.req.dictionary.link_table)
            self.req.dictionary.link_table.add(trace_id=trace_id, span_id=span_id)
        return i

    def attribute(self, key: str, value: str | int) -> int:
        """Index of ``key=value`` in the dictionary's attribute_table (interned)."""
        k = (key, value)
        i = self._attrs.get(k)
        if i is None:
            i = self._attrs[k] = len(self.req.dictionary.attribute_table)
            kv = self.req.dictionary.attribute_table.add(key_strindex=self.string(key))
            if isinstance(value, int):
                kv.value.int_value = value
            else:
                kv.value.string_value = value
        return i

    def profile(self, service: str = "svc", sample_type: str = "cpu",
                unit: str = "nanoseconds", period_type: str = "cpu",
                period_unit: str = "nanoseconds", period: int = 10_000_000,
                time_unix_nano: int | None = None,
                resource: dict[str, str | int] | None = None) -> Any:
        res = tuple(sorted((resource or {}).items()))
        key = (service, sample_type, unit, period_type, period_unit, period, time_unix_nano,
               res)
        prof = self._profile_by_service.get(key)
        if prof is not None:
            return prof
        rp = self._resources.get((service, res))
        if rp is None:
            rp = self._resources[(service, res)] = self.req.resource_profiles.add()
            rp.resource.attributes.append(
                KeyValue(key="service.name", value=AnyValue(string_value=service)))
            for k, v in res:
                rp.resource.attributes.append(KeyValue(key=k, value=AnyValue(
                    int_value=v) if isinstance(v, int) else AnyValue(string_value=v)))
            rp.scope_profiles.add()
        prof = rp.scope_profiles[0].profiles.add()
        prof.sample_type.type_strindex = self.string(sample_type)
        prof.sample_type.unit_strindex = self.string(unit)
        prof.period_type.type_strindex = self.string(period_type)
        prof.period_type.unit_strindex = self.string(period_unit)
        prof.period = period
        prof.time_unix_nano = time.time_ns() if time_unix_nano is None else time_unix_nano
        self._profile_by_service[key] = prof
        return prof

    def sample(self, frames: list[str], value: int | None, trace_id: bytes = b"",
               span_id: bytes = b"", timestamps: list[int] | None = None,
               files: list[str] | None = None, lines: list[int] | None = None,
               attributes: dict[str, str | int] | None = None, **profile_kw: Any) -> Any:
        """One sample; ``attributes`` become attribute_table entries (``thread.id``...)."""
        prof = self.profile(**profile_kw)
        s = prof.samples.add(stack_index=self.stack(frames, files=files, lines=lines),
                             link_index=self.link(trace_id, span_id))
        if attributes:
            s.attribute_indices.extend(self.attribute(k, v) for k, v in attributes.items())
        if value is not None:
            s.values.append(value)
        if timestamps:
            s.timestamps_unix_nano.extend(timestamps)
        return s

    def build(self) -> ExportProfilesServiceRequest:
        return self.req


def encode_profiles(batch: Any) -> Any:
    """Internal profile records -> one ExportProfilesServiceRequest (for exporters that
    forward profiles that did not arrive as OTLP, e.g. from Pyroscope). Time measures are
    written as ``<measure>/nanoseconds`` so they read back as the same measure and value."""
    b = ProfileBuilder()
    for smp in batch.samples:
        st = batch.stacks.get(smp.stack_id)
        frames = st.functions if st is not None else []
        files = st.files if st is not None else None
        lines = st.lines if st is not None else None
        if smp.measure == "other":
            kind = {"sample_type": smp.sample_type, "unit": smp.unit}
        else:
            kind = {"sample_type": smp.measure, "unit": "nanoseconds",
                    "period_type": smp.measure}
        attrs: dict[str, str | int] = {}
        if smp.thread_id:
            attrs["thread.id"] = smp.thread_id
        if smp.thread_name:
            attrs["thread.name"] = smp.thread_name
        if smp.span_name:
            attrs["span_name"] = smp.span_name
        res: dict[str, str | int] = {}
        if smp.pid:
            res["process.pid"] = smp.pid
        if smp.host:
            res["host.name"] = smp.host
        b.sample(frames, smp.value, smp.trace_id, smp.span_id, files=files, lines=lines,
                 attributes=attrs, service=smp.service,
                 timestamps=[smp.time_ns] if smp.timed else None,
                 time_unix_nano=None if smp.timed else smp.time_ns, resource=res, **kind)
    return b.build()

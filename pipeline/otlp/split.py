"""Split OTLP requests per trace, as messages for Kafka.

All spans and all linked samples of one trace must land on one partition, so the
correlator worker that owns the partition sees the whole trace. Traces are split the way the
Collector's kafka exporter does with ``partition_traces_by_id`` (one message per trace id,
keyed by the trace id's hex); profiles are split the same way by the trace of each sample's
link (the Collector has no profile partitioning), each part with a *compacted* dictionary
that holds only what its samples reference. Samples without a link go under key ``""``.

Items the receiver rejected are left out (``rejected`` holds their paths).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

Path = tuple[int, int, int]


class MessageKeys:
    """The key of each trace's message: its id in hex, or with ``bucket_of`` (trace hex ->
    partition) the first such key of its partition, so that one message goes to each
    partition per request. ``known`` holds those already made (look there first).
    ``prime`` hashes many trace ids at once when ``bucket_of`` can (``kafka.buckets``)."""

    __slots__ = ("known", "_first", "_bucket_of", "_primed")

    def __init__(self, bucket_of: Callable[[str], object] | None) -> None:
        self.known: dict[bytes, str] = {}
        self._first: dict[object, str] = {}
        self._bucket_of = bucket_of
        self._primed: dict[bytes, object] = {}

    def prime(self, trace_ids: list[bytes]) -> None:
        """The partitions of ``trace_ids``, hashed together, for ``new`` to look up."""
        many = getattr(self._bucket_of, "many", None)
        if many is not None and trace_ids:
            self._primed.update(zip(trace_ids, many(trace_ids), strict=True))

    def new(self, trace_id: bytes) -> str:
        key = trace_id.hex()
        if self._bucket_of is not None:
            bucket = self._primed.get(trace_id)
            if bucket is None:
                bucket = self._bucket_of(key)
            key = self._first.setdefault(bucket, key)
        self.known[trace_id] = key
        return key


def split_traces(req: ExportTraceServiceRequest, rejected: Iterable[Path] = (),
                 bucket_of: Callable[[str], object] | None = None
                 ) -> dict[str, ExportTraceServiceRequest]:
    """Per trace (hex), a request with only its spans; with ``bucket_of`` (trace hex ->
    partition), per partition, keyed by the first of its trace ids (as ``split_profiles``):
    one message per partition per request, co-partitioned with the trace's samples."""
    skip = set(rejected)
    out: dict[str, ExportTraceServiceRequest] = {}
    keys = MessageKeys(bucket_of)
    # (trace, resource index, scope index) -> the ScopeSpans being filled
    scopes: dict[tuple[str, int, int], Any] = {}
    resources: dict[tuple[str, int], Any] = {}
    for ri, rs in enumerate(req.resource_spans):
        for si, ss in enumerate(rs.scope_spans):
            for pi, span in enumerate(ss.spans):
                if (ri, si, pi) in skip:
                    continue
                tid = span.trace_id
                key = keys.known.get(tid)
                if key is None:
                    key = keys.new(tid)
                dst_ss = scopes.get((key, ri, si))
                if dst_ss is None:
                    dst_rs = resources.get((key, ri))
                    if dst_rs is None:
                        part = out.get(key)
                        if part is None:
                            part = out[key] = ExportTraceServiceRequest()
                        dst_rs = resources[(key, ri)] = part.resource_spans.add()
                        dst_rs.resource.CopyFrom(rs.resource)
                        dst_rs.schema_url = rs.schema_url
                    dst_ss = scopes[(key, ri, si)] = dst_rs.scope_spans.add()
                    dst_ss.scope.CopyFrom(ss.scope)
                    dst_ss.schema_url = ss.schema_url
                dst_ss.spans.append(span)
    return out


def halve_traces(req: ExportTraceServiceRequest) -> list[ExportTraceServiceRequest]:
    """Two requests holding half the spans each (for messages over max_message_bytes)."""
    spans = [(ri, si, pi) for ri, rs in enumerate(req.resource_spans)
             for si, ss in enumerate(rs.scope_spans) for pi in range(len(ss.spans))]
    if len(spans) < 2:
        return [req]
    half = set(spans[: len(spans) // 2])
    a = split_traces(req, rejected=[p for p in spans if p not in half])
    b = split_traces(req, rejected=half)
    return [m for part in (a, b) for m in part.values()]


class _Compactor:
    """Copies dictionary entries on first use, remapping every index (0 stays the zero)."""

    TABLES = ("mapping_table", "location_table", "function_table", "link_table",
              "string_table", "attribute_table", "stack_table")

    def __init__(self, src: Any, dst: Any) -> None:
        self.src, self.dst = src, dst
        self.maps: dict[str, dict[int, int]] = {t: {} for t in self.TABLES}
        self.string(0)
        for t in self.TABLES:
            if t != "string_table" and len(getattr(src, t)):
                self._copy(t, 0)

    def _copy(self, table: str, i: int) -> int:
        m = self.maps[table]
        j = m.get(i)
        if j is not None:
            return j
        j = m[i] = len(getattr(self.dst, table))
        entry = getattr(self.dst, table).add()
        entry.CopyFrom(getattr(self.src, table)[i])
        fix = getattr(self, f"_fix_{table}", None)
        if fix is not None:
            fix(entry)
        return j

    def string(self, i: int) -> int:
        m = self.maps["string_table"]
        j = m.get(i)
        if j is None:
            j = m[i] = len(self.dst.string_table)
            self.dst.string_table.append(self.src.string_table[i])
        return j

    def attrs(self, indices: Any) -> list[int]:
        return [self._copy("attribute_table", i) for i in indices]

    def _fix_attribute_table(self, e: Any) -> None:
        e.key_strindex = self.string(e.key_strindex)
        e.unit_strindex = self.string(e.unit_strindex)

    def _fix_mapping_table(self, e: Any) -> None:
        e.filename_strindex = self.string(e.filename_strindex)
        e.attribute_indices[:] = self.attrs(e.attribute_indices)

    def _fix_function_table(self, e: Any) -> None:
        e.name_strindex = self.string(e.name_strindex)
        e.system_name_strindex = self.string(e.system_name_strindex)
        e.filename_strindex = self.string(e.filename_strindex)

    def _fix_location_table(self, e: Any) -> None:
        # without a mapping_table, index 0 means "no mapping" (the decoder accepts it)
        if len(self.src.mapping_table):
            e.mapping_index = self._copy("mapping_table", e.mapping_index)
        for line in e.lines:
            line.function_index = self._copy("function_table", line.function_index)
        e.attribute_indices[:] = self.attrs(e.attribute_indices)

    def _fix_stack_table(self, e: Any) -> None:
        e.location_indices[:] = [self._copy("location_table", i) for i in e.location_indices]

    def value_type(self, dst: Any, src: Any) -> None:
        dst.type_strindex = self.string(src.type_strindex)
        dst.unit_strindex = self.string(src.unit_strindex)


def split_profiles(req: ExportProfilesServiceRequest, rejected: Iterable[Path] = (),
                   bucket_of: Callable[[str], object] | None = None
                   ) -> dict[str, ExportProfilesServiceRequest]:
    """Per linked trace (hex; ``""`` for unlinked samples), a request with only its samples.

    With ``bucket_of`` (trace hex -> partition), traces of one bucket share a message, keyed
    by the first of their trace ids: it hashes to the same partition as every other trace
    in the message, so co-partitioning holds, and a 10 s profile of a busy service (samples
    of thousands of traces) becomes a few messages instead of thousands.
    ``req`` must be valid (indices checked by the decoder); ``rejected`` profiles are skipped.
    """
    skip = set(rejected)
    d = req.dictionary
    n_links, n_stacks = len(d.link_table), len(d.stack_table)
    parts: dict[str, tuple[ExportProfilesServiceRequest, _Compactor]] = {}
    scopes: dict[tuple[str, int, int], Any] = {}
    profiles: dict[tuple[str, int, int, int], Any] = {}
    keys = MessageKeys(bucket_of)
    for ri, rp in enumerate(req.resource_profiles):
        for si, sp in enumerate(rp.scope_profiles):
            for pi, prof in enumerate(sp.profiles):
                if (ri, si, pi) in skip:
                    continue
                for sample in prof.samples:
                    li = sample.link_index
                    tid = bytes(d.link_table[li].trace_id) if 0 < li < n_links else b""
                    key = keys.known.get(tid)
                    if key is None:  # a trace first met: hex and partition once, not per sample
                        key = keys.new(tid) if tid.strip(b"\0") else ""
                        keys.known[tid] = key
                    got = parts.get(key)
                    if got is None:
                        part = ExportProfilesServiceRequest()
                        got = parts[key] = (part, _Compactor(d, part.dictionary))
                    part, cx = got
                    dst = profiles.get((key, ri, si, pi))
                    if dst is None:
                        dst_sp = scopes.get((key, ri, si))
                        if dst_sp is None:
                            dst_rp = part.resource_profiles.add()
                            dst_rp.resource.CopyFrom(rp.resource)
                            dst_rp.schema_url = rp.schema_url
                            dst_sp = scopes[(key, ri, si)] = dst_rp.scope_profiles.add()
                            dst_sp.scope.CopyFrom(sp.scope)
                            dst_sp.schema_url = sp.schema_url
                        dst = profiles[(key, ri, si, pi)] = _profile_shell(dst_sp, cx, prof)
                    s = dst.samples.add()
                    s.CopyFrom(sample)
                    s.stack_index = cx._copy("stack_table", sample.stack_index) if n_stacks \
                        else 0
                    s.link_index = cx._copy("link_table", li) if n_links else 0
                    s.attribute_indices[:] = cx.attrs(sample.attribute_indices)
    return {k: v[0] for k, v in parts.items()}


def _profile_shell(dst_sp: Any, cx: _Compactor, prof: Any) -> Any:
    """A copy of ``prof`` without samples, its string and attribute indices remapped."""
    p = dst_sp.profiles.add()
    p.CopyFrom(prof)
    del p.samples[:]
    cx.value_type(p.sample_type, prof.sample_type)
    cx.value_type(p.period_type, prof.period_type)
    p.attribute_indices[:] = cx.attrs(prof.attribute_indices)
    return p


def halve_profiles(req: ExportProfilesServiceRequest) -> list[ExportProfilesServiceRequest]:
    """Two requests holding about half the samples each (for max_message_bytes)."""
    total = sum(len(p.samples) for rp in req.resource_profiles for sp in rp.scope_profiles
                for p in sp.profiles)
    if total < 2:
        return [req]
    halves = [ExportProfilesServiceRequest(), ExportProfilesServiceRequest()]
    halves[0].CopyFrom(req)
    halves[1].CopyFrom(req)
    seen = 0
    for ri, rp in enumerate(req.resource_profiles):
        for si, sp in enumerate(rp.scope_profiles):
            for pi, prof in enumerate(sp.profiles):
                n = len(prof.samples)
                cut = min(n, max(0, total // 2 - seen))
                seen += n
                del halves[0].resource_profiles[ri].scope_profiles[si].profiles[pi].samples[cut:]
                del halves[1].resource_profiles[ri].scope_profiles[si].profiles[pi].samples[:cut]
    # re-compact: each half keeps only the dictionary entries it uses
    return [m for h in halves for m in split_profiles(h).values()]

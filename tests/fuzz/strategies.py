"""Hostile inputs for every decoder: valid-looking messages with extreme values, indices
out of range, amplifying shapes (one location repeated, many lines), and byte-level
mutations of valid encodings (invalid UTF-8, truncation, splices)."""

from __future__ import annotations

import base64
import gzip
import json
import time
from typing import Any

from google.protobuf import json_format
from hypothesis import strategies as st
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.otlp.bounds import MAX_SAMPLE_VALUE, TIME_MAX_NS
from pipeline.otlp.builder import ProfileBuilder
from pipeline.pyroscope.messages import Profile, PushRequest

NOW = time.time_ns()
I64 = (-(2**63), 2**63 - 1)
U64 = (0, 2**64 - 1)
EDGES = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, MAX_SAMPLE_VALUE, MAX_SAMPLE_VALUE + 1,
         TIME_MAX_NS - 1, TIME_MAX_NS, (2**32 - 1) * 10**9, 2**63 - 1, NOW, NOW + 1]
int64s = st.one_of(st.sampled_from(EDGES + [-1, -(2**63)]), st.integers(*I64),
                   st.integers(-10, 10**7))
_recent = st.integers(NOW - 10**12, NOW + 10**12)
uint64s = st.one_of(st.sampled_from(EDGES + [2**64 - 1]), st.integers(*U64), _recent, _recent)
int32s = st.one_of(st.integers(-3, 12), st.integers(-(2**31), 2**31 - 1))
# text the proto setters take (valid UTF-8), with the usual suspects
texts = st.one_of(st.sampled_from(["", "²", "٣", "9" * 30, "-1", "cpu", "nanoseconds",
                                   "samples", "count", "wall", "ms", "seconds", "alloc_space",
                                   "bytes", "span_id", "trace_id", "thread_id", "thread.id",
                                   "span_name", "process.pid", "x" * 300]),
                  st.text(max_size=12))
# any code point, lone surrogates included (only JSON and query strings can carry them)
wild_texts = st.text(st.one_of(st.characters(), st.characters(
    min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())), max_size=8)


def ids(n: int) -> st.SearchStrategy[bytes]:
    valid = st.binary(min_size=n, max_size=n)
    return st.one_of(valid, valid, st.just(bytes(n)), st.binary(max_size=20))


def _valid_ids(n: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=n, max_size=n).filter(any)


def any_values(depth: int = 4) -> st.SearchStrategy[AnyValue]:
    leaf = st.one_of(st.builds(lambda s: AnyValue(string_value=s), texts),
                     st.builds(lambda i: AnyValue(int_value=i), int64s),
                     st.builds(lambda f: AnyValue(double_value=f), st.floats()),
                     st.builds(lambda b: AnyValue(bytes_value=b), st.binary(max_size=8)),
                     st.just(AnyValue()))

    def wrap(children: st.SearchStrategy[AnyValue]) -> st.SearchStrategy[AnyValue]:
        def arr(xs: list[AnyValue]) -> AnyValue:
            v = AnyValue()
            v.array_value.values.extend(xs)
            return v

        def kv(items: list[tuple[str, AnyValue]]) -> AnyValue:
            v = AnyValue()
            v.kvlist_value.values.extend(KeyValue(key=k, value=x) for k, x in items)
            return v
        return st.one_of(st.builds(arr, st.lists(children, max_size=3)),
                         st.builds(kv, st.lists(st.tuples(texts, children), max_size=3)))
    return st.recursive(leaf, wrap, max_leaves=depth * 2)


attributes = st.lists(st.builds(lambda k, v: KeyValue(key=k, value=v), texts, any_values()),
                      max_size=3)


@st.composite
def trace_requests(draw: Any, tame: bool = False) -> ExportTraceServiceRequest:
    """``tame``: ids and times valid, so most spans are accepted (for the engine test)."""
    uint64s_, ids_ = (_recent, _valid_ids) if tame else (uint64s, ids)
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 3))):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(draw(attributes))
        if draw(st.booleans()):
            rs.resource.attributes.add(key="service.name").value.string_value = draw(texts)
        for _ in range(draw(st.integers(0, 2))):
            ss = rs.scope_spans.add()
            ss.scope.name = draw(texts)
            for _ in range(draw(st.integers(0, 4))):
                start = draw(uint64s_)
                end = draw(st.one_of(uint64s_, st.just(start), st.integers(
                    start, NOW + 10**12 if tame else 2**64 - 1)))
                if tame:
                    start, end = min(start, end), max(start, end)
                s = ss.spans.add(trace_id=draw(ids_(16)), span_id=draw(ids_(8)),
                                 parent_span_id=draw(ids_(8)), name=draw(texts),
                                 kind=draw(int32s), start_time_unix_nano=start,
                                 end_time_unix_nano=end, trace_state=draw(texts))
                s.attributes.extend(draw(attributes))
                s.status.code = draw(int32s)
                for _ in range(draw(st.integers(0, 2))):
                    s.events.add(time_unix_nano=draw(uint64s_), name=draw(texts))
                for _ in range(draw(st.integers(0, 2))):
                    s.links.add(trace_id=draw(ids_(16)), span_id=draw(ids_(8)))
    return req


FRAMES = ["main", "leaf", "²", "f" * 2000, ""]
SAMPLE_KINDS = [("cpu", "nanoseconds", "cpu", "nanoseconds"),
                ("samples", "count", "cpu", "nanoseconds"),
                ("samples", "count", "wall", "seconds"), ("wall", "milliseconds", "", ""),
                ("alloc_space", "bytes", "", ""), ("samples", "count", "", ""),
                ("off_cpu", "seconds", "off_cpu", "seconds")]


@st.composite
def profile_requests(draw: Any, tame: bool = False) -> ExportProfilesServiceRequest:
    """Built like a profiler would, then perturbed where a hostile client would (``tame``:
    values and times in range, no perturbation: mostly accepted)."""
    uint64s_ = _recent if tame else uint64s
    int64s_ = st.integers(0, 10**9) if tame else int64s
    b = ProfileBuilder()
    for _ in range(draw(st.integers(0, 6))):
        st_, unit, pt, pu = draw(st.sampled_from(SAMPLE_KINDS))
        stamps = draw(st.one_of(st.none(), st.lists(uint64s_, min_size=1, max_size=4)))
        value = draw(st.one_of(st.none(), int64s_)) if stamps is None or draw(
            st.booleans()) else None
        if stamps is not None and value is not None and draw(st.booleans()):
            stamps = stamps[:1]
        attrs = {}
        if draw(st.booleans()):
            attrs["thread.id"] = draw(int64s_ if tame else st.one_of(int64s, texts))
        if draw(st.booleans()):
            attrs[draw(st.sampled_from(["thread.name", "span_name",
                                        "process.context.label.span_id"]))] = draw(texts)
        res = {}
        if draw(st.booleans()):
            res["process.pid"] = draw(st.integers(0, 2**32 - 1) if tame
                                      else st.one_of(int64s, texts))
        ids_ = _valid_ids if tame else ids
        b.sample(draw(st.lists(st.sampled_from(FRAMES), max_size=5)), value,
                 draw(ids_(16)), draw(ids_(8)), timestamps=stamps, attributes=attrs,
                 service=draw(texts), sample_type=st_, unit=unit, period_type=pt,
                 period_unit=pu, period=draw(st.integers(1, 10**8) if tame else int64s),
                 time_unix_nano=draw(st.one_of(st.just(0), uint64s_)), resource=res,
                 lines=None)
    req = b.build()
    for _ in range(0 if tame else draw(st.integers(0, 3))):
        draw(st.sampled_from(_PERTURB))(req, draw)
    return req


def _pick(draw: Any, seq: Any) -> Any:
    return seq[draw(st.integers(0, len(seq) - 1))] if len(seq) else None


def _samples(req: Any) -> list[Any]:
    return [s for rp in req.resource_profiles for sp in rp.scope_profiles
            for p in sp.profiles for s in p.samples]


def _p_index(req: Any, draw: Any) -> None:
    d = req.dictionary
    target = draw(st.sampled_from(["stack", "link", "attr", "loc", "fn", "map", "str",
                                   "attrkey", "type"]))
    v = draw(int32s)
    s = _pick(draw, _samples(req))
    if target == "stack" and s is not None:
        s.stack_index = v
    elif target == "link" and s is not None:
        s.link_index = v
    elif target == "attr" and s is not None:
        s.attribute_indices.append(v)
    elif target == "loc" and (e := _pick(draw, d.stack_table)) is not None:
        e.location_indices.append(v)
    elif target == "fn" and (e := _pick(draw, d.location_table)) is not None:
        e.lines.add(function_index=v, line=draw(int64s))
    elif target == "map" and (e := _pick(draw, d.location_table)) is not None:
        e.mapping_index = v
    elif target == "str" and (e := _pick(draw, d.function_table)) is not None:
        setattr(e, draw(st.sampled_from(["name_strindex", "system_name_strindex",
                                         "filename_strindex"])), v)
    elif target == "attrkey" and (e := _pick(draw, d.attribute_table)) is not None:
        setattr(e, draw(st.sampled_from(["key_strindex", "unit_strindex"])), v)
    elif target == "type":
        prof = _pick(draw, [p for rp in req.resource_profiles for sp in rp.scope_profiles
                            for p in sp.profiles])
        if prof is not None:
            prof.sample_type.unit_strindex = v


def _p_amplify(req: Any, draw: Any) -> None:
    """One location referenced many times, or one location with many lines."""
    d = req.dictionary
    if len(d.location_table) < 2 or len(d.stack_table) < 2:
        return
    if draw(st.booleans()):
        d.stack_table[1].location_indices.extend([1] * draw(st.integers(1, 20_000)))
    else:
        loc = d.location_table[1]
        line = loc.lines[0] if loc.lines else None
        for _ in range(draw(st.integers(1, 3000))):
            loc.lines.add(function_index=line.function_index if line else 0, line=1)


def _p_links(req: Any, draw: Any) -> None:
    d = req.dictionary
    d.link_table.add(trace_id=draw(ids(16)), span_id=draw(ids(8)))
    s = _pick(draw, _samples(req))
    if s is not None:
        s.link_index = len(d.link_table) - 1


def _p_tables(req: Any, draw: Any) -> None:
    d = req.dictionary
    table = draw(st.sampled_from(["mapping_table", "link_table", "attribute_table",
                                  "stack_table", "function_table"]))
    del getattr(d, table)[:]


def _p_stamps(req: Any, draw: Any) -> None:
    s = _pick(draw, _samples(req))
    if s is not None:
        s.timestamps_unix_nano.extend([draw(uint64s)] * draw(st.integers(1, 5000)))


_PERTURB = [_p_index, _p_amplify, _p_links, _p_tables, _p_stamps]


@st.composite
def mutated(draw: Any, message: st.SearchStrategy[Any]) -> bytes:
    """A valid encoding with a few bytes flipped, cut or spliced."""
    data = bytearray(draw(message).SerializeToString())
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "cut", "insert", "surrogate"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(max_size=8))
        else:
            data[i:i] = b"\xed\xa0\x80"  # a UTF-8-encoded lone surrogate
    return bytes(data)


LABEL_KEYS = ["span_id", "profile_id", "span id", "local root span id", "trace_id",
              "thread_id", "thread id", "thread.id", "thread_name", "span_name", "other"]


@st.composite
def pprofs(draw: Any) -> Any:
    p = Profile()
    strings = ["", *LABEL_KEYS, "cpu", "nanoseconds", "samples", "count", "wall",
               "alloc_space", "bytes", "seconds"] + draw(st.lists(texts, max_size=6))
    p.string_table.extend(strings)
    n_str = len(strings)
    sidx = st.one_of(st.integers(0, n_str - 1), st.integers(0, n_str - 1), int64s)
    for _ in range(draw(st.integers(0, 3))):
        p.sample_type.add(type=draw(sidx), unit=draw(sidx))
    if draw(st.booleans()):
        p.period_type.type, p.period_type.unit = draw(sidx), draw(sidx)
    p.period = draw(int64s)
    n_fn = draw(st.integers(0, 5))
    dense = draw(st.booleans())
    for i in range(n_fn):
        p.function.add(id=i + 1 if dense else draw(uint64s), name=draw(sidx),
                       filename=draw(sidx))
    fid = st.one_of(st.integers(0, n_fn + 1), uint64s)
    n_loc = draw(st.integers(0, 5))
    for i in range(n_loc):
        loc = p.location.add(id=i + 1 if dense else draw(uint64s), address=draw(uint64s))
        for _ in range(draw(st.one_of(st.integers(0, 3), st.just(2000)))):
            loc.line.add(function_id=draw(fid), line=draw(int64s))
    lid = st.one_of(st.integers(1, max(1, n_loc)), uint64s)
    n_types = len(p.sample_type)
    for _ in range(draw(st.integers(0, 6))):
        smp = p.sample.add()
        if draw(st.integers(0, 9)) == 0:
            smp.location_id.extend([draw(lid)] * draw(st.integers(1, 20_000)))
        else:
            smp.location_id.extend(draw(st.lists(lid, max_size=6)))
        smp.value.extend(draw(st.lists(int64s, min_size=max(0, n_types - 1),
                                       max_size=n_types + 1)))
        for _ in range(draw(st.integers(0, 3))):
            smp.label.add(key=draw(st.one_of(st.integers(1, len(LABEL_KEYS)), sidx)),
                          str=draw(st.one_of(st.just(0), sidx)), num=draw(int64s))
    p.time_nanos = draw(st.one_of(st.just(0), int64s))
    return p


pprof_bytes = st.one_of(st.builds(lambda p: p.SerializeToString(), pprofs()),
                        st.builds(lambda p: gzip.compress(p.SerializeToString(), 1), pprofs()),
                        mutated(pprofs()), st.binary(max_size=64))


@st.composite
def push_requests(draw: Any) -> bytes:
    req = PushRequest()
    for _ in range(draw(st.integers(0, 3))):
        series = req.series.add()
        for _ in range(draw(st.integers(0, 2))):
            series.labels.add(name=draw(st.sampled_from(["service_name", "x"])),
                              value=draw(texts))
        for _ in range(draw(st.integers(0, 2))):
            series.samples.add(raw_profile=draw(pprof_bytes))
    return req.SerializeToString()


def _hexify(node: Any) -> Any:
    """protobuf's JSON (base64 ids) -> OTLP JSON (hex ids)."""
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex()
                    if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
                    else _hexify(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_hexify(v) for v in node]
    return node


@st.composite
def otlp_json(draw: Any, message: st.SearchStrategy[Any]) -> bytes:
    """OTLP/JSON of a hostile message, then with lone surrogates, deep nesting or junk."""
    doc = _hexify(json_format.MessageToDict(draw(message)))
    how = draw(st.sampled_from(["as is", "surrogate key", "surrogate value", "deep", "junk"]))
    if how == "surrogate key":
        doc[draw(wild_texts)] = 1
    elif how == "surrogate value" and doc:
        doc[draw(st.sampled_from(sorted(doc)))] = draw(wild_texts)
    elif how == "deep":
        node: Any = {}
        doc["resourceSpans" if draw(st.booleans()) else "x"] = [node]
        for _ in range(draw(st.integers(1, 5000))):
            node["resource"] = {}
            node = node["resource"]
    elif how == "junk":
        return draw(st.binary(max_size=64))
    try:
        return json.dumps(doc).encode()
    except RecursionError:
        return b"[" * 100_000


# ---- the legacy /ingest endpoint's bodies: folded text, pprof, forms -------------------

FRAME_NAMES = st.one_of(st.sampled_from(["main", "a.b", "std::vector<int>::push", "x y", "²",
                                         "", "f" * 300, "\t", "é"]), wild_texts)
COUNTS = st.one_of(st.integers(0, 10**6).map(str), st.sampled_from(
    ["", "-1", "٣", "1e3", "0x10", "4294967295", "4294967296", "9" * 30, "9" * 5000]))


@st.composite
def folded_texts(draw: Any) -> bytes:
    """Folded lines ``a;b;c 12``, hostile ones among them (empty frames, huge counts,
    lone surrogates, deep stacks, control bytes)."""
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 19)) == 0:
            frames = ["f"] * draw(st.integers(1, 20_000))
        else:
            frames = draw(st.lists(FRAME_NAMES, max_size=5))
        sep = draw(st.sampled_from([" ", " ", "\t", "  ", ""]))
        lines.append(";".join(frames) + sep + draw(COUNTS))
    text: str = draw(st.sampled_from(["\n", "\r\n", "\n\n"])).join(lines)
    if draw(st.integers(0, 9)) == 0:
        text += draw(st.sampled_from(["\x00", "\x1b[31m", "\x7f"]))
    return text.encode("utf-8", "surrogatepass")


@st.composite
def ingest_forms(draw: Any) -> bytes:
    """A multipart form as pyroscope-go writes it (boundary ``xyz``): profile, maybe
    prev_profile and sample_type_config (``cumulative`` flags included)."""
    config = draw(st.one_of(st.just(b""), st.builds(
        lambda d: json.dumps(d).encode(), st.dictionaries(
            st.sampled_from(["alloc_space", "inuse_space", "cpu", "samples", "delay"]),
            st.fixed_dictionaries({}, optional={
                "cumulative": st.one_of(st.booleans(), texts), "units": st.sampled_from(
                    ["samples", "bytes"]), "display-name": texts}), max_size=3))))
    parts = [("profile", draw(pprof_bytes)),
             ("prev_profile", draw(st.one_of(st.just(b""), pprof_bytes))),
             ("sample_type_config", config)]
    return b"".join(f'--xyz\r\nContent-Disposition: form-data; name="{name}"; '
                    f'filename="f"\r\n\r\n'.encode() + data + b"\r\n"
                    for name, data in parts if data) + b"--xyz--\r\n"


ingest_bodies = st.one_of(folded_texts(), folded_texts().map(gzip.compress), pprof_bytes,
                          st.binary(max_size=100))

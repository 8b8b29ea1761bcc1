"""Every decoder, fed random bytes and hostile messages: it refuses (``InvalidData``, or
``TooLarge``), or what it returns can be stored (``storable.py``). Never anything else.

Counted in ``support.INPUTS``; ``make fuzz`` runs the long profile."""

from __future__ import annotations

import gzip
from typing import Any

from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.errors import InvalidData
from pipeline.otlp import jsonwire
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.split import split_profiles, split_traces
from pipeline.otlp.traces import decode_traces
from pipeline.pyroscope import ingest, pprof
from pipeline.receivers import pyroscope
from tests.fuzz import strategies as S
from tests.fuzz.storable import storable
from tests.fuzz.support import FUZZ, count

SMALL = pprof.Limits(max_samples=100_000, max_stack_depth=4096, max_table_entries=10_000,
                     max_labels=16)
CFG = pyroscope.Config(max_decompressed_bytes=4 << 20, max_samples_per_request=100_000,
                       max_stack_depth=4096, max_table_entries=10_000, max_labels=16)


def _note(text: str) -> None:
    """A hypothesis statistics event; a no-op in the mutation loop (test_mutations.py)."""
    try:
        event(text)
    except InvalidArgument:
        pass


def _traces(req: ExportTraceServiceRequest) -> None:
    dec = decode_traces(req)
    _note(f"spans accepted: {min(len(dec.batch), 3)}, rejected: {min(dec.rejected, 3)}")
    assert storable(dec.batch) == [], dec
    total = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    assert len(dec.batch) + dec.rejected == total
    assert bool(dec.rejected) == bool(dec.message)
    split_traces(req, dec.batch.sources[0][1])  # the Kafka exporter's re-encoding


def _profiles(req: ExportProfilesServiceRequest) -> None:
    dec = decode_profiles(req)
    _note(f"samples accepted: {min(len(dec.batch), 3)}, profiles rejected: "
          f"{min(dec.rejected, 3)}")
    assert storable(dec.batch) == [], storable(dec.batch)
    assert bool(dec.rejected) == bool(dec.message)
    lean = decode_profiles(req, records=False)  # a gateway's: the checks, no records
    assert (len(lean.batch), lean.rejected, lean.message, lean.batch.samples) == (
        len(dec.batch), dec.rejected, dec.message, [])
    assert lean.batch.sources[0][1] == dec.batch.sources[0][1]
    for part in split_profiles(req, dec.batch.sources[0][1]).values():
        again = decode_profiles(part)  # what a correlator decodes from Kafka
        assert again.rejected == 0, again.message


def _refused_or(fn: Any, *args: Any) -> Any:
    try:
        got = fn(*args)
    except InvalidData as err:
        _note(f"refused: {type(err).__name__}")
        return None
    _note("accepted")
    return got


class TestOtlpTraces:
    @FUZZ
    @given(st.one_of(S.mutated(S.trace_requests()), st.binary(max_size=200)))
    def test_proto_bytes(self, data: bytes) -> None:
        """Random and mutated protobuf: a parse error, or storable spans."""
        count("otlp_traces_proto")
        try:
            req = ExportTraceServiceRequest.FromString(data)
        except Exception as err:  # the receivers map DecodeError to 400
            assert type(err).__name__ == "DecodeError", err
            return
        _traces(req)

    @FUZZ
    @given(st.one_of(S.trace_requests(), S.trace_requests(tame=True)))
    def test_structured(self, req: ExportTraceServiceRequest) -> None:
        """Extreme times and id lengths: each span refused or storable."""
        count("otlp_traces_structured")
        _traces(req)

    @FUZZ
    @given(S.otlp_json(S.trace_requests()))
    def test_json(self, body: bytes) -> None:
        """OTLP/JSON with lone surrogates, deep nesting, junk: InvalidData or storable."""
        count("otlp_traces_json")
        req = _refused_or(jsonwire.parse_request, body, ExportTraceServiceRequest)
        if req is not None:
            _traces(req)


class TestOtlpProfiles:
    @FUZZ
    @given(st.one_of(S.mutated(S.profile_requests()), st.binary(max_size=200)))
    def test_proto_bytes(self, data: bytes) -> None:
        """Random and mutated protobuf: a parse error, or storable samples."""
        count("otlp_profiles_proto")
        try:
            req = ExportProfilesServiceRequest.FromString(data)
        except Exception as err:
            assert type(err).__name__ == "DecodeError", err
            return
        _profiles(req)

    @FUZZ
    @given(st.one_of(S.profile_requests(), S.profile_requests(tame=True)))
    def test_structured(self, req: ExportProfilesServiceRequest) -> None:
        """Indices out of range, extreme values, amplifying stacks: refused or storable,
        and an accepted request splits for Kafka and decodes again without rejections."""
        count("otlp_profiles_structured")
        _profiles(req)

    @FUZZ
    @given(S.otlp_json(S.profile_requests()))
    def test_json(self, body: bytes) -> None:
        count("otlp_profiles_json")
        req = _refused_or(jsonwire.parse_request, body, ExportProfilesServiceRequest)
        if req is not None:
            _profiles(req)


class TestPprof:
    @FUZZ
    @given(S.pprof_bytes)
    def test_raw_and_gzipped(self, data: bytes) -> None:
        """Raw, gzipped, mutated pprof and random bytes: InvalidData or storable."""
        count("pprof")
        batch = _refused_or(pprof.decode_pprof, data, "svc", 1 << 20, None, SMALL)
        if batch is not None:
            assert storable(batch) == []

    @FUZZ
    @given(S.pprofs(), st.dictionaries(S.texts, st.one_of(
        st.fixed_dictionaries({}, optional={"display-name": S.texts,
                                            "units": st.sampled_from(["samples", "x"])}),
        S.texts), max_size=3))
    def test_sample_type_config_applied(self, p: Any, config: dict[str, Any]) -> None:
        """Any sample_type_config over any profile: InvalidData or storable."""
        count("pprof_sample_type_config")
        batch = _refused_or(pprof.decode_pprof, gzip.compress(p.SerializeToString(), 1),
                            "svc", 1 << 20, config, SMALL)
        if batch is not None:
            assert storable(batch) == []


class TestPyroscopeReceiver:

    @FUZZ
    @given(st.one_of(S.push_requests(), st.binary(max_size=200)))
    def test_push(self, body: bytes) -> None:
        """A PushRequest of hostile series: InvalidData, or every batch storable."""
        count("pyroscope_push")
        batches = _refused_or(pyroscope.decode_push, body, CFG)
        for b in batches or []:
            assert storable(b) == []

    @FUZZ
    @given(S.wild_texts, st.lists(st.tuples(S.wild_texts, S.wild_texts), max_size=3))
    def test_ingest_name(self, app: str, labels: list[tuple[str, str]]) -> None:
        """The legacy ?name=APP{k=v}: a storable service name, or InvalidData."""
        count("ingest_name")
        name = app + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"
        for text in (app, name):
            got = _refused_or(pyroscope.parse_name, text)
            if got is not None:
                got[0].encode()

    @FUZZ
    @given(st.one_of(st.binary(max_size=100), st.builds(
        lambda d, n: (b"[" * n + b"1" + b"]" * n) if n > 100 else
        (__import__("json").dumps(d).encode()),
        st.dictionaries(S.wild_texts, st.one_of(S.wild_texts, st.dictionaries(
            S.wild_texts, S.wild_texts, max_size=2)), max_size=3),
        st.one_of(st.just(0), st.integers(50, 100_000)))))
    def test_sample_type_config(self, body: bytes) -> None:
        """Deep nesting, lone surrogates, junk: a dict of valid strings, or InvalidData."""
        count("sample_type_config")
        doc = _refused_or(pyroscope.parse_sample_type_config, body)
        if doc is not None:
            __import__("json").dumps(doc).encode()  # every string encodes as UTF-8


QUERIES = st.fixed_dictionaries({"name": st.sampled_from(["svc", "svc.cpu", "svc.wall{a=b}",
                                                          "svc.alloc_space", ""])},
                                optional={
    "format": st.sampled_from(["", "pprof", "folded", "groups", "lines", "jfr", "x", "\x00"]),
    "from": st.one_of(st.integers(0, 2**70).map(str), S.texts),
    "units": st.sampled_from(["", "samples", "objects", "bytes", "²"]),
    "sampleRate": st.one_of(st.integers(-5, 2**40).map(str), S.texts)})


class TestIngest:
    @FUZZ
    @given(QUERIES, S.ingest_bodies)
    def test_detected_or_named_formats(self, query: dict[str, str], body: bytes) -> None:
        """/ingest bodies (folded text, pprof, gzip of either, junk) under any format, time
        and units: InvalidData, or storable."""
        count("ingest_body")
        got = _refused_or(ingest.decode_ingest, query, "", body, 1 << 20, SMALL)
        if got is not None:
            assert storable(got.batch) == []

    @FUZZ
    @given(QUERIES, S.ingest_forms())
    def test_forms_with_prev_profile(self, query: dict[str, str], body: bytes) -> None:
        """The Go SDK's form, with prev_profile and cumulative flags: refused or storable
        (a delta never leaves a value below zero: storable says so)."""
        count("ingest_form")
        got = _refused_or(ingest.decode_ingest, query, "multipart/form-data; boundary=xyz",
                          body, 1 << 20, SMALL)
        if got is not None:
            assert storable(got.batch) == []
            assert all(s.value > 0 for s in got.batch.samples)

    @FUZZ
    @given(st.lists(st.tuples(st.lists(st.sampled_from(["main", "a", "b::c", "d e", "é"]),
                                       min_size=1, max_size=6),
                              st.integers(0, 50_000)), max_size=20),
           st.sampled_from([97, 100, 1000]))  # within the per-sample bound (2^44 ns)
    def test_folded_cpu_is_conserved(self, lines: list[tuple[list[str], int]],
                                     rate: int) -> None:
        """Valid folded text: the CPU decoded is the sum of the counts times the period,
        one record per distinct stack, leaf first."""
        count("folded_conserved")
        body = "\n".join(";".join(frames) + f" {n}" for frames, n in lines).encode()
        got = ingest.decode_ingest({"name": "svc", "sampleRate": str(rate)}, "", body,
                                   1 << 20, SMALL).batch
        period = 1_000_000_000 // rate
        assert sum(s.value for s in got.samples) == period * sum(n for _, n in lines)
        want = {tuple(reversed(f)) for f, n in lines if n}
        assert {tuple(got.stacks[s.stack_id].functions) for s in got.samples} == want

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
from pipeline.pyroscope import pprof
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

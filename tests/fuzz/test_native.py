"""pipeline/native (the gateway's trace path in Rust) against the Python path it stands in
for, on the same bytes: whatever the library takes, the Python path takes with the same
span count and nothing refused, and the library's split is the Python split byte for byte
(message keys, their order, every message); the same for the profile split
(``profiles_agree``). The library may hand any request back (None):
the receiver then parses it in Python; ``test_usual_requests_are_taken`` holds it to
taking the usual ones. test_mutations.py runs ``native_agrees`` on byte mutants."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline import native
from pipeline.errors import InvalidData
from pipeline.kafka.buckets import Buckets
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.otlp.wire import split_trace_bytes
from pipeline.otlp.wire_profiles import split_profile_bytes
from pipeline.receivers.otlp_request import take_request
from tests.fuzz import strategies as S
from tests.fuzz.support import FUZZ, count

# (partitioner, partitions): a message per trace, and the exporter's partitioners
KEYINGS: list[tuple[str | None, int]] = [(None, 0), ("sarama_compat", 3), ("murmur2", 2),
                                         ("sarama_compat", 64), ("murmur2", 1)]


def _note(text: str) -> None:
    try:
        event(text)
    except InvalidArgument:  # outside hypothesis (the mutation loop)
        pass


def native_agrees(data: bytes) -> None:
    """The property, for any bytes."""
    assert native.AVAILABLE, "the native library is not built (pip install: cargo)"
    n = native.traces_check(data)
    try:
        req = ExportTraceServiceRequest.FromString(data)
    except DecodeError:
        assert n is None, f"native took {n} spans of bytes upb refuses"
        _note("upb refuses")
        return
    py = decode_traces(req, records=False, wire=data)
    _note(f"native {'takes' if n is not None else 'hands back'}, python refuses "
          f"{min(py.rejected, 1)}")
    split_keeps_every_span(req, py.batch.sources[0])
    if n is not None:
        assert (py.rejected, len(py.batch)) == (0, n), (py.rejected, py.message, n)
    if py.rejected:
        return  # the exporter splits these in Python (it must leave the refused out)
    for partitioner, partitions in KEYINGS:
        got = native.traces_split(data, partitioner, partitions)
        if got is None:
            assert n is None, "a request the check takes must split natively"
            continue
        bucket = Buckets(partitioner, partitions) if partitioner else None  # type: ignore[arg-type]
        want = split_trace_bytes(data, (), bucket)
        assert list(got.items()) == list(want.items()), (partitioner, partitions)


def split_keeps_every_span(req: ExportTraceServiceRequest, source: Any) -> None:
    """The exporter's Python split of what the receiver's parse accepted (``source``: the
    bytes with the parse's trace ids, and the refused spans): every accepted span, as upb
    reads it, in exactly one message, under its own trace's key (or a key of its
    partition); with the parse's trace ids and with each span walked for its own."""
    (data, tids), rejected = source
    skip = set(rejected)
    want = sorted(sp.SerializeToString() for ri, rs in enumerate(req.resource_spans)
                  for si, ss in enumerate(rs.scope_spans) for pi, sp in enumerate(ss.spans)
                  if (ri, si, pi) not in skip)
    for partitioner, partitions in KEYINGS[:2]:
        bucket = Buckets(partitioner, partitions) if partitioner else None  # type: ignore[arg-type]
        for ids in (tids, None):
            got = []
            for key, msg in split_trace_bytes(data, rejected, bucket, ids).items():
                for rs in ExportTraceServiceRequest.FromString(msg).resource_spans:
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            got.append(sp.SerializeToString())
                            tid = sp.trace_id.hex()
                            assert (bucket(tid) == bucket(key) if bucket else tid == key), \
                                (key, tid)
            assert sorted(got) == want, (partitioner, ids is None)


def _encoded(req: Any) -> bytes:
    return bytes(req.SerializeToString())


@FUZZ
@given(st.one_of(S.trace_requests(tame=True).map(_encoded), S.trace_requests().map(_encoded),
                 S.mutated(S.trace_requests(tame=True)), S.mutated(S.trace_requests()),
                 st.binary(max_size=200)))
def test_native_agrees_with_python(data: bytes) -> None:
    count("otlp_traces_native")
    native_agrees(data)


def profiles_agree(data: bytes) -> None:
    """The profile path's property, for any bytes: the gateway's checks give the same
    answer with the samples read natively; on a request they accept whole, the library's
    parts are ``split_profile_bytes``'s (or both compact, or the library hands it back)."""
    try:
        req = ExportProfilesServiceRequest.FromString(data)
    except DecodeError:
        return
    dec = decode_profiles(req, records=False)
    # the gateway's checks with the samples read natively: the same answer
    cols = decode_profiles(ExportProfilesServiceRequest.FromString(data), records=False,
                           wire=data)
    assert (len(cols.batch), cols.rejected, cols.message, cols.batch.sources[0][1]) == (
        len(dec.batch), dec.rejected, dec.message, dec.batch.sources[0][1])
    if dec.rejected:
        _note("profiles: python refuses")
        return
    wire = req.SerializeToString()
    for partitioner, partitions in KEYINGS[1:]:
        got = native.profiles_split(wire, partitioner, partitions)
        try:
            want = split_profile_bytes(req, (), Buckets(partitioner, partitions))  # type: ignore[arg-type]
        except ValueError:
            assert got is None
            continue
        _note(f"profiles: native {'hands back' if got is None else 'splits'}")
        if got == native.COMPACT:
            assert want is None
        elif got is not None:
            assert want is not None and list(got.items()) == list(want.items()), partitioner


@FUZZ
@given(st.one_of(S.profile_requests(tame=True).map(_encoded),
                 S.profile_requests().map(_encoded), S.mutated(S.profile_requests(tame=True))))
def test_native_profile_split_agrees_with_python(data: bytes) -> None:
    count("otlp_profiles_native")
    profiles_agree(data)


def intake_agrees(signal: str, data: bytes) -> None:
    """The ``otlp`` receiver's intake (pipeline/receivers/intake.py) answers after a
    gateway's check of the bytes (natively where it can) and decodes into records behind:
    both must refuse the same items with the same message, or the request alike."""
    req_type, decode = ((ExportTraceServiceRequest, decode_traces) if signal == "traces"
                        else (ExportProfilesServiceRequest, decode_profiles))
    got = []
    for records in (False, True):
        try:
            d = take_request(signal, data, records=records, parse=req_type.FromString,
                             decode=decode, wire=data, limit=0, key="")
            got.append((len(d.batch), d.rejected, d.message))
        except (DecodeError, InvalidData) as err:
            got.append((type(err).__name__,))
    _note(f"intake {signal}: {'refused' if len(got[0]) == 1 else 'checked'}")
    assert got[0] == got[1], got


@FUZZ
@given(st.one_of(S.trace_requests(tame=True).map(_encoded), S.trace_requests().map(_encoded),
                 S.mutated(S.trace_requests(tame=True)), st.binary(max_size=200)))
def test_intake_check_agrees_with_decoding_traces(data: bytes) -> None:
    count("otlp_traces_intake")
    intake_agrees("traces", data)


@FUZZ
@given(st.one_of(S.profile_requests(tame=True).map(_encoded),
                 S.profile_requests().map(_encoded), S.mutated(S.profile_requests(tame=True))))
def test_intake_check_agrees_with_decoding_profiles(data: bytes) -> None:
    count("otlp_profiles_intake")
    intake_agrees("profiles", data)

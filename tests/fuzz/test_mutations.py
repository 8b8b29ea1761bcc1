"""Fast in-process mutation fuzzing: the volume behind ``make fuzz``'s million inputs.

Hypothesis (test_decoders.py) explores structure; this loop explores bytes, many times
faster: a corpus of valid encodings (drawn once from the hypothesis strategies) is mutated
with byte flips, extreme varints, repeated slices (the amplification shapes), truncation,
splices and UTF-8-encoded lone surrogates, and every mutant goes through the same property:
refused with ``InvalidData``, or storable. A failure names the seed and the mutant's bytes.

``SPANPROF_FUZZ_MUTATIONS`` sets the mutants per decoder (default 600; ``make fuzz``: 120000),
``SPANPROF_FUZZ_SEED`` the seed (default: random, printed on failure).
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis.errors import NonInteractiveExampleWarning
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.errors import InvalidData
from pipeline.otlp import jsonwire
from pipeline.pyroscope import ingest, pprof
from pipeline.receivers import pyroscope
from tests.fuzz import strategies as S
from tests.fuzz.storable import storable
from tests.fuzz.support import PROFILE, byte_mutator, run_mutants
from tests.fuzz.test_decoders import CFG, SMALL, _profiles, _traces
from tests.fuzz.test_native import native_agrees, profiles_agree

MUTANTS = int(os.environ.get("SPANPROF_FUZZ_MUTATIONS",
                             120_000 if PROFILE == "fuzz" else 600))
CORPUS = 40 if PROFILE == "fuzz" else 12
MAX_INPUT = 256 << 10
VARINTS = [b"\xff" * 9 + b"\x01", b"\x80" * 9 + b"\x01", b"\xff\xff\xff\xff\x0f", b"\x00"]


# VARINTS at any place; then bad UTF-8, lone surrogates (raw and escaped), deep nesting
_mutate = byte_mutator(VARINTS, odd=[b"\xed\xa0\x80", b"\\ud800", b"\xff", b"[" * 200,
                                     b"\xc2\xb2"], cap=MAX_INPUT)


def _examples(strategy: Any, n: int) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return [strategy.example() for _ in range(n)]


def _proto(kind: Any, check: Callable[[Any], None]) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        try:
            req = kind.FromString(data)
        except DecodeError:
            return
        check(req)
    return run


def _json(kind: Any, check: Callable[[Any], None]) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        try:
            req = jsonwire.parse_request(data, kind)
        except InvalidData:
            return
        check(req)
    return run


def _refused_or_storable(fn: Callable[[bytes], Any]) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        try:
            got = fn(data)
        except InvalidData:
            return
        for b in got if isinstance(got, list) else [got]:
            assert storable(b) == []
    return run


def _name(data: bytes) -> list[Any]:
    # undecodable bytes become lone surrogates, as a lenient URL decoder may leave them
    service, labels, kind = pyroscope.parse_name(data.decode("utf-8", "surrogateescape"))
    service.encode()
    return []


def _ingest(content_type: str) -> Callable[[bytes], None]:
    """/ingest without a format (the Go SDK's way): the body's format detected."""
    return _refused_or_storable(lambda d: ingest.decode_ingest(
        {"name": "svc", "from": "1700000000000000000"}, content_type, d, 1 << 20,
        SMALL).batch)


def _config(data: bytes) -> list[Any]:
    json.dumps(pyroscope.parse_sample_type_config(data)).encode()
    return []


DECODERS: dict[str, tuple[Callable[[], list[bytes]], Callable[[bytes], None]]] = {
    "otlp_traces_proto": (lambda: [m.SerializeToString() for m in
                                   _examples(S.trace_requests(), CORPUS)],
                          _proto(ExportTraceServiceRequest, _traces)),
    # the native trace path against the Python one (tame: most spans pass, so the
    # library takes most unmutated requests and the mutants start near them)
    "otlp_traces_native": (lambda: [m.SerializeToString() for m in
                                    _examples(S.trace_requests(tame=True), CORPUS)],
                           native_agrees),
    "otlp_profiles_native": (lambda: [m.SerializeToString() for m in
                                      _examples(S.profile_requests(tame=True), CORPUS)],
                             profiles_agree),
    "otlp_profiles_proto": (lambda: [m.SerializeToString() for m in
                                     _examples(S.profile_requests(), CORPUS)],
                            _proto(ExportProfilesServiceRequest, _profiles)),
    "otlp_traces_json": (lambda: _examples(S.otlp_json(S.trace_requests()), CORPUS),
                         _json(ExportTraceServiceRequest, _traces)),
    "otlp_profiles_json": (lambda: _examples(S.otlp_json(S.profile_requests()), CORPUS),
                           _json(ExportProfilesServiceRequest, _profiles)),
    "pprof": (lambda: [p.SerializeToString() for p in _examples(S.pprofs(), CORPUS)],
              _refused_or_storable(lambda d: pprof.decode_pprof(d, "svc", 1 << 20, None,
                                                                 SMALL))),
    "pprof_gzip": (lambda: [p.SerializeToString() for p in _examples(S.pprofs(), CORPUS)],
                   _refused_or_storable(lambda d: pprof.decode_pprof(
                       gzip.compress(d, 1), "svc", 1 << 20, None, SMALL))),
    "pyroscope_push": (lambda: _examples(S.push_requests(), CORPUS),
                       _refused_or_storable(lambda d: pyroscope.decode_push(d, CFG))),
    "ingest_detect": (lambda: _examples(S.ingest_bodies, CORPUS) + [b"a;b;c 12\na;d 3"],
                      _ingest("")),
    "ingest_form": (lambda: _examples(S.ingest_forms(), CORPUS),
                    _ingest("multipart/form-data; boundary=xyz")),
    "ingest_name": (lambda: [b"app.cpu{service_name=x,env=prod}", b"\xc2\xb2{a=b}", b"!"],
                    _refused_or_storable(_name)),
    "sample_type_config": (lambda: [b'{"itimer": {"units": "samples", "display-name": "cpu"}}',
                                    b'{"a": [1, {"b": "\\u00b2"}]}'],
                           _refused_or_storable(_config)),
}


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_mutants_refused_or_storable(decoder: str) -> None:
    """Every mutant of a valid input: InvalidData, or storable output. Nothing else."""
    make_corpus, run = DECODERS[decoder]
    corpus = [c for c in make_corpus() if c] or [b"\x00"]
    run_mutants(decoder, corpus, _mutate, run, MUTANTS)

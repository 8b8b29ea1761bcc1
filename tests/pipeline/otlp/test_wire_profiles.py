"""pipeline/otlp/wire_profiles.py: splitting a profile request on its bytes puts the same
samples under the same keys as splitting the parsed request (``split.split_profiles``):
a correlator decodes the same records from either message, and never refuses one."""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)

from pipeline.otlp import profiles
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.split import split_profiles
from pipeline.otlp.wire_profiles import split_profile_bytes
from tests.fuzz import strategies as S


def _bucket(key: str) -> int:
    return int(key[:2], 16) % 3


def _decoded(data: bytes | ExportProfilesServiceRequest) -> tuple[list[Any], dict[int, Any]]:
    req = ExportProfilesServiceRequest.FromString(data) if isinstance(data, bytes) else data
    # a profile without a time is taken as "now": the same now for both
    with mock.patch.object(profiles.time, "time_ns", return_value=1_750_000_000 * 10**9):
        dec = decode_profiles(req)
    assert dec.rejected == 0, dec.message  # what the gateway let through decodes again
    return dec.batch.samples, dec.batch.stacks


def _same_parts(req: ExportProfilesServiceRequest) -> int:
    """Both splits of the profiles ``req``'s decoder accepts, compared key by key; the
    number of samples compared."""
    rejected = decode_profiles(req).batch.sources[0][1]
    got = split_profile_bytes(req, rejected, _bucket)
    want = split_profiles(req, rejected, bucket_of=_bucket)
    if got is None:  # the dictionary's copies would outweigh the request: the caller compacts
        return 0
    assert got.keys() == want.keys()
    n = 0
    for key, data in got.items():
        samples, stacks = _decoded(data)
        assert (samples, stacks) == _decoded(want[key]), key
        n += len(samples)
    return n


@settings(max_examples=300, deadline=None)
@given(req=st.one_of(S.profile_requests(tame=True), S.profile_requests()))
def test_same_samples_as_the_parsed_split(req: ExportProfilesServiceRequest) -> None:
    _same_parts(req)


TRACES = [bytes([i + 1]) * 16 for i in range(8)]


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 7), st.integers(0, 3)),
                      min_size=1, max_size=60),
       drop=st.sets(st.integers(0, 6)))
def test_many_profiles_interleaved_traces_and_rejected_profiles(
        shape: list[tuple[int, int, int]], drop: set[int]) -> None:
    """Samples of several services (resources), sample types (profiles) and traces, one
    after the other in any order, unlinked ones (-1) among them; some profiles refused."""
    b = ProfileBuilder()
    kinds = [("cpu", "nanoseconds", "cpu", "nanoseconds"),
             ("wall", "nanoseconds", "wall", "nanoseconds"),
             ("samples", "count", "cpu", "nanoseconds")]
    for i, (svc, trace, kind) in enumerate(shape):
        st_, unit, pt, pu = kinds[kind % 3]
        b.sample([f"f{i % 5}", f"g{kind}", "main"], 10 + i,
                 TRACES[trace] if trace >= 0 else b"", bytes([i + 1]) * 8 if trace >= 0 else b"",
                 service=f"svc{svc}", sample_type=st_, unit=unit, period_type=pt,
                 period_unit=pu, period=10_000_000, time_unix_nano=1_700_000_000 * 10**9)
    req = b.build()
    paths = [(ri, si, pi) for ri, rp in enumerate(req.resource_profiles)
             for si, sp in enumerate(rp.scope_profiles) for pi in range(len(sp.profiles))]
    rejected = [p for i, p in enumerate(paths) if i in drop]
    got = split_profile_bytes(req, rejected, _bucket)
    want = split_profiles(req, rejected, bucket_of=_bucket)
    assert got is not None and got.keys() == want.keys()
    for key in got:
        assert _decoded(got[key]) == _decoded(want[key])
    kept = sum(len(p.samples) for i, p in enumerate(
        req.resource_profiles[ri].scope_profiles[si].profiles[pi] for ri, si, pi in paths)
        if i not in drop)
    assert sum(len(_decoded(d)[0]) for d in got.values()) == kept


def test_samples_keep_their_order_and_runs_stay_whole() -> None:
    """A trace's samples in request order, one message per partition: the three traces
    of one bucket share a message and each keeps its samples' order."""
    b = ProfileBuilder()
    order = [0, 0, 1, 3, 1, 0, 6, 3, 3]
    for n, t in enumerate(order):
        b.sample(["leaf", "main"], n + 1, TRACES[t], bytes([n + 1]) * 8,
                 time_unix_nano=1_700_000_000 * 10**9)
    req = b.build()
    got = split_profile_bytes(req, (), _bucket)
    assert got is not None
    values = {key: [s.value for s in _decoded(data)[0]] for key, data in got.items()}
    by_bucket: dict[int, list[int]] = {}
    for n, t in enumerate(order):
        by_bucket.setdefault(_bucket(TRACES[t].hex()), []).append(n + 1)
    assert sorted(values.values()) == sorted(by_bucket.values())


def test_no_bucket_or_a_dictionary_that_outweighs_the_request_is_left_to_compaction() -> None:
    """Without a partition count a part per trace would each carry the dictionary; a
    dictionary bigger than the samples repeated in many parts likewise: ``None``, the
    caller compacts."""
    b = ProfileBuilder()
    for t in range(8):
        b.sample([f"frame_{t}_{i}" * 20 for i in range(50)], 1, TRACES[t], bytes([t + 1]) * 8,
                 time_unix_nano=1_700_000_000 * 10**9)
    req = b.build()
    assert split_profile_bytes(req, (), None) is None
    assert split_profile_bytes(req, (), lambda key: key) is None  # 8 parts, big dictionary
    assert split_profile_bytes(req, (), lambda key: 0) is not None  # one part


def test_many_parts_of_a_long_link_table_are_left_to_compaction() -> None:
    """Each part keeps every link index below its last (empty entries, 2 bytes each): a
    long link table spread over many partitions would repeat it per part, so that request
    is compacted instead; over two partitions it is not."""
    b = ProfileBuilder()
    for i in range(40_000):  # a sample per trace, tiny stacks: the links are the request
        b.sample(["f"], 1, i.to_bytes(16, "big"), (i + 1).to_bytes(8, "big"),
                 time_unix_nano=1_700_000_000 * 10**9)
    req = b.build()
    assert split_profile_bytes(req, (), lambda key: int(key[-4:], 16) % 64) is None
    assert split_profile_bytes(req, (), lambda key: int(key[-4:], 16) % 2) is not None


def test_scalars_under_message_numbers_are_not_cut_as_messages() -> None:
    """upb keeps a varint under a message's field number as an unknown field and writes it
    back: the splitter must not take it for a resource (it raised IndexError before)."""
    b = ProfileBuilder()
    b.sample(["main", "work"], 10_000_000, b"\x01" * 16, b"\x02" * 8, service="svc")
    req = ExportProfilesServiceRequest.FromString(b.build().SerializeToString() + b"\x08\x07")
    assert req.resource_profiles and decode_profiles(req).rejected == 0
    assert _same_parts(req) == 1

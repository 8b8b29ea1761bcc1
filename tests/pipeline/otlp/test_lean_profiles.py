"""A gateway's profile checks (``decode_profiles(records=False)``) take the usual profile
(one value a sample, no timestamps, no attributes) column by column: they count the same
records and refuse the same profiles, with the same words, as the per-sample decoder,
whatever is wrong and wherever (the hostile requests of tests/fuzz seldom have that shape,
so it is generated here)."""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.otlp import profiles
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from tests.fuzz import strategies as S

values = st.one_of(st.integers(0, 10**9), st.integers(-(2**63), 2**63 - 1),
                   st.sampled_from([0, -1, 2**44, 2**44 + 1, 2**32, 2**63 - 1]))


@st.composite
def usual_profiles(draw: Any) -> Any:
    b = ProfileBuilder()
    for _ in range(draw(st.integers(1, 12))):
        st_, unit, pt, pu = draw(st.sampled_from(S.SAMPLE_KINDS))
        b.sample(draw(st.lists(st.sampled_from(S.FRAMES), max_size=4)), draw(values),
                 draw(st.sampled_from([b"", bytes(16), b"\x01" * 16, b"\x02" * 16])),
                 draw(st.sampled_from([b"", bytes(8), b"\x03" * 8, b"\x04" * 8])),
                 sample_type=st_, unit=unit, period_type=pt, period_unit=pu,
                 period=draw(st.integers(1, 10**8)), time_unix_nano=1_750_000_000 * 10**9,
                 service=draw(st.sampled_from(["a", "b"])), lines=None)
    req = b.build()
    samples = [s for rp in req.resource_profiles for sp in rp.scope_profiles
               for p in sp.profiles for s in p.samples]
    for _ in range(draw(st.integers(0, 2))):  # an index out of range, a link made bad
        s = samples[draw(st.integers(0, len(samples) - 1))]
        what = draw(st.sampled_from(["stack", "link", "bad_link"]))
        if what == "stack":
            s.stack_index = draw(st.integers(-(2**31), 2**31 - 1))
        elif what == "link":
            s.link_index = draw(st.integers(-(2**31), 2**31 - 1))
        elif len(req.dictionary.link_table) > 1:
            req.dictionary.link_table[-1].trace_id = b"\x05" * 3
    for _ in range(draw(st.integers(0, 1))):  # one sample not usual: the loop decides
        s = samples[draw(st.integers(0, len(samples) - 1))]
        add_unusual(s, draw(st.sampled_from(UNUSUAL)))
    return req


UNUSUAL = ["timestamp", "attribute", "unknown_field", "second_value"]


def add_unusual(s: Any, what: str) -> None:
    """Something a usual sample does not have, on sample ``s``."""
    if what == "timestamp":
        s.timestamps_unix_nano.append(1_750_000_000 * 10**9)
    elif what == "attribute":
        s.attribute_indices.append(0)
    elif what == "unknown_field":
        s.MergeFromString(b"\x78\x01")  # field 15, a varint: no field of Sample
    else:
        s.values.append(1)


@settings(max_examples=400, deadline=None)
@given(req=usual_profiles())
def test_counts_and_refusals_as_the_records(req: Any) -> None:
    with mock.patch.object(profiles.time, "time_ns", return_value=1_750_000_000 * 10**9):
        full = decode_profiles(req)
        lean = decode_profiles(req, records=False)
    assert (len(lean.batch), lean.rejected, lean.message, lean.batch.sources[0][1]) == (
        len(full.batch), full.rejected, full.message, full.batch.sources[0][1])


def test_a_sample_with_anything_else_is_not_usual() -> None:
    """The sizes tell a sample that has more than its stack, link and one value, whatever
    that is, and one usual sample more or less changes nothing."""
    for what in [None, *UNUSUAL]:
        b = ProfileBuilder()
        for i in range(50):
            b.sample(["f", "main"], 10_000_000 + i * 1_000_003, bytes([1 + i % 3]) * 16,
                     bytes([1 + i % 5]) * 8, time_unix_nano=1_750_000_000 * 10**9)
        req = b.build()
        prof = req.resource_profiles[0].scope_profiles[0].profiles[0]
        if what is not None:
            add_unusual(prof.samples[17], what)
        ss = prof.samples
        usual = profiles._only_these_fields(
            prof, [s.stack_index for s in ss], [s.link_index for s in ss],
            [s.values[0] for s in ss])
        assert usual == (what is None), what
        lean, full = decode_profiles(req, records=False), decode_profiles(req)
        assert not full.rejected, full.message
        assert (len(lean.batch), lean.rejected) == (len(full.batch), full.rejected), what

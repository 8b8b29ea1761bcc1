"""pipeline/otlp/profiles.py: OTLP profiles (v1development) -> ``ProfileBatch``.

Requests are built with ``ProfileBuilder``; invalid ones are the builder's output with the
protobuf edited by hand, so that each test breaks exactly one reference.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.profiles.v1development import profiles_pb2 as pb

from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import Decoded, classify, decode_profiles, stack_hash
from pipeline.records import Sample

TRACE = bytes(range(1, 17))
SPAN = bytes(range(1, 9))
OTHER_TRACE = bytes(range(101, 117))
OTHER_SPAN = bytes(range(101, 109))
MS = 1_000_000
PERIOD = 10 * MS


def only_sample(dec: Decoded) -> Sample:
    assert dec.rejected == 0, dec.message
    assert len(dec.batch.samples) == 1, dec.batch.samples
    return dec.batch.samples[0]


def profile_of(req: ExportProfilesServiceRequest, ri: int = 0, si: int = 0,
               pi: int = 0) -> pb.Profile:
    prof: pb.Profile = req.resource_profiles[ri].scope_profiles[si].profiles[pi]
    return prof


class TestClassify:
    def test_cpu_nanoseconds_is_cpu_as_is(self) -> None:
        """cpu/nanoseconds: CPU measure, one raw unit is one ns, values are not tick counts."""
        kind = classify("cpu", "nanoseconds", "cpu", "nanoseconds", PERIOD)
        assert (kind.measure, kind.per_value, kind.value_is_count) == ("cpu", 1, False)
        assert kind.period_ns == PERIOD

    def test_cpu_milliseconds_multiplies_to_ns(self) -> None:
        """cpu/milliseconds: each raw unit is worth 1e6 ns."""
        kind = classify("cpu", "milliseconds", "cpu", "milliseconds", 10)
        assert (kind.measure, kind.per_value, kind.value_is_count) == ("cpu", MS, False)
        assert kind.period_ns == 10 * MS

    def test_samples_count_with_cpu_period_is_ticks_of_period(self) -> None:
        """samples/count with a cpu/nanoseconds period (eBPF agents): value x period, ticks."""
        kind = classify("samples", "count", "cpu", "nanoseconds", PERIOD)
        assert (kind.measure, kind.per_value, kind.value_is_count) == ("cpu", PERIOD, True)

    def test_samples_count_without_period_is_other(self) -> None:
        """samples/count with no usable period cannot be turned into time: ``other``, raw."""
        kind = classify("samples", "count", "cpu", "nanoseconds", 0)
        assert (kind.measure, kind.per_value) == ("other", 1)

    @pytest.mark.parametrize(("sample_type", "measure"), [
        ("wall", "wall"), ("off_cpu", "off_cpu"), ("CPU", "cpu"), ("alloc_space", "other"),
    ])
    def test_time_types_map_to_their_measure(self, sample_type: str, measure: str) -> None:
        """A time-unit sample type picks its own measure; unknown types are ``other``."""
        assert classify(sample_type, "nanoseconds", "cpu", "nanoseconds", PERIOD).measure == \
            measure

    @pytest.mark.parametrize(("sample_type", "unit", "measure"), [
        ("alloc_space", "bytes", "alloc"), ("alloc_in_new_tlab_bytes", "bytes", "alloc"),
        ("inuse_space", "bytes", "other"), ("alloc_objects", "count", "other"),
        ("contentions", "count", "other"), ("alloc_space", "count", "other"),
    ])
    def test_bytes_allocated_are_alloc_the_rest_other(self, sample_type: str, unit: str,
                                                      measure: str) -> None:
        """Bytes allocated are ``alloc`` (raw bytes); the live heap (inuse_*), object and
        contention counts are neither time nor bytes a span spent: ``other``, raw."""
        kind = classify(sample_type, unit, "space", "bytes", 512 * 1024)
        assert (kind.measure, kind.per_value, kind.value_is_count) == (measure, 1, False)

    @pytest.mark.parametrize("sample_type", ["delay", "lock_time", "contention", "lock"])
    def test_lock_wait_time_is_lock(self, sample_type: str) -> None:
        """Go's mutex/block delay and JFR's lock durations: ``lock``, in nanoseconds."""
        kind = classify(sample_type, "microseconds", "contentions", "count", 1)
        assert (kind.measure, kind.per_value) == ("lock", 1_000)


class TestValues:
    def test_cpu_nanoseconds_values_as_is(self) -> None:
        """A cpu/nanoseconds value is stored unchanged, as CPU."""
        b = ProfileBuilder()
        b.sample(["leaf", "main"], 12_345, TRACE, SPAN)
        s = only_sample(decode_profiles(b.build()))
        assert (s.measure, s.value, s.sample_type, s.unit) == ("cpu", 12_345, "cpu", "nanoseconds")

    def test_cpu_milliseconds_converted_to_ns(self) -> None:
        """A cpu/milliseconds value of 7 becomes 7e6 ns."""
        b = ProfileBuilder()
        b.sample(["leaf"], 7, TRACE, SPAN, unit="milliseconds")
        s = only_sample(decode_profiles(b.build()))
        assert (s.measure, s.value, s.unit) == ("cpu", 7 * MS, "milliseconds")

    def test_samples_count_times_period(self) -> None:
        """samples/count with a cpu/nanoseconds period: value x period ns, count = value."""
        b = ProfileBuilder()
        b.sample(["leaf"], 3, TRACE, SPAN, sample_type="samples", unit="count",
                 period_type="cpu", period_unit="nanoseconds", period=PERIOD)
        s = only_sample(decode_profiles(b.build()))
        assert (s.measure, s.value, s.count) == ("cpu", 3 * PERIOD, 3)

    def test_timestamps_without_values_count_one_period_each(self) -> None:
        """A sample with 4 timestamps and no values is 4 ticks of one period each."""
        b = ProfileBuilder()
        b.sample(["leaf"], None, TRACE, SPAN, timestamps=[1_000, 2_000, 3_000, 4_000],
                 period=PERIOD)
        got = [(s.measure, s.value, s.count, s.time_ns, s.timed)
               for s in decode_profiles(b.build()).batch.samples]
        assert got == [("cpu", PERIOD, 1, t, True) for t in (1_000, 2_000, 3_000, 4_000)]

    def test_timestamps_without_values_in_samples_count_profile(self) -> None:
        """The timestamps-only rule holds for a samples/count profile too."""
        b = ProfileBuilder()
        b.sample(["leaf"], None, TRACE, SPAN, timestamps=[5, 6], sample_type="samples",
                 unit="count", period=PERIOD)
        got = [(s.value, s.count, s.time_ns) for s in decode_profiles(b.build()).batch.samples]
        assert got == [(PERIOD, 1, 5), (PERIOD, 1, 6)]

    def test_values_with_timestamps_one_sample_per_instant(self) -> None:
        """values[i] belongs to timestamps_unix_nano[i] (eBPF agents: counts of a 50 ms
        period); each instant becomes its own timed sample, zero ones dropped."""
        b = ProfileBuilder()
        b.sample(["leaf"], None, TRACE, SPAN, timestamps=[7, 8, 9], sample_type="samples",
                 unit="count", period_type="cpu", period=50_000_000)
        req = b.build()
        req.resource_profiles[0].scope_profiles[0].profiles[0].samples[0].values.extend([1, 0, 2])
        got = [(s.value, s.count, s.time_ns, s.timed)
               for s in decode_profiles(req).batch.samples]
        assert got == [(50_000_000, 1, 7, True), (100_000_000, 2, 9, True)]

    def test_wall_sample_type(self) -> None:
        """A wall/nanoseconds profile is measure ``wall``, never CPU."""
        b = ProfileBuilder()
        b.sample(["leaf"], 900, TRACE, SPAN, sample_type="wall")
        s = only_sample(decode_profiles(b.build()))
        assert (s.measure, s.value) == ("wall", 900)

    def test_off_cpu_sample_type(self) -> None:
        """An off_cpu/nanoseconds profile is measure ``off_cpu``."""
        b = ProfileBuilder()
        b.sample(["leaf"], 800, TRACE, SPAN, sample_type="off_cpu")
        s = only_sample(decode_profiles(b.build()))
        assert (s.measure, s.value) == ("off_cpu", 800)

    def test_alloc_space_is_alloc_raw(self) -> None:
        """alloc_space/bytes values are kept raw (bytes) under measure ``alloc``."""
        b = ProfileBuilder()
        b.sample(["malloc"], 4096, TRACE, SPAN, sample_type="alloc_space", unit="bytes",
                 period_type="space", period_unit="bytes", period=512 * 1024)
        s = only_sample(decode_profiles(b.build()))
        assert (s.measure, s.value, s.sample_type, s.unit) == \
            ("alloc", 4096, "alloc_space", "bytes")

    def test_zero_and_empty_samples_carry_nothing(self) -> None:
        """A zero value and a sample with neither values nor timestamps decode to nothing."""
        b = ProfileBuilder()
        b.sample(["a"], 0, TRACE, SPAN)
        b.sample(["b"], None, TRACE, SPAN)
        dec = decode_profiles(b.build())
        assert (dec.rejected, dec.batch.samples, dec.batch.stacks) == (0, [], {})


class TestLinks:
    def test_link_index_zero_is_no_link(self) -> None:
        """link_index 0 (the zero entry) means the sample is linked to no span."""
        b = ProfileBuilder()
        b.sample(["leaf"], 10)
        s = only_sample(decode_profiles(b.build()))
        assert (s.trace_id, s.span_id) == (b"", b"")

    def test_link_index_zero_ignores_entry_content(self) -> None:
        """Even a non-empty link_table[0] is the no-link entry."""
        b = ProfileBuilder()
        b.sample(["leaf"], 10)
        req = b.build()
        req.dictionary.link_table[0].trace_id = TRACE
        req.dictionary.link_table[0].span_id = SPAN
        s = only_sample(decode_profiles(req))
        assert (s.trace_id, s.span_id) == (b"", b"")

    def test_all_zero_link_is_no_link(self) -> None:
        """A link of a zero trace_id and a zero span_id is no link, not an error."""
        b = ProfileBuilder()
        sample = b.sample(["leaf"], 10)
        req = b.build()
        req.dictionary.link_table.add(trace_id=bytes(16), span_id=bytes(8))
        sample.link_index = len(req.dictionary.link_table) - 1
        s = only_sample(decode_profiles(req))
        assert (s.trace_id, s.span_id) == (b"", b"")

    def test_valid_link_gives_ids(self) -> None:
        """A link with a 16-byte trace_id and an 8-byte span_id is carried to the sample."""
        b = ProfileBuilder()
        b.sample(["leaf"], 10, TRACE, SPAN)
        b.sample(["leaf"], 20, OTHER_TRACE, OTHER_SPAN)
        dec = decode_profiles(b.build())
        assert dec.rejected == 0
        assert [(s.trace_id, s.span_id, s.value) for s in dec.batch.samples] == \
            [(TRACE, SPAN, 10), (OTHER_TRACE, OTHER_SPAN, 20)]

    def test_empty_link_table_index_zero_is_no_link(self) -> None:
        """A request without any link_table still decodes samples with link_index 0."""
        b = ProfileBuilder()
        b.sample(["leaf"], 10)
        req = b.build()
        del req.dictionary.link_table[:]
        s = only_sample(decode_profiles(req))
        assert (s.trace_id, s.span_id) == (b"", b"")

    def test_zero_trace_id_with_span_id_is_a_span_only_link(self) -> None:
        """An all-zero trace_id with a real span_id is a span-only link (what a sample that
        Pyroscope SDKs labelled with span_id alone becomes): kept with trace_id b"", never
        joined to a trace 000...0; the trace is found later by span id."""
        b = ProfileBuilder()
        b.sample(["leaf"], 10, bytes(16), SPAN)
        dec = decode_profiles(b.build())
        assert dec.rejected == 0
        assert [(s.trace_id, s.span_id) for s in dec.batch.samples] == [(b"", SPAN)]

    def test_zero_span_id_with_trace_id_rejects(self) -> None:
        """A link of a real trace_id and an all-zero span_id is invalid."""
        b = ProfileBuilder()
        b.sample(["leaf"], 10, TRACE, bytes(8))
        dec = decode_profiles(b.build())
        assert dec.rejected == 1
        assert "samples[0]: link_table[1]" in dec.message


class TestRejection:
    """Each broken reference rejects its whole profile; the request's other profiles pass.

    The request has three profiles under one resource; profile 1 has four samples and the
    tests break ``samples[3]`` (or the profile itself), so a decoder that stopped at the
    first sample, or dropped the neighbours, shows.
    """

    PATH = "resource_profiles[0].scope_profiles[0].profiles[1]: "

    @pytest.fixture
    def req(self) -> ExportProfilesServiceRequest:
        b = ProfileBuilder()
        b.sample(["a", "main"], 100, TRACE, SPAN, period=1)
        for i in range(4):
            b.sample([f"f{i}", "main"], 1_000 + i, OTHER_TRACE, OTHER_SPAN, period=2)
        b.sample(["c", "main"], 300, TRACE, SPAN, period=3)
        req = b.build()
        assert len(req.resource_profiles[0].scope_profiles[0].profiles) == 3
        assert len(profile_of(req, pi=1).samples) == 4
        return req

    @staticmethod
    def bad_sample(req: ExportProfilesServiceRequest) -> pb.Sample:
        sample: pb.Sample = profile_of(req, pi=1).samples[3]
        return sample

    @staticmethod
    def use_stack(req: ExportProfilesServiceRequest, location_indices: list[int]) -> None:
        d = req.dictionary
        d.stack_table.add(location_indices=location_indices)
        TestRejection.bad_sample(req).stack_index = len(d.stack_table) - 1

    @staticmethod
    def use_location(req: ExportProfilesServiceRequest, function_index: int) -> None:
        d = req.dictionary
        d.location_table.add(lines=[pb.Line(function_index=function_index, line=7)])
        TestRejection.use_stack(req, [1, len(d.location_table) - 1])

    def assert_only_profile_1_rejected(self, req: ExportProfilesServiceRequest,
                                       problem: str) -> None:
        dec = decode_profiles(req)
        assert dec.rejected == 1
        assert dec.message.startswith(self.PATH + problem), dec.message
        assert " more)" not in dec.message
        assert sorted(s.value for s in dec.batch.samples) == [100, 300]
        assert sorted(tuple(st.functions) for st in dec.batch.stacks.values()) == \
            [("a", "main"), ("c", "main")]

    def test_intact_request_accepted(self, req: ExportProfilesServiceRequest) -> None:
        """Without an edit, all six samples of the three profiles decode."""
        dec = decode_profiles(req)
        assert (dec.rejected, dec.message) == (0, "")
        assert sorted(s.value for s in dec.batch.samples) == [100, 300, 1000, 1001, 1002, 1003]

    def test_link_with_short_trace_id(self, req: ExportProfilesServiceRequest) -> None:
        """A link whose trace_id has 15 bytes rejects the profile that uses it."""
        req.dictionary.link_table.add(trace_id=TRACE[:15], span_id=SPAN)
        self.bad_sample(req).link_index = len(req.dictionary.link_table) - 1
        self.assert_only_profile_1_rejected(req, "samples[3]: link_table[")

    def test_link_with_long_span_id(self, req: ExportProfilesServiceRequest) -> None:
        """A link whose span_id has 9 bytes rejects the profile that uses it."""
        req.dictionary.link_table.add(trace_id=TRACE, span_id=SPAN + b"\x01")
        self.bad_sample(req).link_index = len(req.dictionary.link_table) - 1
        self.assert_only_profile_1_rejected(req, "samples[3]: link_table[")

    def test_link_index_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A link_index past the link_table's end rejects the profile."""
        n = len(req.dictionary.link_table)
        self.bad_sample(req).link_index = n
        self.assert_only_profile_1_rejected(req, f"samples[3]: link_index {n} out of range")

    def test_negative_link_index(self, req: ExportProfilesServiceRequest) -> None:
        """A negative link_index (int32 on the wire) rejects the profile."""
        self.bad_sample(req).link_index = -1
        self.assert_only_profile_1_rejected(req, "samples[3]: link_index -1 out of range")

    def test_stack_index_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A stack_index past the stack_table's end rejects the profile."""
        n = len(req.dictionary.stack_table)
        self.bad_sample(req).stack_index = n + 10
        self.assert_only_profile_1_rejected(req, f"samples[3]: stack_index {n + 10} out of range")

    def test_location_index_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A stack that names a location past the location_table rejects the profile."""
        n = len(req.dictionary.location_table)
        self.use_stack(req, [1, n])
        self.assert_only_profile_1_rejected(
            req, f"samples[3]: stack_table[{len(req.dictionary.stack_table) - 1}] "
                 f"location index {n} out of range")

    def test_function_index_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A location line that names a function past the function_table rejects the profile."""
        n = len(req.dictionary.function_table)
        self.use_location(req, n)
        self.assert_only_profile_1_rejected(
            req, f"samples[3]: location_table[{len(req.dictionary.location_table) - 1}] "
                 f"function_index {n} out of range")

    def test_function_name_string_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A function whose name_strindex is past the string_table rejects the profile."""
        n = len(req.dictionary.string_table)
        req.dictionary.function_table.add(name_strindex=n, filename_strindex=0)
        fi = len(req.dictionary.function_table) - 1
        self.use_location(req, fi)
        self.assert_only_profile_1_rejected(
            req, f"samples[3]: function_table[{fi}].name_strindex {n} out of range")

    def test_function_filename_string_out_of_range(
            self, req: ExportProfilesServiceRequest) -> None:
        """A function whose filename_strindex is past the string_table rejects the profile."""
        n = len(req.dictionary.string_table)
        req.dictionary.function_table.add(name_strindex=1, filename_strindex=n + 3)
        fi = len(req.dictionary.function_table) - 1
        self.use_location(req, fi)
        self.assert_only_profile_1_rejected(
            req, f"samples[3]: function_table[{fi}].filename_strindex {n + 3} out of range")

    def test_sample_type_string_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A profile whose sample_type names a string past the table is rejected."""
        n = len(req.dictionary.string_table)
        profile_of(req, pi=1).sample_type.unit_strindex = n
        self.assert_only_profile_1_rejected(req, f"sample_type.unit_strindex {n} out of range")

    def test_period_type_string_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A profile whose period_type names a string past the table is rejected."""
        n = len(req.dictionary.string_table)
        profile_of(req, pi=1).period_type.type_strindex = n
        self.assert_only_profile_1_rejected(req, f"period_type.type_strindex {n} out of range")

    def test_sample_attribute_index_out_of_range(self, req: ExportProfilesServiceRequest) -> None:
        """A sample attribute index past the attribute_table rejects the profile."""
        n = len(req.dictionary.attribute_table)
        self.bad_sample(req).attribute_indices.append(n)
        self.assert_only_profile_1_rejected(req, f"samples[3]: attribute_indices {n} out of range")

    def test_profile_attribute_index_out_of_range(
            self, req: ExportProfilesServiceRequest) -> None:
        """A profile attribute index past the attribute_table rejects the profile."""
        n = len(req.dictionary.attribute_table)
        profile_of(req, pi=1).attribute_indices.append(n)
        self.assert_only_profile_1_rejected(req, f"attribute_indices {n} out of range")

    def test_values_and_timestamps_disagree(self, req: ExportProfilesServiceRequest) -> None:
        """One value with two timestamps cannot be paired: the profile is rejected."""
        self.bad_sample(req).timestamps_unix_nano.extend([1, 2])
        self.assert_only_profile_1_rejected(req, "samples[3]: 1 values but 2 timestamps")

    def test_negative_value(self, req: ExportProfilesServiceRequest) -> None:
        """A negative value rejects the profile."""
        self.bad_sample(req).values[0] = -5
        self.assert_only_profile_1_rejected(req, "samples[3]: negative value -5")

    def test_rejected_counts_profiles_and_message_is_capped(
            self, req: ExportProfilesServiceRequest) -> None:
        """Five broken profiles count five; the message names three and '(and 2 more)'."""
        n = len(req.dictionary.stack_table)
        scope = req.resource_profiles[0].scope_profiles[0]
        for _ in range(2):
            scope.profiles.add().CopyFrom(scope.profiles[1])
        rp2 = req.resource_profiles.add()
        rp2.scope_profiles.add().profiles.add().CopyFrom(scope.profiles[1])
        rp2.scope_profiles.add().profiles.add().CopyFrom(scope.profiles[1])
        for rp in req.resource_profiles:
            for sp in rp.scope_profiles:
                for p in sp.profiles:
                    if len(p.samples) == 4:
                        p.samples[3].stack_index = n
        dec = decode_profiles(req)
        assert dec.rejected == 5
        assert dec.message.count(f"stack_index {n} out of range") == 3
        assert dec.message.startswith(self.PATH)
        assert "resource_profiles[0].scope_profiles[0].profiles[3]: " in dec.message
        assert "resource_profiles[0].scope_profiles[0].profiles[4]: " in dec.message
        assert dec.message.endswith(" (and 2 more)")
        assert sorted(s.value for s in dec.batch.samples) == [100, 300]


class TestStacks:
    def test_identical_frames_same_id_across_requests(self) -> None:
        """The same frames give the same stack id in two requests with different tables."""
        b1 = ProfileBuilder()
        b1.sample(["leaf", "mid", "main"], 10, TRACE, SPAN)
        b2 = ProfileBuilder()
        b2.string("padding")  # shift every index of the second request's dictionary
        b2.stack(["x", "main"])
        b2.sample(["leaf", "mid", "main"], 20, OTHER_TRACE, OTHER_SPAN)
        s1 = only_sample(decode_profiles(b1.build()))
        s2 = only_sample(decode_profiles(b2.build()))
        assert b1.build().resource_profiles[0].scope_profiles[0].profiles[0] \
            .samples[0].stack_index != \
            b2.build().resource_profiles[0].scope_profiles[0].profiles[0].samples[0].stack_index
        assert s1.stack_id == s2.stack_id

    def test_different_frames_different_ids(self) -> None:
        """Different functions, order, files or lines give different stack ids."""
        b = ProfileBuilder()
        b.sample(["leaf", "main"], 1, TRACE, SPAN)
        b.sample(["main", "leaf"], 2, TRACE, SPAN)
        b.sample(["leaf"], 3, TRACE, SPAN)
        b.sample(["other", "main"], 4, TRACE, SPAN)
        dec = decode_profiles(b.build())
        assert dec.rejected == 0
        ids = [s.stack_id for s in dec.batch.samples]
        assert len(set(ids)) == 4
        assert stack_hash(["leaf"], ["a.py"], [1]) != stack_hash(["leaf"], ["b.py"], [1])
        assert stack_hash(["leaf"], ["a.py"], [1]) != stack_hash(["leaf"], ["a.py"], [2])

    def test_stack_hash_is_deterministic_63_bit(self) -> None:
        """stack_hash depends only on the frames and fits a signed 64-bit column."""
        h = stack_hash(["leaf", "main"], ["a.py", "a.py"], [3, 9])
        assert h == stack_hash(["leaf", "main"], ["a.py", "a.py"], [3, 9])
        assert 0 <= h < 2**63

    def test_batch_carries_used_stacks_leaf_first(self) -> None:
        """batch.stacks holds each used stack once, frames leaf first, keyed by its id."""
        b = ProfileBuilder()
        b.stack(["unused"])
        b.sample(["leaf", "main"], 1, TRACE, SPAN)
        b.sample(["leaf", "main"], 2, OTHER_TRACE, OTHER_SPAN)
        dec = decode_profiles(b.build())
        assert dec.rejected == 0
        (sid, stack), = dec.batch.stacks.items()
        assert sid == stack.stack_id == dec.batch.samples[0].stack_id
        assert (stack.functions, stack.files, stack.lines) == \
            (["leaf", "main"], ["app.py", "app.py"], [1, 1])
        assert stack.stack_id == stack_hash(stack.functions, stack.files, stack.lines)

    def test_inlined_frames_expand_innermost_first(self) -> None:
        """One location with several lines expands to its inlined frames, innermost first."""
        b = ProfileBuilder()
        sample = b.sample(["main"], 10, TRACE, SPAN)
        req = b.build()
        d = req.dictionary
        fns = {}
        for name in ("inlined_leaf", "inlined_mid", "caller"):
            d.function_table.add(name_strindex=b.string(name), filename_strindex=b.string("x.py"))
            fns[name] = len(d.function_table) - 1
        d.location_table.add(lines=[pb.Line(function_index=fns["inlined_leaf"], line=30),
                                    pb.Line(function_index=fns["inlined_mid"], line=20),
                                    pb.Line(function_index=fns["caller"], line=10)])
        main_loc = d.stack_table[sample.stack_index].location_indices[0]
        d.stack_table.add(location_indices=[len(d.location_table) - 1, main_loc])
        sample.stack_index = len(d.stack_table) - 1
        s = only_sample(decode_profiles(req))
        stack = decode_profiles(req).batch.stacks[s.stack_id]
        assert stack.functions == ["inlined_leaf", "inlined_mid", "caller", "main"]
        assert stack.files == ["x.py", "x.py", "x.py", "app.py"]
        assert stack.lines == [30, 20, 10, 1]

    def test_location_without_lines_is_its_address(self) -> None:
        """An unsymbolised location (no lines) becomes a frame named by its address."""
        b = ProfileBuilder()
        sample = b.sample(["main"], 10, TRACE, SPAN)
        req = b.build()
        d = req.dictionary
        d.location_table.add(address=0xDEADBEEF)
        d.stack_table.add(location_indices=[len(d.location_table) - 1])
        sample.stack_index = len(d.stack_table) - 1
        dec = decode_profiles(req)
        stack = dec.batch.stacks[only_sample(dec).stack_id]
        assert (stack.functions, stack.files, stack.lines) == (["0xdeadbeef"], [""], [0])


class TestService:
    def test_service_from_resource_attribute(self) -> None:
        """Each sample carries its resource's service.name."""
        b = ProfileBuilder()
        b.sample(["a"], 1, TRACE, SPAN, service="checkout")
        b.sample(["a"], 2, TRACE, SPAN, service="payments")
        dec = decode_profiles(b.build())
        assert [(s.service, s.value) for s in dec.batch.samples] == \
            [("checkout", 1), ("payments", 2)]

    def test_unknown_service_when_absent(self) -> None:
        """A resource without service.name gives ``unknown_service``."""
        b = ProfileBuilder()
        b.sample(["a"], 1, TRACE, SPAN)
        req = b.build()
        del req.resource_profiles[0].resource.attributes[:]
        assert only_sample(decode_profiles(req)).service == "unknown_service"

    def test_service_name_among_other_attributes(self) -> None:
        """service.name is found by key, not by position."""
        b = ProfileBuilder()
        b.sample(["a"], 1, TRACE, SPAN, service="checkout")
        req = b.build()
        resource = req.resource_profiles[0].resource
        service_kv = KeyValue()
        service_kv.CopyFrom(resource.attributes[0])
        del resource.attributes[:]
        resource.attributes.add(key="host.name").value.string_value = "h1"
        resource.attributes.append(service_kv)
        assert [kv.key for kv in resource.attributes] == ["host.name", "service.name"]
        assert only_sample(decode_profiles(req)).service == "checkout"

    def test_string_references_as_the_collector_writes_them(self) -> None:
        """pdata (Collector v0.165) writes resource attributes and attribute_table values as
        ``key_strindex``/``string_value_strindex`` into the string_table: they are resolved
        (seen in the file exporter's output, tests/backfill/test_collector_files.py)."""
        b = ProfileBuilder()
        b.sample(["a"], 1, TRACE, SPAN, attributes={"thread.name": "worker"})
        req = b.build()
        strings = req.dictionary.string_table
        strings.extend(["service.name", "checkout", "host.name", "h1", "main"])
        n = len(strings)
        resource = req.resource_profiles[0].resource
        del resource.attributes[:]
        for k, v in ((n - 5, n - 4), (n - 3, n - 2)):
            resource.attributes.add(key_strindex=k).value.string_value_strindex = v
        thread = next(kv for kv in req.dictionary.attribute_table
                      if strings[kv.key_strindex] == "thread.name")
        thread.value.string_value_strindex = n - 1
        s = only_sample(decode_profiles(req))
        assert (s.service, s.host, s.thread_name) == ("checkout", "h1", "main")

    def test_string_reference_out_of_range(self) -> None:
        """A reference past the string_table refuses the resource's profiles, naming it."""
        b = ProfileBuilder()
        b.sample(["a"], 1, TRACE, SPAN)
        req = b.build()
        req.resource_profiles[0].resource.attributes.add(
            key="host.name").value.string_value_strindex = 10_000
        dec = decode_profiles(req)
        assert dec.rejected == 1 and not dec.batch.samples
        assert "resource.attributes[1].value.string_value_strindex 10000 out of range" \
            in dec.message


class TestWhereSampled:
    def test_thread_attributes_and_process_identity(self) -> None:
        """thread.id / thread.name sample attributes (eBPF agents), resource process.pid and
        host.name, and a profile-level thread.id applying to samples that name none."""
        b = ProfileBuilder()
        res = {"process.pid": 311, "host.name": "node-1"}
        b.sample(["a"], 1, attributes={"thread.id": 12, "thread.name": "worker"}, resource=res)
        b.sample(["a"], 2, resource=res)
        req = b.build()
        prof = req.resource_profiles[0].scope_profiles[0].profiles[0]
        prof.attribute_indices.append(b.attribute("thread.id", 99))
        got = [(s.thread_id, s.thread_name, s.pid, s.host) for s in
               decode_profiles(req).batch.samples]
        assert got == [(12, "worker", 311, "node-1"), (99, "", 311, "node-1")]

    def test_go_pprof_labels_are_a_link(self) -> None:
        """process.context.label.span_id (Go pprof labels, passed on by the eBPF profiler) is
        a span-only link, with the trace when process.context.label.trace_id is there; a
        malformed one is ignored, and a real link wins."""
        b = ProfileBuilder()
        b.sample(["a"], 1, attributes={"process.context.label.span_id": SPAN.hex()})
        b.sample(["a"], 2, attributes={"process.context.label.span_id": SPAN.hex(),
                                       "process.context.label.trace_id": TRACE.hex()})
        b.sample(["a"], 3, attributes={"process.context.label.span_id": "xyz"})
        b.sample(["a"], 4, TRACE, b"\x09" * 8,
                 attributes={"process.context.label.span_id": SPAN.hex()})
        got = [(s.trace_id, s.span_id) for s in decode_profiles(b.build()).batch.samples]
        assert got == [(b"", SPAN), (TRACE, SPAN), (b"", b""), (TRACE, b"\x09" * 8)]


# -- property: CPU is conserved per span ------------------------------------------------

_ids = st.tuples(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8)) \
    .filter(lambda ids: any(ids[0]) and any(ids[1]))
_frames = st.lists(st.sampled_from(["main", "run", "handle", "parse", "encode", "sleep", "io"]),
                   min_size=1, max_size=6)


@st.composite
def _profile_requests(draw: st.DrawFn) -> tuple[ExportProfilesServiceRequest,
                                                list[tuple[bytes, bytes, int]]]:
    links = draw(st.lists(_ids, min_size=0, max_size=4, unique=True))
    link_choice = st.sampled_from([(b"", b""), *links])
    b = ProfileBuilder()
    inputs = []
    for _ in range(draw(st.integers(0, 25))):
        tid, sid = draw(link_choice)
        value = draw(st.integers(0, 10**12))
        b.sample(draw(_frames), value, tid, sid,
                 service=draw(st.sampled_from(["svc-a", "svc-b"])),
                 period=draw(st.sampled_from([1_000_000, 10_000_000])))
        inputs.append((tid, sid, value))
    return b.build(), inputs


class TestCpuConservation:
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_profile_requests())
    def test_cpu_per_span_is_conserved(
            self, case: tuple[ExportProfilesServiceRequest, list[tuple[bytes, bytes, int]]]
    ) -> None:
        """Random valid cpu profiles: nothing rejected, CPU per (trace, span) in = out."""
        req, inputs = case
        dec = decode_profiles(req)
        assert (dec.rejected, dec.message) == (0, "")
        want: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for tid, sid, value in inputs:
            want[(tid, sid)] += value
        got: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for s in dec.batch.samples:
            assert s.measure == "cpu"
            assert s.stack_id in dec.batch.stacks
            got[(s.trace_id, s.span_id)] += s.value
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.sampled_from([(b"", b""), (TRACE, SPAN),
                                               (OTHER_TRACE, OTHER_SPAN)]),
                              st.sampled_from(["ns", "ms", "count", "stamps"]),
                              st.integers(0, 10**6), _frames), max_size=20))
    def test_cpu_conserved_across_encodings(
            self, rows: list[tuple[tuple[bytes, bytes], str, int, list[str]]]) -> None:
        """cpu/ns, cpu/ms, samples/count and timestamps-only all add up in ns per span."""
        b = ProfileBuilder()
        want: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for (tid, sid), enc, n, frames in rows:
            if enc == "ns":
                b.sample(frames, n, tid, sid)
                want[(tid, sid)] += n
            elif enc == "ms":
                b.sample(frames, n, tid, sid, unit="milliseconds")
                want[(tid, sid)] += n * MS
            elif enc == "count":
                b.sample(frames, n, tid, sid, sample_type="samples", unit="count",
                         period=PERIOD)
                want[(tid, sid)] += n * PERIOD
            else:
                k = n % 5
                b.sample(frames, None, tid, sid, timestamps=list(range(1, k + 1)),
                         period=PERIOD)
                want[(tid, sid)] += k * PERIOD
        dec = decode_profiles(b.build())
        assert (dec.rejected, dec.message) == (0, "")
        got: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for s in dec.batch.samples:
            assert s.measure == "cpu"
            got[(s.trace_id, s.span_id)] += s.value
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}

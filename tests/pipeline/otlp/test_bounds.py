"""Issue #13: what the review found acknowledged-but-unstorable, or a 500, is refused at the
door with a message naming the field (bounds.py, stacks.py, jsonwire.py)."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.errors import InvalidData
from pipeline.otlp import bounds, jsonwire
from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.stacks import StackTable
from pipeline.otlp.traces import decode_traces
from tests.pipeline.otlp.test_traces import new_span, request

NOW = time.time_ns()
YEAR_2200 = 7_258_118_400 * 10**9


class TestProfileValues:
    def test_three_max_int64_values_refused(self) -> None:
        """3 samples of 2^63-1 ns: each over the per-sample limit, the profile refused."""
        b = ProfileBuilder()
        for _ in range(3):
            b.sample(["f"], 2**63 - 1)
        dec = decode_profiles(b.build())
        assert (len(dec.batch), dec.rejected) == (0, 1)
        assert "over the per-sample limit" in dec.message

    def test_value_sum_over_int64_refused(self) -> None:
        """Values each within the limit that add up past Int64 in one request: refused."""
        b = ProfileBuilder()
        for i in range(2**19 + 1):
            if i % 2**17 == 0:
                b.sample(["f"], bounds.MAX_SAMPLE_VALUE, service=f"s{i}")
        dec = decode_profiles(b.build())
        assert dec.rejected == 0  # 5 samples: fine
        many = ProfileBuilder()
        prof_samples = many.profile().samples
        many.sample(["f"], 1)
        template = prof_samples[0]
        template.values[0] = bounds.MAX_SAMPLE_VALUE
        for _ in range(2**19):
            prof_samples.add().CopyFrom(template)
        dec = decode_profiles(many.build())
        assert dec.rejected == 1 and "over the request limit" in dec.message

    @pytest.mark.parametrize("when", [YEAR_2200, bounds.TIME_MAX_NS, 2**64 - 1])
    def test_sample_timestamp_after_2106_refused(self, when: int) -> None:
        """A sample instant beyond the DateTime range is refused, naming the field."""
        b = ProfileBuilder()
        b.sample(["f"], None, timestamps=[NOW, when])
        dec = decode_profiles(b.build())
        assert dec.rejected == 1 and "timestamps_unix_nano" in dec.message

    def test_profile_time_after_2106_refused(self) -> None:
        b = ProfileBuilder()
        b.sample(["f"], 5, time_unix_nano=YEAR_2200)
        dec = decode_profiles(b.build())
        assert dec.rejected == 1 and "time_unix_nano" in dec.message

    @pytest.mark.parametrize("pid", [-1, 2**32, 2**63 - 1])
    def test_pid_out_of_uint32_refused(self, pid: int) -> None:
        b = ProfileBuilder()
        b.sample(["f"], 5, resource={"process.pid": pid})
        dec = decode_profiles(b.build())
        assert dec.rejected == 1 and "process.pid" in dec.message

    def test_huge_thread_id_refused_negative_unknown(self) -> None:
        """thread.id over UInt64 is refused; a negative one is "not known" (0), as before."""
        b = ProfileBuilder()
        b.sample(["f"], 5, attributes={"thread.id": "9" * 25})
        dec = decode_profiles(b.build())
        assert dec.rejected == 1 and "thread.id" in dec.message
        b = ProfileBuilder()
        b.sample(["f"], 5, attributes={"thread.id": -7})
        assert decode_profiles(b.build()).batch.samples[0].thread_id == 0

    def test_ticks_over_uint32_refused(self) -> None:
        """samples/count without a time period: the count column is UInt32."""
        b = ProfileBuilder()
        b.sample(["f"], 2**33, sample_type="samples", unit="count", period_type="")
        dec = decode_profiles(b.build())
        assert dec.rejected == 1 and "UInt32" in dec.message

    def test_timestamps_bounded_per_request(self) -> None:
        """One sample with many timestamps makes one record each: bounded by max_records."""
        b = ProfileBuilder()
        b.sample(["f"], None, timestamps=[NOW] * 50)
        dec = decode_profiles(b.build(), max_records=10)
        assert dec.rejected == 1 and "sample records" in dec.message


class TestProfileStacks:
    def test_repeated_location_with_many_lines_refused_cheaply(self) -> None:
        """One location of 1000 inlined lines referenced 5000 times per stack, in many
        stacks: refused by the frame budget, without building gigabytes."""
        b = ProfileBuilder()
        b.sample(["f"], 5)
        d = b.req.dictionary
        loc = d.location_table[1]
        for _ in range(999):
            loc.lines.add(function_index=1, line=2)
        for n in range(200):
            d.stack_table.add(location_indices=[1] * (n + 1))
        prof = b.req.resource_profiles[0].scope_profiles[0].profiles[0]
        for n in range(200):
            prof.samples.add(stack_index=2 + n, values=[5])
        size = b.req.ByteSize()
        tracemalloc.start()
        t0 = time.perf_counter()
        dec = decode_profiles(b.req)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert dec.rejected == 1
        assert "frames" in dec.message
        assert peak < 64 * size + (32 << 20), (peak, size)
        assert time.perf_counter() - t0 < 5

    @pytest.mark.parametrize("bad_link", [False, True])
    def test_a_gateway_spends_the_stack_budget_as_the_records_do(self, bad_link: bool) -> None:
        """Without records (a gateway's decode, checked column by column) the same samples
        are counted and the same profiles refused, with the same words, whichever stack the
        request's text budget runs out at: the stacks, the only checks that leave state,
        are taken in the order the per-sample loop takes them."""
        b = ProfileBuilder()
        tid = bytes(range(1, 17))
        for i in range(12):  # the wall samples (one profile) name a link of their own
            b.sample([f"function_{i % 7}_" * (i + 1), "main"], (i % 4) * 5, tid,
                     bytes([1 + (i % 3 == 0)]) * 8,
                     sample_type="cpu" if i % 3 else "wall", unit="nanoseconds",
                     period_type="cpu", period_unit="nanoseconds", period=10)
        req = b.build()
        if bad_link:  # the wall profile's: refused, whatever the budget
            req.dictionary.link_table[1].span_id = b"short"
        seen = set()
        for max_text in range(0, 2000, 23):
            full = decode_profiles(req, stacks=StackTable(max_text=max_text))
            lean = decode_profiles(req, records=False, stacks=StackTable(max_text=max_text))
            assert (len(lean.batch), lean.rejected, lean.message) == (
                len(full.batch), full.rejected, full.message), max_text
            seen.add(full.rejected)
        assert len(seen) > 1  # the budget refused some profiles, then none

    def test_depth_limit(self) -> None:
        b = ProfileBuilder()
        b.sample(["f"] * 20, 5)
        dec = decode_profiles(b.build(), stacks=StackTable(max_depth=10))
        assert dec.rejected == 1 and "stack depth limit 10" in dec.message

    def test_mapping_index_checked_and_split_safe(self) -> None:
        """A used location's mapping_index out of range refuses the profile (split.py
        would copy it); index 0 with no mapping_table is "no mapping"."""
        b = ProfileBuilder()
        b.sample(["f"], 5)
        b.req.dictionary.location_table[1].mapping_index = 7
        dec = decode_profiles(b.req)
        assert dec.rejected == 1 and "mapping_index 7" in dec.message
        b.req.dictionary.location_table[1].mapping_index = 0
        del b.req.dictionary.mapping_table[:]
        assert decode_profiles(b.req).rejected == 0


class TestSpans:
    @pytest.mark.parametrize("field, value, problem", [
        ("end_time_unix_nano", YEAR_2200, "end_time_unix_nano"),
        ("end_time_unix_nano", 2**64 - 1, "end_time_unix_nano"),
    ])
    def test_times_after_2106_refused(self, field: str, value: int, problem: str) -> None:
        req = request([[2]])
        setattr(req.resource_spans[0].scope_spans[0].spans[1], field, value)
        dec = decode_traces(req)
        assert (len(dec.batch), dec.rejected) == (1, 1) and problem in dec.message

    def test_event_after_2106_refused(self) -> None:
        req = request([[1]])
        req.resource_spans[0].scope_spans[0].spans[0].events.add(time_unix_nano=YEAR_2200)
        dec = decode_traces(req)
        assert dec.rejected == 1 and "events" in dec.message

    def test_link_id_lengths(self) -> None:
        req = request([[0]])
        req.resource_spans[0].scope_spans[0].spans.append(
            new_span(1, links=[{"trace_id": b"\x01" * 5, "span_id": b"\x02" * 8}]))
        dec = decode_traces(req)
        assert dec.rejected == 1 and "links[0]" in dec.message


class TestJson:
    def test_lone_surrogate_key_and_value_are_invalid_data(self) -> None:
        for body in (b'{"\\ud800": 1}', b'{"resourceSpans": [{"x": "\\udc00"}]}',
                     b'{"a": "\xed\xa0\x80"}'):
            with pytest.raises(InvalidData, match="not valid JSON"):
                jsonwire.parse_request(body, ExportTraceServiceRequest)

    def test_deep_nesting_is_invalid_data(self) -> None:
        for n in (65, 5000, 200_000):
            body = b'{"resourceSpans": ' + b"[" * n + b"]" * n + b"}"
            with pytest.raises(InvalidData, match="nested|not valid JSON"):
                jsonwire.parse_request(body, ExportTraceServiceRequest)

    def test_otlp_json_still_parses(self) -> None:
        doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{
            "traceId": "0102030405060708090a0b0c0d0e0f10", "spanId": "0102030405060708",
            "name": "x", "startTimeUnixNano": str(NOW), "endTimeUnixNano": str(NOW)}]}]}]}
        req = jsonwire.parse_request(json.dumps(doc).encode(), ExportTraceServiceRequest)
        assert len(decode_traces(req).batch) == 1

    def test_not_an_object_is_invalid_data(self) -> None:
        for body in (b"[]", b"1", b'"x"', b"null", b'{"resourceSpans": 5}'):
            with pytest.raises(InvalidData):
                jsonwire.parse_request(body, ExportTraceServiceRequest)

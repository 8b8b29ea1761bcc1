"""The embedded pipeline end to end, as a user runs it: ``spanprof run`` in its own process,
spans from the OpenTelemetry SDK's real OTLP/gRPC exporter, profiles over OTLP/gRPC, answers
from the admin API and, once the process has stopped, straight from ClickHouse."""

from __future__ import annotations

import random
import time
import urllib.request
from collections import defaultdict
from typing import Any

import grpc
import pytest

from pipeline.otlp.builder import ProfileBuilder
from tests.conftest import SpanprofProcess, clickhouse, wait_until
from tests.e2e.otlp_clients import ids_of, profiles_stub, sdk_tracer

pytestmark = pytest.mark.e2e
MS = 1_000_000


def _make_trace(tracer: Any, name: str) -> list[tuple[bytes, bytes]]:
    """A root span with two children; returns their (trace_id, span_id), root first."""
    with tracer.start_as_current_span(name) as root:
        with tracer.start_as_current_span("db.query") as a:
            pass
        with tracer.start_as_current_span("serialize") as b:
            pass
    return [ids_of(root), ids_of(a), ids_of(b)]


class TestEmbeddedPipeline:
    def test_cpu_per_span_equals_linked_samples(self, spanprof: SpanprofProcess) -> None:
        """Each span's cpu_ns equals the sum of its linked samples, exactly, through the API
        and in ClickHouse: with profiles that arrive before their spans, samples that arrive
        after the span's first attribution was written, CPU given as cpu/nanoseconds,
        samples/count x period and timestamps only, and unlinked CPU counted per service."""
        spanprof.start()
        rng = random.Random(7)
        truth: dict[tuple[bytes, bytes], int] = defaultdict(int)
        sent_samples = 0
        channel = grpc.insecure_channel(spanprof.grpc_target)
        stub = profiles_stub(channel)
        provider, tracer = sdk_tracer(spanprof.grpc_target, "checkout")

        def send(build: Any) -> None:
            nonlocal sent_samples
            b = ProfileBuilder()
            build(b)
            req = b.build()
            resp = stub.Export(req, timeout=30)
            assert not resp.HasField("partial_success") or \
                resp.partial_success.rejected_profiles == 0, resp
            # a sample with several timestamps is stored as one row per instant
            sent_samples += sum(max(1, len(smp.timestamps_unix_nano))
                                for rp in req.resource_profiles for sp in rp.scope_profiles
                                for p in sp.profiles for smp in p.samples)

        # 1. trace A: its profile arrives *before* its spans are exported
        early = _make_trace(tracer, "place_order")

        def early_profile(b: ProfileBuilder) -> None:
            for tid, sid in early:
                for _ in range(rng.randint(1, 4)):
                    v = rng.randint(1, 50) * MS
                    truth[(tid, sid)] += v
                    b.sample(["json.dumps", "encode", "handler"], v, tid, sid,
                             service="checkout")
            b.sample(["gc.collect"], 30 * MS, service="checkout")  # unlinked
        send(early_profile)
        provider.force_flush()

        # 2. traces B: spans first, then part of their samples
        later = [_make_trace(tracer, f"op{i}") for i in range(5)]
        provider.force_flush()

        def first_part(b: ProfileBuilder) -> None:
            for spans in later:
                for tid, sid in spans[1:]:
                    v = rng.randint(1, 20) * MS
                    truth[(tid, sid)] += v
                    b.sample(["sql.execute", "db.query"], v, tid, sid, service="checkout")
        send(first_part)

        # wait for the first attribution of every B span to be written
        b_spans = {sid.hex() for spans in later for _, sid in spans}

        def b_reported() -> bool:
            got = {s["span_id"] for s in spanprof.get("/api/v1/spans?limit=1000")["spans"]}
            return b_spans <= got
        wait_until(b_reported)

        # 3. late samples for those spans, in three encodings, after their rows exist
        now = time.time_ns()

        def late_part(b: ProfileBuilder) -> None:
            for spans in later:
                tid, sid = spans[2]
                truth[(tid, sid)] += 7 * MS
                b.sample(["zlib.compress", "serialize"], 7 * MS, tid, sid, service="checkout")
                # eBPF style: samples/count with a 10 ms CPU period
                truth[(tid, sid)] += 3 * 10 * MS
                b.sample(["memcpy", "serialize"], 3, tid, sid, service="checkout",
                         sample_type="samples", unit="count", period=10 * MS)
                # timestamps only: one period each
                truth[(tid, sid)] += 2 * 10 * MS
                b.sample(["memcpy", "serialize"], None, tid, sid,
                         timestamps=[now, now + 10 * MS],
                         service="checkout", sample_type="samples", unit="count",
                         period=10 * MS)
            # wall time is a separate measure: it must not change cpu_ns
            tid, sid = later[0][0]
            b.sample(["socket.recv"], 500 * MS, tid, sid, service="checkout",
                     sample_type="wall", unit="nanoseconds", period_type="wall")
        send(late_part)
        provider.shutdown()

        def api_matches() -> bool:
            for spans in [early, *later]:
                got = spanprof.get(f"/api/v1/traces/{spans[0][0].hex()}")
                by_span = {s["span_id"]: s for s in got["spans"]}
                for tid, sid in spans:
                    if by_span.get(sid.hex(), {}).get("cpu_ns") != truth.get((tid, sid), 0):
                        return False
            return True
        wait_until(api_matches)

        trace_a = spanprof.get(f"/api/v1/traces/{early[0][0].hex()}")
        assert trace_a["span_count"] == 3
        root = next(s for s in trace_a["spans"] if s["span_id"] == early[0][1].hex())
        assert root["name"] == "place_order" and root["service"] == "checkout"
        assert root["top_functions"][0]["name"] == "json.dumps"
        for s in trace_a["spans"]:
            assert s["off_cpu_ns"] == max(0, s["duration_ns"] - s["cpu_ns"])
            assert set(s) >= {"trace_id", "span_id", "service", "name", "duration_ns",
                              "cpu_ns", "off_cpu_ns", "sample_count", "top_functions"}
        wall_root = next(s for s in spanprof.get(
            f"/api/v1/traces/{later[0][0][0].hex()}")["spans"]
            if s["span_id"] == later[0][0][1].hex())
        assert wall_root["wall_ns"] == 500 * MS and wall_root["cpu_ns"] == 0
        top = spanprof.get("/api/v1/spans?order=cpu&limit=3&service=checkout")["spans"]
        assert [s["cpu_ns"] for s in top] == sorted(truth.values(), reverse=True)[:3]

        assert spanprof.stop() == 0

        # 4. the same truth, straight from ClickHouse
        with clickhouse(spanprof.data) as ch:
            rows = ch.query("SELECT trace_id, span_id, cpu_ns, name FROM "
                            "spanprof.span_attribution_totals WHERE method = 'link'"
                            ).result_rows
            got = {(bytes.fromhex(t), bytes.fromhex(s)): (cpu, name) for t, s, cpu, name in rows}
            all_spans = [k for spans in [early, *later] for k in spans]
            for key in all_spans:
                assert got[key][0] == truth.get(key, 0), key
                assert got[key][1], "span metadata missing"
            # late samples really arrived after the first row: more than one row per B span
            late_rows = ch.query(
                "SELECT span_id, count() FROM spanprof.span_attribution WHERE span_id IN "
                "{s:Array(String)} GROUP BY span_id",
                parameters={"s": [spans[2][1].hex() for spans in later]}).result_rows
            assert len(late_rows) == len(later) and all(n >= 2 for _, n in late_rows)
            assert ch.query("SELECT count() FROM spanprof.profile_samples").result_rows[0][0] \
                == sent_samples
            assert ch.query("SELECT sum(cpu_ns) FROM spanprof.unattributed_cpu FINAL "
                            "WHERE service = 'checkout'").result_rows[0][0] == 30 * MS
            n_traces = ch.query("SELECT count() FROM spanprof.otel_traces").result_rows[0][0]
            assert n_traces == len(all_spans)

    def test_keeps_serving_after_bad_requests(self, spanprof: SpanprofProcess) -> None:
        """Garbage bytes and an inconsistent profile dictionary get INVALID_ARGUMENT and a
        partial success; the running pipeline then still accepts and stores good data."""
        spanprof.start()
        channel = grpc.insecure_channel(spanprof.grpc_target)
        raw = channel.unary_unary(
            "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export",
            request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xfe garbage \x00\x01", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        b = ProfileBuilder()
        tid, sid = bytes(range(1, 17)), bytes(range(1, 9))
        b.sample(["ok"], 5 * MS, tid, sid, service="a")
        bad = b.sample(["bad"], 5 * MS, tid, sid, service="b")
        bad.stack_index = 999  # out of range
        resp = profiles_stub(channel).Export(b.build(), timeout=10)
        assert resp.partial_success.rejected_profiles == 1
        assert "stack_index 999 out of range" in resp.partial_success.error_message
        # the good sample waits in the correlator for its span: the gauges say so
        with urllib.request.urlopen(spanprof.admin + "/metrics", timeout=10) as got:
            text = got.read().decode()
        held = dict(line.rsplit(" ", 1) for line in text.splitlines() if "_state_" in line)
        # the service's own event-loop lag histogram is exported beside the components'
        assert 'spanprof_event_loop_lag_seconds_bucket{le="+Inf"}' in text
        labels = 'connector="spancorrelator",tenant="default"'
        assert held[f"spanprof_connector_state_entries{{{labels}}}"] == "1"
        assert int(held[f"spanprof_connector_state_bytes{{{labels}}}"]) > 500
        assert 'spanprof_tenant_accepted_samples_total{tenant="default"} 1' in text
        traces_raw = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            traces_raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)  # truncated field
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert spanprof.get("/health")["status"] == "ok"
        assert spanprof.stop() == 0
        with clickhouse(spanprof.data) as ch:
            assert ch.query("SELECT service, sum(value) FROM spanprof.profile_samples "
                            "GROUP BY service").result_rows == [("a", 5 * MS)]
            # held as an orphan (its span never came) and reported at shutdown, not lost
            assert ch.query("SELECT cpu_ns, span_known FROM spanprof.span_attribution_totals"
                            ).result_rows == [(5 * MS, 0)]

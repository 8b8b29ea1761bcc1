"""``otel_traces`` as the OpenTelemetry Collector's ClickHouse exporter makes it: spans
loaded through spanprof (OTLP decoding, then the exporter), then the queries its users and
Grafana run, on the columns and types the Collector's DDL declares."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tps
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.otlp.traces import decode_traces
from pipeline.registry import Context

NS = 1_000_000_000
T0 = 1_700_000_000 * NS
TRACE = bytes.fromhex("391dae938234560b16bb63f51501cb6f")

# the Collector exporter's otel_traces columns and types (its traces_table.sql, Map flavour)
COLLECTOR_TRACES = {
    "Timestamp": "DateTime64(9)", "TraceId": "String", "SpanId": "String",
    "ParentSpanId": "String", "TraceState": "String", "SpanName": "LowCardinality(String)",
    "SpanKind": "LowCardinality(String)", "ServiceName": "LowCardinality(String)",
    "ResourceAttributes": "Map(LowCardinality(String), String)", "ScopeName": "String",
    "ScopeVersion": "String", "SpanAttributes": "Map(LowCardinality(String), String)",
    "Duration": "UInt64", "StatusCode": "LowCardinality(String)", "StatusMessage": "String",
    "Events.Timestamp": "Array(DateTime64(9))", "Events.Name": "Array(LowCardinality(String))",
    "Events.Attributes": "Array(Map(LowCardinality(String), String))",
    "Links.TraceId": "Array(String)", "Links.SpanId": "Array(String)",
    "Links.TraceState": "Array(String)",
    "Links.Attributes": "Array(Map(LowCardinality(String), String))",
}
COLLECTOR_TRACE_ID_TS = {"TraceId": "String", "Start": "DateTime", "End": "DateTime"}


def request() -> tps.ExportTraceServiceRequest:
    req = tps.ExportTraceServiceRequest()
    for service, n_spans, dur_s in (("clickhouse-exporter", 3, 2), ("other", 2, 0)):
        rs = req.resource_spans.add()
        rs.resource.attributes.append(KeyValue(key="service.name",
                                               value=AnyValue(string_value=service)))
        ss = rs.scope_spans.add()
        ss.scope.name, ss.scope.version = "lib", "1.0"
        for i in range(n_spans):
            tid = TRACE if service == "clickhouse-exporter" else bytes([9]) * 16
            s = ss.spans.add(trace_id=tid, span_id=bytes([i + 1, len(service)]) + bytes(6),
                             name=f"op{i}", kind=2, start_time_unix_nano=T0 + i * NS,
                             end_time_unix_nano=T0 + i * NS + (i + 1) * dur_s * NS // 2 + 1000)
            s.attributes.append(KeyValue(key="peer.service",
                                         value=AnyValue(string_value="tracegen-server")))
            ev = s.events.add(time_unix_nano=T0 + i * NS + 5, name="event")
            ev.attributes.append(KeyValue(key="k", value=AnyValue(int_value=1)))
            s.links.add(trace_id=bytes([7]) * 16, span_id=bytes([7]) * 8)
            s.status.code = 2 if i == 0 else 0
    return req


class TestCollectorCompatibility:
    async def test_collector_queries_run_on_spanprof_tables(self, tmp_path: Path) -> None:
        ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                       ttl=0),  # type: ignore[arg-type]
                                Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
        await ex.start()
        decoded = decode_traces(request())
        assert decoded.rejected == 0
        await ex.consume(decoded.batch)

        for table, want in (("otel_traces", COLLECTOR_TRACES),
                            ("otel_traces_trace_id_ts", COLLECTOR_TRACE_ID_TS)):
            _, cols = await ex.query(
                "SELECT name, type FROM system.columns WHERE database = 'spanprof' "
                "AND table = {t:String}", {"t": table})
            got = dict(cols)
            assert {k: got.get(k) for k in want} == want, table

        # a trace by id, through the lookup table (the exporter's documented query shape)
        _, rows = await ex.query(f"""
WITH '{TRACE.hex()}' AS trace_id,
     (SELECT min(Start) FROM spanprof.otel_traces_trace_id_ts WHERE TraceId = trace_id) AS start,
     (SELECT max(End) + 1 FROM spanprof.otel_traces_trace_id_ts WHERE TraceId = trace_id) AS end
SELECT Timestamp, TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, Duration,
       StatusCode, StatusMessage, toString(SpanAttributes), toString(ResourceAttributes),
       toString(Events.Name), toString(Links.TraceId)
FROM spanprof.otel_traces
WHERE TraceId = trace_id AND Timestamp >= start AND Timestamp <= end
ORDER BY Timestamp LIMIT 100""")
        assert [(r[4], r[5], r[6], r[8]) for r in rows] == [
            ("op0", "Server", "clickhouse-exporter", "Error"),
            ("op1", "Server", "clickhouse-exporter", "Unset"),
            ("op2", "Server", "clickhouse-exporter", "Unset")]
        assert rows[0][10] == "{'peer.service':'tracegen-server'}"
        assert rows[0][12] == "['event']" and rows[0][13] == f"['{'07' * 16}']"

        # spans of a service with a long duration, slowest first
        _, rows = await ex.query("""
SELECT SpanName, Duration / 1e9 AS seconds FROM spanprof.otel_traces
WHERE ServiceName = 'clickhouse-exporter' AND Duration > 1 * 1e9
ORDER BY Duration DESC""")
        assert [r[0] for r in rows] == ["op2", "op1", "op0"]  # 3 s, 2 s, 1 s (+1 us)
        # spans with a given attribute
        _, rows = await ex.query("""
SELECT count() FROM spanprof.otel_traces
WHERE SpanAttributes['peer.service'] = 'tracegen-server'""")
        assert rows == [(5,)]
        await ex.shutdown()

"""Files written the way the Collector's ``file`` exporter writes them (see the module
docstring of pipeline/backfill/otlp_files.py for the sources): for the backfill tests and
fuzz.

* ``json_lines``: one OTLP/JSON object per line, ``\\n`` after each; JSON as pdata's
  ``JSONMarshaler`` writes it (camelCase, hex ids, 64-bit integers as strings);
* ``prefixed``: each message after its length, 4 bytes big-endian;
* ``legacy_zstd``: each message compressed alone (one zstd frame), then length-prefixed,
  JSON too (the exporter's default ``compression: zstd``);
* ``native_zstd``: the whole content one zstd stream, one frame per write
  (``exporter.file.nativeCompression`` with rotation).
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.otlp.builder import ProfileBuilder
from pipeline.otlp.jsonwire import HEX_FIELDS

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

T0 = 1_760_000_000_000_000_000


def traces(n: int = 2, seed: int = 1) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = f"svc{seed}"
    ss = rs.scope_spans.add()
    for i in range(n):
        ss.spans.add(trace_id=bytes([seed]) * 16, span_id=bytes([seed, i + 1]) * 4,
                     name=f"op{i}", start_time_unix_nano=T0 + i,
                     end_time_unix_nano=T0 + i + 1_000_000, kind=2)
    return req


def profiles(seed: int = 1) -> Any:
    b = ProfileBuilder()
    b.sample(["main", f"work{seed}"], 10_000_000, bytes([seed]) * 16, bytes([seed, 1]) * 4,
             service=f"svc{seed}", time_unix_nano=T0,
             attributes={"thread.name": f"worker{seed}", "thread.id": seed})
    b.sample(["main", "idle"], 20_000_000, service=f"svc{seed}", time_unix_nano=T0)
    return b.build()


def otlp_json(msg: Message) -> bytes:
    def hexify(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: base64.b64decode(v).hex() if k in HEX_FIELDS and isinstance(v, str)
                    else hexify(v) for k, v in node.items()}
        if isinstance(node, list):
            return [hexify(v) for v in node]
        return node
    doc = hexify(json_format.MessageToDict(msg, use_integers_for_enums=True))
    return json.dumps(doc, separators=(",", ":")).encode()


def json_lines(msgs: list[Message]) -> bytes:
    return b"".join(otlp_json(m) + b"\n" for m in msgs)


def frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def prefixed(msgs: list[Message]) -> bytes:
    return b"".join(frame(m.SerializeToString()) for m in msgs)


def legacy_zstd(msgs: list[Message], fmt: str = "proto") -> bytes:
    return b"".join(frame(zstd.compress(otlp_json(m) if fmt == "json" else
                                        m.SerializeToString())) for m in msgs)


def native_zstd(content: bytes, writes: int = 2) -> bytes:
    step = max(1, len(content) // writes)
    return b"".join(zstd.compress(content[i:i + step]) for i in range(0, len(content), step))

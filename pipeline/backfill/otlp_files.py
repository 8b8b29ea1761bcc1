"""What the Collector's ``file`` exporter writes, read back into pieces (``files.read``
gives this module a file ``detect`` found to be OTLP, opened and counted).

What the Collector writes (opentelemetry-collector-contrib ``exporter/fileexporter``):

* ``format: json`` (the default): one OTLP/JSON object per line, each followed by ``\\n``
  (``file_writer.go``, ``exportMessageAsLine``), marshalled by pdata's ``JSONMarshaler``
  (``marshaller.go``): an ``ExportTraceServiceRequest`` / ``ExportProfilesServiceRequest``
  as JSON, hex ids.
* ``format: proto``: each message preceded by its length as a 4-byte big-endian unsigned
  integer (``file_writer.go``, ``exportMessageAsBuffer``: ``binary.BigEndian.PutUint32``).
  The message is pdata's ``ProtoMarshaler`` output: the export request. For profiles
  (the exporter takes profiles since ``factory.go`` registers ``xexporter.WithProfiles``)
  that is ``ExportProfilesServiceRequest`` (collector ``pdata/pprofile``: ``Profiles``
  wraps it, ``MarshalProfiles`` serialises it), whose field numbers are those of
  ``ProfilesData`` (``resource_profiles = 1``, ``dictionary = 2``), as
  ``ExportTraceServiceRequest``'s are ``TracesData``'s (``resource_spans = 1``).
* ``compression: zstd``, by default (feature gate ``exporter.file.nativeCompression``
  off): each marshalled message is compressed alone into one zstd frame (``codec.go``,
  ``zstdCompress``: ``EncodeAll``) and written length-prefixed as above, JSON included
  (``buildExportFunc``: json with compression uses ``exportMessageAsBuffer``). With the
  gate on (alpha, v0.154.0, ``internal/metadata/generated_feature_gates.go``) the file is
  one zstd stream of one or more frames (``compression_writer.go``: one frame per write
  when rotating, else one stream) around JSON lines or length-prefixed protobuf. Both are
  read here: a file that starts with the zstd magic is a stream (``files.read`` inflates
  it), a length-prefixed message that does is one frame.
* the ``otlpjsonfile`` receiver reads the JSON form back one line (a ``fileconsumer``
  token) per request, ``JSONUnmarshaler`` per line (``receiver/otlpjsonfilereceiver/
  file.go``), its default line limit 1 MiB (``fileconsumer``'s ``defaultMaxLogSize``);
  here a line may be up to ``max_message_bytes``.

Bounds, each checked before the bytes it guards are read or parsed: a length prefix over
``max_message_bytes`` stops the file (nothing after it can be framed); a JSON line over it
is refused unparsed and reading goes on at the next line; one zstd frame inflating past it
is refused. A malformed line is a ``Bad`` and the next line is read; a malformed
length-prefixed message is a ``Bad`` and the next one is read (its length framed it); a
truncated prefix or message ends the file with a ``Bad``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.backfill.file_content import ZSTD_MAGIC, Content, ZstdError, unzstd
from pipeline.backfill.file_pieces import DECODE_FAULTS, Bad, Item, Kind, Limits, Origin, Piece
from pipeline.backfill.sniff import Signal, json_signal, proto_signal
from pipeline.errors import TooLarge
from pipeline.otlp import jsonwire
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces

_REQUEST: dict[str, Any] = {"traces": ExportTraceServiceRequest,
                            "profiles": ExportProfilesServiceRequest}


def lines(f: Content, path: Path, kind: Kind, limits: Limits) -> Iterator[Item]:
    """The pieces of an OTLP/JSON file, one per line."""
    cap = limits.max_message_bytes
    n = 0
    while line := f.readline(cap + 1):
        n += 1
        origin = Origin(path, "line", n)
        if len(line) > cap and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass  # the rest of the line, read and dropped
            yield Bad(origin, f"{origin}: line over max_message_bytes={cap}, not parsed",
                      True)
            continue
        if line.strip():
            yield _json(line.removesuffix(b"\n"), origin, kind.signal, limits)


def _json(data: bytes, origin: Origin, default: Signal | None, limits: Limits) -> Item:
    try:
        doc = jsonwire.loads(data, "line")
        signal = json_signal(doc) or default or "traces"
        req = jsonwire.from_doc(doc, _REQUEST[signal])
        return _decoded(origin, signal, req, limits, len(data))
    except DECODE_FAULTS as err:
        return Bad(origin, f"{origin}: {err}", isinstance(err, TooLarge))


def _decoded(origin: Origin, signal: Signal, req: Any, limits: Limits, size: int) -> Piece:
    if signal == "traces":
        t = decode_traces(req)
        return Piece(origin, t.batch, t.rejected, t.message, size)
    p = decode_profiles(req, max_records=limits.max_records)
    return Piece(origin, p.batch, p.rejected, p.message, size)


def messages(f: Content, path: Path, kind: Kind, limits: Limits) -> Iterator[Item]:
    """The pieces of a file of length-prefixed messages, one per message."""
    cap = limits.max_message_bytes
    while True:
        origin = Origin(path, "byte", f.pos)
        prefix = f.read(4)
        if not prefix:
            return
        if len(prefix) < 4:
            yield Bad(origin, f"{origin}: truncated: {len(prefix)} bytes of a 4-byte length")
            return
        n = int.from_bytes(prefix, "big")
        if n > cap:
            yield Bad(origin, f"{origin}: length prefix {n} over max_message_bytes={cap}: "
                      "the rest of the file cannot be framed", True)
            return
        data = f.read(n)
        if len(data) < n:
            yield Bad(origin, f"{origin}: truncated: {len(data)} of the {n} bytes its "
                      "length prefix gives")
            return
        yield _message(data, origin, kind.signal, limits)


def _message(data: bytes, origin: Origin, default: Signal | None, limits: Limits) -> Item:
    try:
        if data[:4] == ZSTD_MAGIC:  # compressed alone (the exporter's default zstd)
            data = unzstd(data, limits.max_message_bytes)
        if data[:1] == b"{":  # json + zstd is length-prefixed too (no protobuf starts so:
            # field 15, a group, is in no OTLP request)
            return _json(data, origin, default, limits)
        signal = proto_signal(data) or default or "traces"
        return _decoded(origin, signal, _REQUEST[signal].FromString(data), limits, len(data))
    except DECODE_FAULTS as err:
        return Bad(origin, f"{origin}: {err}", isinstance(err, TooLarge))
    except ZstdError as err:
        return Bad(origin, f"{origin}: not valid zstd: {err}")

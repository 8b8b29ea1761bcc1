"""The files a backfill reads (issue #15): what the Collector's ``file`` exporter writes,
pprof and JFR files; plain, gzip or zstd; named one by one, by glob or by directory.

``expand`` turns the paths a user gives into files, ``detect`` says what a file is from its
first bytes, ``read`` yields its pieces: each a decoded batch (``SpanBatch`` or
``ProfileBatch``) with where it came from (``Origin``: file, and line or byte offset) and
what its decoder refused, or a ``Bad`` naming the file, the place and why. Nothing here
raises on a file's content, and nothing is skipped without a ``Bad``.

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
  read here: a file that starts with the zstd magic is a stream, a length-prefixed
  message that does is one frame.
* the ``otlpjsonfile`` receiver reads the JSON form back one line (a ``fileconsumer``
  token) per request, ``JSONUnmarshaler`` per line (``receiver/otlpjsonfilereceiver/
  file.go``), its default line limit 1 MiB (``fileconsumer``'s ``defaultMaxLogSize``);
  here a line may be up to ``max_message_bytes``.

Files are told apart by content, not by name: gzip (``1f 8b``) and zstd (``28 b5 2f fd``)
are inflated as a stream; then JFR starts ``FLR\\0``; OTLP/JSON with ``{``; a first byte
below ``0x08`` cannot start a protobuf message (field number 0) and is the high byte of a
length prefix (every length under 128 MiB has one); any other binary is pprof (what
Pyroscope SDKs write, gzipped or not), and text that is not JSON is refused.

Bounds, each checked before the bytes it guards are read or parsed: a length prefix over
``max_message_bytes`` stops the file (nothing after it can be framed); a JSON line over it
is refused unparsed and reading goes on at the next line; a pprof or JFR file, or one
zstd frame, over it is refused; all of one file after decompression is at most
``max_file_bytes`` (a gzip or zstd bomb stops there). A malformed line is a ``Bad`` and the
next line is read; a malformed length-prefixed message is a ``Bad`` and the next one is
read (its length framed it); a truncated prefix or message ends the file with a ``Bad``.
"""

from __future__ import annotations

import glob
import gzip
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.backfill.sniff import Signal, json_head_signal, json_signal, proto_signal
from pipeline.errors import InvalidData, TooLarge
from pipeline.otlp import jsonwire
from pipeline.otlp.bounds import MAX_RECORDS
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.pyroscope import jfringest, pprof
from pipeline.records import ProfileBatch, SpanBatch

if sys.version_info >= (3, 14):
    from compression import zstd
else:  # the PEP 784 backport (the same API)
    from backports import zstd

Format = Literal["otlp-json", "otlp-proto", "pprof", "jfr"]
Compression = Literal["", "gzip", "zstd"]
Unit = Literal["line", "byte", "file"]

GZIP_MAGIC, ZSTD_MAGIC, JFR_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"FLR\0"
HEAD_BYTES = 64 << 10  # what ``read`` gives ``detect``
PROFILE_SUFFIXES = (".gz", ".zst", ".pb", ".pprof", ".prof", ".jfr", ".bin")
# what the decoders raise for input they cannot read: a Bad, never an exception
_FAULTS = (InvalidData, DecodeError, json_format.ParseError, ValueError, TypeError,
           RecursionError, OverflowError)
_STREAM_FAULTS = (OSError, EOFError, zlib.error, zstd.ZstdError)


class Kind(NamedTuple):
    format: Format
    signal: Signal | None  # None: decided per line or message (or no OTLP)
    compression: Compression  # of the whole file


class Limits(NamedTuple):
    max_message_bytes: int = 64 << 20  # a line, a message, a frame, a pprof/JFR file
    max_file_bytes: int = 16 << 30  # one file, after decompression
    max_records: int = MAX_RECORDS  # sample records of one OTLP profiles request
    pyroscope: pprof.Limits = pprof.DEFAULT_LIMITS  # one pprof or JFR file
    sample_rate: int = 100  # Hz, for JFR ticks (Pyroscope's default)


DEFAULT_LIMITS = Limits()


class Origin(NamedTuple):
    path: Path
    unit: Unit
    at: int  # line number from 1; byte offset of the length prefix (in the decompressed
    # content); 0 for a whole file

    def __str__(self) -> str:
        if self.unit == "line":
            return f"{self.path}:{self.at}"
        if self.unit == "byte":
            return f"{self.path} at byte {self.at}"
        return str(self.path)


class Piece(NamedTuple):
    origin: Origin
    batch: SpanBatch | ProfileBatch
    rejected: int  # items the decoder refused (``partial_success``'s count)
    message: str  # and why, naming the first few
    size: int  # bytes of the unit (after decompression)


class Bad(NamedTuple):
    origin: Origin
    error: str  # names the file and the place
    too_large: bool = False


Item = Piece | Bad


def expand(paths: list[str]) -> list[Path]:
    """The files ``paths`` name: files as given, glob patterns (``**`` recursive),
    directories with every file under them (names starting with ``.`` left out); each once,
    sorted. A JFR labels snapshot (``X.labels[.gz]``) beside its recording ``X.jfr[.gz]``
    is not a file of its own: ``read`` takes it with the recording. ``InvalidData`` naming
    every path that matches nothing."""
    found: set[Path] = set()
    missing: list[str] = []
    for p in paths:
        if glob.has_magic(p):
            hits = [Path(h) for h in glob.glob(p, recursive=True)]
            files = [h for h in hits if h.is_file()]
            files += [f for h in hits if h.is_dir() for f in _tree(h)]
        elif Path(p).is_dir():
            files = _tree(Path(p))
        elif Path(p).is_file():
            files = [Path(p)]
        else:
            files = []
        if not files:
            missing.append(p)
        found.update(files)
    if missing:
        raise InvalidData("no such file, or nothing in it: " + ", ".join(missing))
    return sorted(f for f in found if _jfr_of(f) not in found)


def _tree(d: Path) -> list[Path]:
    return [f for f in d.rglob("*") if f.is_file()
            and not any(part.startswith(".") for part in f.relative_to(d).parts)]


def _jfr_of(labels: Path) -> Path | None:
    """The recording a labels snapshot belongs to, by name."""
    for suffix in (".labels", ".labels.gz"):
        if labels.name.endswith(suffix):
            base = labels.name[: -len(suffix)]
            for ext in (".jfr", ".jfr.gz"):
                rec = labels.with_name(base + ext)
                if rec.is_file():
                    return rec
    return None


def detect(path: Path, head: bytes) -> Kind:
    """What a file is, from its first bytes (``HEAD_BYTES`` is enough; module docstring).
    ``InvalidData`` naming ``path`` for text that is not OTLP/JSON or a head that cannot
    be inflated. An empty file is OTLP/JSON with no lines."""
    compression: Compression = ""
    inner = head
    try:
        if head[:2] == GZIP_MAGIC:
            compression = "gzip"
            inner = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, HEAD_BYTES)
        elif head[:4] == ZSTD_MAGIC:
            compression = "zstd"
            inner = zstd.ZstdDecompressor().decompress(head, HEAD_BYTES)
    except (zlib.error, zstd.ZstdError) as err:
        raise InvalidData(f"{path}: not valid {compression}: {err}") from None
    if inner[:4] == JFR_MAGIC:
        return Kind("jfr", "profiles", compression)
    text = inner.lstrip(b" \t\r\n")
    if not text or text[:1] == b"{" and _is_text(inner[:1024]):
        return Kind("otlp-json", json_head_signal(inner), compression)
    if inner[0] < 0x08:
        n = int.from_bytes(inner[:4], "big")
        first = inner[4:4 + n]
        return Kind("otlp-proto", proto_signal(first) if len(first) == n and
                    first[:4] != ZSTD_MAGIC else None, compression)
    if _is_text(inner[:1024]):
        raise InvalidData(f"{path}: text that is not OTLP/JSON (no '{{' at the start)")
    return Kind("pprof", "profiles", compression)


def _is_text(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError as err:
        if err.start < len(b) - 4:  # else a character cut by the head's end
            return False
    return all(x >= 0x20 or x in b"\t\r\n" for x in b)


def read(path: Path, limits: Limits = DEFAULT_LIMITS, service: str = "") -> Iterator[Item]:
    """The pieces of one file (module docstring); ``service`` names the service of pprof
    and JFR samples (default: the file's name less its extensions)."""
    whole = Origin(path, "file", 0)
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
        kind = detect(path, head)
    except OSError as err:
        yield Bad(whole, f"{path}: cannot read it: {err.strerror or err}")
        return
    except InvalidData as err:
        yield Bad(whole, str(err))
        return
    try:
        stream = _Bounded(_open(path, kind.compression), limits.max_file_bytes)
    except OSError as err:
        yield Bad(whole, f"{path}: cannot read it: {err.strerror or err}")
        return
    with stream:
        try:
            if kind.format == "otlp-json":
                yield from _lines(stream, path, kind, limits)
            elif kind.format == "otlp-proto":
                yield from _messages(stream, path, kind, limits)
            else:
                yield _profile_file(stream, path, kind, limits, service)
        except TooLarge as err:  # max_file_bytes
            yield Bad(Origin(path, "byte", stream.pos), f"{path}: {err}", True)
        except _STREAM_FAULTS as err:
            yield Bad(Origin(path, "byte", stream.pos),
                      f"{path}: cannot read past byte {stream.pos} of its "
                      f"{kind.compression or 'content'}: {err}")


class _Source(Protocol):
    """A file object (plain, ``GzipFile``, ``ZstdFile``): what ``_Bounded`` reads."""

    def read(self, size: int = -1, /) -> bytes: ...
    def readline(self, size: int = -1, /) -> bytes: ...
    def close(self) -> None: ...


def _open(path: Path, compression: Compression) -> _Source:
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        return zstd.ZstdFile(path, "rb")
    return open(path, "rb")


class _Bounded:
    """A file's content (decompressed), counted: over ``limit`` bytes is ``TooLarge``."""

    def __init__(self, f: _Source, limit: int) -> None:
        self.f, self.limit, self.pos = f, limit, 0

    def __enter__(self) -> _Bounded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def _count(self, b: bytes) -> bytes:
        self.pos += len(b)
        if self.pos > self.limit:
            raise TooLarge(f"more than max_file_bytes={self.limit} bytes (decompressed)")
        return b

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, fewer only at the end."""
        chunks, got = [], 0
        while got < n:
            b = self.f.read(min(n - got, 1 << 20))
            if not b:
                break
            chunks.append(self._count(b))
            got += len(b)
        return b"".join(chunks)

    def readline(self, n: int) -> bytes:
        return self._count(self.f.readline(n))


def _lines(f: _Bounded, path: Path, kind: Kind, limits: Limits) -> Iterator[Item]:
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
    except _FAULTS as err:
        return Bad(origin, f"{origin}: {err}", isinstance(err, TooLarge))


_REQUEST: dict[str, Any] = {"traces": ExportTraceServiceRequest,
                            "profiles": ExportProfilesServiceRequest}


def _decoded(origin: Origin, signal: Signal, req: Any, limits: Limits, size: int) -> Piece:
    if signal == "traces":
        t = decode_traces(req)
        return Piece(origin, t.batch, t.rejected, t.message, size)
    p = decode_profiles(req, limits.max_records)
    return Piece(origin, p.batch, p.rejected, p.message, size)


def _messages(f: _Bounded, path: Path, kind: Kind, limits: Limits) -> Iterator[Item]:
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
    except _FAULTS as err:
        return Bad(origin, f"{origin}: {err}", isinstance(err, TooLarge))
    except zstd.ZstdError as err:
        return Bad(origin, f"{origin}: not valid zstd: {err}")


def unzstd(data: bytes, limit: int) -> bytes:
    """zstd frames (one or more) inflated, never to more than ``limit`` bytes."""
    out: list[bytes] = []
    room = limit
    while data:
        d = zstd.ZstdDecompressor()
        chunk = d.decompress(data, room + 1)
        room -= len(chunk)
        if room < 0:
            raise TooLarge(f"zstd frame inflates to more than max_message_bytes={limit}")
        if not d.eof:
            raise InvalidData("truncated zstd frame")
        out.append(chunk)
        data = d.unused_data
    return b"".join(out)


def _profile_file(f: _Bounded, path: Path, kind: Kind, limits: Limits,
                  service: str) -> Item:
    whole = Origin(path, "file", 0)
    cap = limits.max_message_bytes
    data = f.read(cap + 1)
    if len(data) > cap:
        return Bad(whole, f"{path}: over max_message_bytes={cap} (decompressed)", True)
    service = service or _service_of(path)
    try:
        if kind.format == "jfr":
            batch = jfringest.decode_jfr(data, _labels_of(path, cap), service,
                                         limits.sample_rate, cap, limits.pyroscope)
        else:
            batch = pprof.decode_pprof(data, service, cap, None, limits.pyroscope)
    except _FAULTS as err:
        return Bad(whole, f"{path}: {err}", isinstance(err, TooLarge))
    return Piece(whole, batch, 0, "", len(data))


def _service_of(path: Path) -> str:
    name = path.name
    while (suffix := next((s for s in PROFILE_SUFFIXES if name.endswith(s)), "")) \
            and len(name) > len(suffix):
        name = name[: -len(suffix)]
    return name


def _labels_of(recording: Path, cap: int) -> bytes:
    """The labels snapshot beside a JFR recording (``X.labels[.gz]`` for ``X.jfr[.gz]``),
    within ``cap`` bytes (``decode_jfr`` inflates it within ``cap``); none: b""."""
    base = recording.name.removesuffix(".gz").removesuffix(".jfr")
    for name in (base + ".labels", base + ".labels.gz"):
        p = recording.with_name(name)
        if p.is_file():
            try:
                with open(p, "rb") as f:
                    data = f.read(cap + 1)
            except OSError as err:
                raise InvalidData(f"{p}: cannot read it: {err.strerror or err}") from None
            if len(data) > cap:
                raise TooLarge(f"{p}: over max_message_bytes={cap}")
            return data
    return b""

"""The files a backfill reads (issue #15): what the Collector's ``file`` exporter writes,
pprof and JFR files; plain, gzip or zstd; named one by one, by glob or by directory.

``expand`` turns the paths a user gives into files, ``detect`` says what a file is from its
first bytes, ``read`` yields its pieces (``file_pieces.py``): each a decoded batch with
where it came from and what its decoder refused, or a ``Bad`` naming the file, the place
and why. Nothing here raises on a file's content, and nothing is skipped without a ``Bad``.
The Collector's formats are read by ``otlp_files.py`` (its docstring says what the
Collector writes); a pprof or JFR file is one piece, read here.

Files are told apart by content, not by name: gzip (``1f 8b``) and zstd (``28 b5 2f fd``)
are inflated as a stream (``file_content.py``); then JFR starts ``FLR\\0``; OTLP/JSON with
``{``; a first byte below ``0x08`` cannot start a protobuf message (field number 0) and is
the high byte of a length prefix (every length under 128 MiB has one); any other binary is
pprof (what Pyroscope SDKs write, gzipped or not), and text that is not JSON is refused.

Bounds, each checked before the bytes it guards are read or parsed: a pprof or JFR file
over ``max_message_bytes`` is refused; all of one file after decompression is at most
``max_file_bytes`` (a gzip or zstd bomb stops there); lines, messages and frames are
bounded as ``otlp_files.py`` says.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

from pipeline.backfill import otlp_files
from pipeline.backfill.file_content import (
    STREAM_FAULTS,
    ZSTD_MAGIC,
    Content,
    inflate_head,
    open_source,
)
from pipeline.backfill.file_pieces import (
    DECODE_FAULTS,
    DEFAULT_LIMITS,
    Bad,
    Item,
    Kind,
    Limits,
    Origin,
    Piece,
)
from pipeline.backfill.sniff import json_head_signal, proto_signal
from pipeline.errors import InvalidData, TooLarge
from pipeline.pyroscope import jfringest, pprof

JFR_MAGIC = b"FLR\0"
HEAD_BYTES = 64 << 10  # what ``read`` gives ``detect``
PROFILE_SUFFIXES = (".gz", ".zst", ".pb", ".pprof", ".prof", ".jfr", ".bin")


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
    compression, inner = inflate_head(path, head, HEAD_BYTES)
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
        stream = Content(open_source(path, kind.compression), limits.max_file_bytes)
    except OSError as err:
        yield Bad(whole, f"{path}: cannot read it: {err.strerror or err}")
        return
    with stream:
        try:
            if kind.format == "otlp-json":
                yield from otlp_files.lines(stream, path, kind, limits)
            elif kind.format == "otlp-proto":
                yield from otlp_files.messages(stream, path, kind, limits)
            else:
                yield _profile_file(stream, path, kind, limits, service)
        except TooLarge as err:  # max_file_bytes
            yield Bad(Origin(path, "byte", stream.pos), f"{path}: {err}", True)
        except STREAM_FAULTS as err:
            yield Bad(Origin(path, "byte", stream.pos),
                      f"{path}: cannot read past byte {stream.pos} of its "
                      f"{kind.compression or 'content'}: {err}")


def _profile_file(f: Content, path: Path, kind: Kind, limits: Limits,
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
    except DECODE_FAULTS as err:
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

"""What reading a backfill file yields, and within which bounds: the vocabulary shared by
``files.py`` (which finds, recognises and opens the files, and reads pprof and JFR) and
``otlp_files.py`` (which reads the Collector's file exporter formats).

A file is read as ``Item``s: each a ``Piece`` (a decoded batch, ``SpanBatch`` or
``ProfileBatch``, with where it came from, ``Origin``: the file, and the line or byte
offset, and what its decoder refused) or a ``Bad`` naming the file, the place and why.
Nothing raises on a file's content (what the decoders raise for input they cannot read,
``DECODE_FAULTS``, becomes a ``Bad``), and nothing is skipped without a ``Bad``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, NamedTuple

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from pipeline.backfill.file_content import Compression
from pipeline.backfill.sniff import Signal
from pipeline.errors import InvalidData
from pipeline.otlp.bounds import MAX_RECORDS
from pipeline.pyroscope import pprof
from pipeline.records import ProfileBatch, SpanBatch

Format = Literal["otlp-json", "otlp-proto", "pprof", "jfr"]
Unit = Literal["line", "byte", "file"]

# what the decoders raise for input they cannot read: a Bad, never an exception
DECODE_FAULTS = (InvalidData, DecodeError, json_format.ParseError, ValueError, TypeError,
                 RecursionError, OverflowError)


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

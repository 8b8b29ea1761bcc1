"""A backfill file's content: opened through its compression and counted as it is read,
and zstd frames inflated within a bound (``files.py`` opens the files, ``otlp_files.py``
meets frames inside them).

gzip (``1f 8b``) and zstd (``28 b5 2f fd``) are told apart by their magic and inflated as
a stream; all of one file after decompression is at most ``max_file_bytes``: ``Content``
raises ``TooLarge`` as soon as a read takes it past that, so a gzip or zstd bomb stops
there. A zstd frame inside a file (a message the Collector's file exporter compressed
alone) inflates to at most ``max_message_bytes`` (``unzstd``).

zstd is the PEP 784 module: the standard library's from Python 3.14, its backport before.
"""

from __future__ import annotations

import gzip
import sys
import zlib
from pathlib import Path
from typing import Literal, Protocol

from pipeline.errors import InvalidData, TooLarge

if sys.version_info >= (3, 14):
    from compression import zstd
else:  # the PEP 784 backport (the same API)
    from backports import zstd

Compression = Literal["", "gzip", "zstd"]

GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
ZstdError = zstd.ZstdError  # a frame that is not valid zstd (``unzstd``)
# what reading a compressed stream raises past a good start: the file ends with a Bad
STREAM_FAULTS = (OSError, EOFError, zlib.error, zstd.ZstdError)


def inflate_head(path: Path, head: bytes, limit: int) -> tuple[Compression, bytes]:
    """A file's compression, from its first bytes, and up to ``limit`` bytes of its content
    inflated from them. ``InvalidData`` naming ``path`` for a head that cannot be
    inflated."""
    compression: Compression = ""
    inner = head
    try:
        if head[:2] == GZIP_MAGIC:
            compression = "gzip"
            inner = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, limit)
        elif head[:4] == ZSTD_MAGIC:
            compression = "zstd"
            inner = zstd.ZstdDecompressor().decompress(head, limit)
    except (zlib.error, zstd.ZstdError) as err:
        raise InvalidData(f"{path}: not valid {compression}: {err}") from None
    return compression, inner


class Source(Protocol):
    """A file object (plain, ``GzipFile``, ``ZstdFile``): what ``Content`` reads."""

    def read(self, size: int = -1, /) -> bytes: ...
    def readline(self, size: int = -1, /) -> bytes: ...
    def close(self) -> None: ...


def open_source(path: Path, compression: Compression) -> Source:
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        return zstd.ZstdFile(path, "rb")
    return open(path, "rb")


class Content:
    """A file's content (decompressed), counted: over ``limit`` bytes is ``TooLarge``."""

    def __init__(self, f: Source, limit: int) -> None:
        self.f, self.limit, self.pos = f, limit, 0

    def __enter__(self) -> Content:
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

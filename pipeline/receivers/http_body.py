"""Reading an HTTP request's body within limits, for the receivers that take one (OTLP/HTTP,
Pyroscope).

The body is read in chunks, counted as it arrives (chunked bodies too), and refused with 413
naming ``max_request_bytes`` as soon as it is over; a gzip body (``Content-Encoding: gzip``
or the gzip magic) is then inflated here, bounded by ``max_decompressed_bytes``. aiohttp's
own decompression is off (``serve(auto_decompress=False)``), so that the limit counts the
bytes the client sent. The whole body must arrive within the listener's ``read_timeout``
(``http.py`` has the connection guards that enforce the other limits).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.streams import StreamReader

from pipeline.errors import InvalidData, TooLarge
from pipeline.receivers.http import GuardedProtocol, ServerLimits
from pipeline.receivers.limits import gunzip_limited


class BodyTimeout(InvalidData):
    """The body did not arrive within ``read_timeout`` (answered 408, connection closed)."""


class UnsupportedEncoding(InvalidData):
    """A ``Content-Encoding`` other than gzip or identity (answered 415)."""


GZIP = ("gzip", "x-gzip")


async def read_body(request: web.Request, max_request_bytes: int,
                    max_decompressed_bytes: int) -> bytes:
    """The request body, within both limits (``TooLarge`` names the key it broke), read in
    chunks and counted as it arrives: a chunked body, which has no Content-Length, is
    refused as soon as it is over, not after it is all in memory. ``BodyTimeout`` when it
    takes longer than the listener's ``read_timeout``."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity", *GZIP):
        raise UnsupportedEncoding(f"Content-Encoding {encoding[:40]!r}: use gzip or none")
    if request.content_length and request.content_length > max_request_bytes:
        raise TooLarge(f"request body of {request.content_length} bytes, over "
                       f"max_request_bytes={max_request_bytes}")
    proto = request.protocol
    timeout = (proto.limits.read_timeout if isinstance(proto, GuardedProtocol)
               else ServerLimits.read_timeout)
    try:
        async with asyncio.timeout(timeout):
            body = await _read_limited(request.content, max_request_bytes)
    except TimeoutError:
        if isinstance(proto, GuardedProtocol):
            proto.close_after_response()
        raise BodyTimeout(f"request body not received within read_timeout={timeout}s"
                          ) from None
    if encoding in GZIP or body[:2] == b"\x1f\x8b":  # gzip, said or not: inflated, bounded
        body = gunzip_limited(body, max_decompressed_bytes, "request body",
                              "max_decompressed_bytes")
    return body


async def _read_limited(content: StreamReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await _next_chunk(content):
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body over max_request_bytes={limit} (refused after "
                           f"{size} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _next_chunk(content: StreamReader) -> bytes:
    try:
        return await content.readany()
    except web.RequestPayloadError as err:  # bad chunked framing, truncated body, ...
        raise InvalidData(f"request body: {err}") from None

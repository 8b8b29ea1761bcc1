"""The legacy ``POST /ingest`` request: which format its body is, and its records.

    /ingest?name=APP.cpu{k=v,...}&from=T&until=T&format=F&sampleRate=HZ&units=U&spyName=S

What the body is, decided as Pyroscope's server decides it, then checked rather than
assumed (its ingest handler: an explicit ``format`` wins; else a multipart form is pprof;
else folded text):

* ``format=pprof``: pprof, raw or gzipped, as the body or the form's ``profile`` part;
* ``format=folded`` (or ``groups``) / ``format=lines``: text (``pipeline/pyroscope/folded.py``);
* no ``format`` (``pyroscope-go``, the most used SDK, sends none): a multipart form is
  pprof (``profile``, and ``sample_type_config``, ``prev_profile``); any other body is
  inflated if it is gzip (within ``max_decompressed_bytes``), then read as pprof if it is
  binary and as folded text if it is text. What fits neither is a 400 saying why for
  both: ``body: not pprof (gzip/protobuf): ...; not folded text: ...``.
* ``format=jfr`` (the Java agent): a form with ``jfr`` and ``labels`` parts, or the
  recording as the body (``pipeline/pyroscope/jfringest.py``);
* other formats (``trie``, ``tree``, ``speedscope``): a 400 naming them.

Times: ``from`` and ``until`` are Unix times in s, ms, us or ns (by their number of
digits, as Pyroscope reads them; ``pyroscope-go`` sends ns). A profile has no time per
sample, so every sample takes the start of the profile's range, ``from`` (else the pprof
``time_nanos``, else now). ``until`` may come before ``from`` (the Go SDK's last upload
truncates it) and is not needed: samples are not placed by time but by their span labels.
"""

from __future__ import annotations

import email.policy
import time
from collections.abc import Mapping
from email.parser import BytesParser
from typing import Any, NamedTuple

from pipeline.errors import InvalidData, TooLarge
from pipeline.otlp import jsonwire
from pipeline.otlp.bounds import time_problem
from pipeline.otlp.common import UNKNOWN_SERVICE
from pipeline.pyroscope import delta, folded, jfringest, pprof
from pipeline.receivers.limits import gunzip_limited
from pipeline.records import ProfileBatch

# legacy app names end with the profile type: "checkout.cpu{env=prod}"
PROFILE_SUFFIXES = (".cpu", ".wall", ".itimer", ".alloc_objects", ".alloc_space",
                    ".inuse_objects", ".inuse_space", ".lock_count", ".lock_duration")
TEXT_FORMATS = {"folded": True, "groups": True, "lines": False}  # -> lines carry a count
OTHER_FORMATS = ("trie", "tree", "speedscope")
TAKEN = "pprof, jfr, folded (groups) and lines"
_DIGIT_UNITS = {13: 1_000_000, 16: 1_000, 19: 1}  # ms, us, ns; any other length: seconds


class Ingested(NamedTuple):
    batch: ProfileBatch
    key: tuple[bytes, ...]  # what identifies the upload, whatever its multipart boundary


def parse_name(name: str) -> tuple[str, dict[str, str], str]:
    """``APP.cpu{k=v,...}`` -> (service, labels, profile type: ``cpu``, or "" if none)."""
    app, _, rest = name.partition("{")
    labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
    kind = ""
    for suffix in PROFILE_SUFFIXES:
        if app.endswith(suffix):
            app, kind = app[: -len(suffix)], suffix[1:]
    service = labels.get("service_name") or app or UNKNOWN_SERVICE
    try:
        service.encode()
    except UnicodeEncodeError:
        raise InvalidData("name: the application name is not valid UTF-8") from None
    return service, labels, kind


def parse_time(value: str, key: str) -> int:
    """A ``from``/``until`` value -> Unix ns (module docstring); absent: 0."""
    if not value:
        return 0
    if not (value.isascii() and value.isdigit()) or len(value) > 19:
        raise InvalidData(f"{key}={value[:40]!r}: not a Unix time (digits: s, ms, us or ns)")
    ns = int(value) * _DIGIT_UNITS.get(len(value), 1_000_000_000)
    problem = time_problem(ns, key)
    if problem:
        raise InvalidData(problem)
    return ns


def parse_sample_type_config(data: bytes) -> dict[str, Any]:
    """The multipart ``sample_type_config`` part: a JSON object (strict: see jsonwire)."""
    doc = jsonwire.loads(data, "sample_type_config")
    if not isinstance(doc, dict):
        raise InvalidData("sample_type_config: expected a JSON object")
    return doc


def parse_multipart(body: bytes, content_type: str) -> dict[str, bytes]:
    """The fields of a multipart form (first of each name), from a body already read within
    the listener's limits (size, time, gzip). The standard library's MIME parser reads it
    from bytes: nothing here waits on the client, counts its bytes a second time, or has
    an error type of its own to leak as a 500; any failure is the form's fault (400)."""
    try:
        msg = BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
        if not msg.is_multipart() or msg.defects:
            found = ", ".join(type(d).__name__ for d in msg.defects) or "no parts"
            raise InvalidData(f"multipart form: cannot parse it ({found})")
        parts: dict[str, bytes] = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if isinstance(name, str) and name not in parts:
                payload = part.get_payload(decode=True)
                parts[name] = payload if isinstance(payload, bytes) else b""
        return parts
    except InvalidData:
        raise
    except Exception as err:  # the parser's own errors: a malformed form
        raise InvalidData(f"multipart form: cannot parse it: {str(err)[:200]}") from None


def _sample_rate(value: str) -> int:
    """``sampleRate`` in Hz; absent, zero or not a number: Pyroscope's default, 100."""
    rate = int(value) if value.isascii() and value.isdigit() and len(value) <= 10 else 0
    return rate if 0 < rate <= 1_000_000_000 else 100


class _Request(NamedTuple):
    service: str
    kind: str  # the app name's profile type
    time_ns: int
    units: str
    sample_rate: int
    max_bytes: int
    limits: pprof.Limits


def _pprof(r: _Request, p: Any, sample_types: dict[str, Any] | None = None,
           prev: bytes = b"") -> ProfileBatch:
    """A parsed pprof (and the previous one, for its cumulative types) -> records."""
    prep = pprof.prepare(p, sample_types, r.limits)
    records = prep.records
    types = delta.cumulative_types(p, sample_types) if prev else []
    if types:
        try:
            q = pprof.parse(prev, r.max_bytes - p.ByteSize())
        except InvalidData as err:
            raise type(err)(f"prev_profile: {err}") from None
        records += len(q.sample)
    if records > r.limits.max_samples:
        raise TooLarge(f"pprof: up to {records} samples, over max_samples_per_request="
                       f"{r.limits.max_samples}")
    if types:
        delta.subtract_previous(p, q, types, r.limits)
    return pprof.build(prep, r.service, pprof.Budget(r.limits), r.time_ns)


def _text(r: _Request, data: bytes, counted: bool = True) -> ProfileBatch:
    if data[:2] == b"\x1f\x8b":
        data = gunzip_limited(data, r.max_bytes, "body", "max_decompressed_bytes")
    kind = folded.kind_of(r.kind, r.units, r.sample_rate)
    return folded.decode_text(data, r.service, r.time_ns or time.time_ns(), kind,
                              pprof.Budget(r.limits), counted)


def _detect(r: _Request, data: bytes) -> ProfileBatch:
    """A body that names no format and is no form: pprof if binary, folded if text. Only
    the question "which is it" is answered here: once a body parses as one, its faults
    are that format's."""
    if data[:2] == b"\x1f\x8b":
        data = gunzip_limited(data, r.max_bytes, "body", "max_decompressed_bytes")
    not_text = folded.text_problem(data)
    if not_text:
        try:
            p = pprof.parse(data, r.max_bytes)
        except TooLarge:
            raise
        except InvalidData as err:
            raise InvalidData(f"body: not pprof (gzip/protobuf): {err}; not folded text: "
                              f"{not_text}") from None
        return _pprof(r, p)
    try:
        return _text(r, data)
    except folded.NotFolded as err:
        raise InvalidData(f"body: not pprof (gzip/protobuf): it is text; {err}") from None


def decode_ingest(query: Mapping[str, str], content_type: str, body: bytes,
                  max_bytes: int, limits: pprof.Limits) -> Ingested:
    """An /ingest request's body, read within the listener's limits -> its records."""
    fmt = query.get("format", "")
    if fmt in OTHER_FORMATS:
        raise InvalidData(f"format={fmt}: not supported; spanprof takes {TAKEN}")
    if fmt and fmt not in ("pprof", "jfr") and fmt not in TEXT_FORMATS:
        raise InvalidData(f"format={fmt[:40]!r}: unknown; spanprof takes {TAKEN}")
    service, _, kind = parse_name(query.get("name", ""))
    r = _Request(service, kind, parse_time(query.get("from", ""), "from"),
                 query.get("units", ""), _sample_rate(query.get("sampleRate", "")),
                 max_bytes, limits)
    multipart = content_type.lower().startswith("multipart/")
    if fmt == "jfr":
        parts = parse_multipart(body, content_type) if multipart else {"jfr": body}
        rec, labels = parts.get("jfr", b""), parts.get("labels", b"")
        return Ingested(jfringest.decode_jfr(rec, labels, service, r.sample_rate, max_bytes,
                                             limits), (rec, labels))
    if multipart:
        parts = parse_multipart(body, content_type)
        data = parts.get("profile", b"")
        if not data:
            raise InvalidData("multipart form has no 'profile' part")
        config, prev = parts.get("sample_type_config", b""), parts.get("prev_profile", b"")
        sample_types = parse_sample_type_config(config) if config else None
        return Ingested(_pprof(r, pprof.parse(data, max_bytes), sample_types, prev),
                        (data, config, prev))
    if fmt == "pprof":
        return Ingested(_pprof(r, pprof.parse(body, max_bytes)), (body,))
    if fmt:
        return Ingested(_text(r, body, TEXT_FORMATS[fmt]), (body,))
    return Ingested(_detect(r, body), (body,))

"""Split an ``ExportTraceServiceRequest`` by trace on its wire bytes, without parsing it.

The gateway passes requests on as they came: copying each span into new messages
(``split.split_traces``) and serialising them again cost more than everything else it
does. Here the spans are cut out of the request's bytes and joined under copies of their
resource and scope headers, so a span costs a few slices. The request must have parsed
already (the receiver did, to validate it): the wire is then well formed.

Field numbers (opentelemetry/proto/trace/v1/trace.proto): ExportTraceServiceRequest
``resource_spans = 1``; ResourceSpans ``resource = 1``, ``scope_spans = 2``,
``schema_url = 3``; ScopeSpans ``scope = 1``, ``spans = 2``, ``schema_url = 3``; Span
``trace_id = 1``. Other fields of ResourceSpans and ScopeSpans (none are defined) are not
carried, as the upb copy in ``split`` does not carry them either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pipeline.errors import InvalidData
from pipeline.otlp.split import MessageKeys

Path = tuple[int, int, int]
_LEN = 2  # wire type of length-delimited fields


def _varint(b: bytes, i: int) -> tuple[int, int]:
    x = b[i]
    if x < 0x80:
        return x, i + 1
    shift, value = 0, 0
    while True:
        x = b[i]
        i += 1
        value |= (x & 0x7F) << shift
        if x < 0x80:
            return value, i
        shift += 7


def _skip(b: bytes, i: int, wire: int) -> int:
    if wire == 0:
        return _varint(b, i)[1]
    if wire == 1:
        return i + 8
    if wire == _LEN:
        n, i = _varint(b, i)
        return i + n
    if wire == 5:
        return i + 4
    raise ValueError(f"unsupported wire type {wire}")


def _fields(b: bytes, start: int, end: int) -> Iterable[tuple[int, int, int, int]]:
    """(field number, start of the whole field, start of its payload, end) of each field;
    a field that is not length-delimited is reported as field 0, its payload start being
    the value's start: every field these splitters read or cut is a message, bytes or a
    string, and upb keeps a scalar under such a number as an unknown field (a hostile
    request's varint field 1 in a request is not a resource)."""
    i = start
    while i < end:
        f0 = i
        tag, i = _varint(b, i)
        wire = tag & 7
        if wire == _LEN:
            n, i = _varint(b, i)
            yield tag >> 3, f0, i, i + n
            i += n
        else:
            j = _skip(b, i, wire)
            yield 0, f0, i, j
            i = j


def nested(data: bytes, start: int, end: int) -> tuple[bytes, list[tuple[int, int]]]:
    """A ResourceSpans/ScopeSpans (or their profile twins) at ``data[start:end]``: its own
    fields (1: resource or scope, 3: schema_url), whole and in order, and the payload bounds
    of each of its field-2 entries (scope_spans, spans...). Other fields (none defined) are
    not carried, as the upb copy in ``split`` does not carry them either."""
    head: list[bytes] = []
    inner: list[tuple[int, int]] = []
    for num, f0, p, q in _fields(data, start, end):
        if num == 2:
            inner.append((p, q))
        elif num in (1, 3):
            head.append(data[f0:q])
    return b"".join(head), inner


def _header(field: int, size: int) -> bytes:
    out = bytearray()
    tag = (field << 3) | _LEN
    for v in (tag, size):
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _trace_id(b: bytes, start: int, end: int) -> bytes:
    """The span's trace id as a parser reads it: the last field 1 (a field given twice is
    the last one's, as upb keeps it; the consumer must find the span under the trace it
    was keyed by). Every field is walked: the native split, the usual path, refuses a
    repeated field and leaves such a request to this one."""
    tid = b""
    for num, _, p, q in _fields(b, start, end):
        if num == 1:
            tid = b[p:q]
    return tid


def split_trace_bytes(data: bytes, rejected: Iterable[Path] = (),
                      bucket_of: Callable[[str], object] | None = None,
                      trace_ids: Sequence[bytes] | None = None) -> dict[str, bytes]:
    """As ``split.split_traces`` (same keys, same grouping), each part serialised.
    ``trace_ids``: every span's trace id as the receiver's parse read it, in order (else
    each span's fields are walked for it).

    The gateway's split when the native one (``pipeline.native``) is not there or leaves
    the request (a field given twice, a refused span): per span it reads the length (two
    bytes for the usual 128 B-16 KiB span, inlined) and the trace id (the parse's; without
    it every field of the span is walked, for the last trace id as a parser keeps it: 2.9
    us a span more than reading the first field), and
    extends its group's last byte range when the span follows it (an SDK exports a
    trace's spans together), so a run of spans is one slice; a group is looked up once
    per trace change. The traces' keys (hex, partition) are made after the loop, all
    hashed together (``MessageKeys.prime``), and the groups of one key merged."""
    skip = set(rejected)
    k = -1  # the span's place in the request
    ids: Sequence[bytes] = () if trace_ids is None else trace_ids
    n_ids = -1 if trace_ids is None else len(ids)
    # (trace id, resource index, scope index) -> [start, end, start, end, ...]: its runs
    # of spans (whole fields), in order
    groups: dict[tuple[bytes, int, int], list[int]] = {}
    view = memoryview(data)
    heads: dict[int, bytes] = {}  # resource index -> its fields other than scope_spans
    scope_heads: dict[tuple[int, int], bytes] = {}
    ri = -1
    for num, _, rs0, rs1 in _fields(data, 0, len(data)):
        if num != 1:
            continue
        ri += 1
        heads[ri], scope_bounds = nested(data, rs0, rs1)
        for si, (rp, rq) in enumerate(scope_bounds):
            shead, pi = [], -1
            last_tid: bytes | None = None
            last: list[int] = []
            i = rp
            while i < rq:  # the ScopeSpans' fields, inlined: this loop runs once per span
                sf0 = i
                if data[i] == 0x12:  # a span (field 2, length-delimited), its tag one byte
                    n = data[i + 1]
                    if n < 0x80:
                        sp = i + 2
                    elif data[i + 2] < 0x80:
                        n = (n & 0x7F) | (data[i + 2] << 7)
                        sp = i + 3
                    else:
                        n, sp = _varint(data, i + 1)
                else:
                    snum_tag, i = _varint(data, i)
                    if snum_tag != 0x12:
                        i = _skip(data, i, snum_tag & 7)
                        if snum_tag in (0x0A, 0x1A):  # scope, schema_url (length-delimited)
                            shead.append(data[sf0:i])
                        continue
                    n, sp = _varint(data, i)  # a span whose tag is longer than it need be
                i = sp + n
                pi += 1
                k += 1
                if skip and (ri, si, pi) in skip:
                    continue
                tid = ids[k] if k < n_ids else _trace_id(data, sp, i)
                if tid != last_tid:
                    got = groups.get((tid, ri, si))
                    last = groups[(tid, ri, si)] = [] if got is None else got
                    last_tid = tid
                if last and last[-1] == sf0:
                    last[-1] = i  # the group's run of spans goes on
                else:
                    last += (sf0, i)
            scope_heads[(ri, si)] = b"".join(shead)
    if n_ids >= 0 and k + 1 != n_ids:  # not the parse's spans after all: walk each span
        return split_trace_bytes(data, rejected, bucket_of)
    parts: dict[str, dict[int, list[bytes]]] = {}  # key -> resource -> its ScopeSpans
    limit, made = split_limit(len(data)), 0
    for (key, r, sc), bounds in _by_key(groups, bucket_of).items():
        inner = b"".join([scope_heads[(r, sc)],
                          *[view[bounds[j]:bounds[j + 1]] for j in range(0, len(bounds), 2)]])
        parts.setdefault(key, {}).setdefault(r, []).extend((_header(2, len(inner)), inner))
        made += len(inner) + len(heads[r])
        if made > limit:
            raise InvalidData(too_much(limit))
    out: dict[str, bytes] = {}
    for key, resources in parts.items():
        msg = []
        for r, scopes in resources.items():
            rs = b"".join([heads[r], *scopes])
            msg.append(_header(1, len(rs)))
            msg.append(rs)
        out[key] = b"".join(msg)
    return out


def split_limit(size: int) -> int:
    """The most bytes a request of ``size`` bytes may become as messages: each message
    repeats its spans' resource and scope fields, so a request with a huge resource and
    thousands of traces (a message per trace when the partition count is unknown) would
    otherwise ask for gigabytes (the native split holds to the same)."""
    return 2 * size + (16 << 20)


def too_much(limit: int) -> str:
    return ("the request's resource and scope fields, repeated in each of its messages (one "
            f"per trace or partition), would make more than {limit} bytes: send fewer traces "
            "per request, or smaller resource and scope attributes")


def _by_key(groups: dict[tuple[bytes, int, int], list[int]],
            bucket_of: Callable[[str], object] | None
            ) -> dict[tuple[str, int, int], list[int]]:
    """The traces' groups under their messages' keys, made in the order the traces came
    (as ``split.split_traces`` makes them); the runs of the traces one key joins, in
    request order, adjacent ones as one."""
    keys = MessageKeys(bucket_of)
    tids = list(dict.fromkeys(tid for tid, _, _ in groups))
    keys.prime(tids)
    key_of = {tid: keys.new(tid) for tid in tids}
    out: dict[tuple[str, int, int], list[int]] = {}
    mixed: set[tuple[str, int, int]] = set()
    for (tid, r, sc), bounds in groups.items():
        mkey = (key_of[tid], r, sc)
        got = out.get(mkey)
        if got is None:
            out[mkey] = bounds
        else:
            got += bounds
            mixed.add(mkey)
    for mkey in mixed:
        flat = out[mkey]
        runs = sorted(zip(flat[::2], flat[1::2], strict=True))
        joined = [runs[0][0], runs[0][1]]
        for a, b in runs[1:]:
            if joined[-1] == a:
                joined[-1] = b
            else:
                joined += (a, b)
        out[mkey] = joined
    return out

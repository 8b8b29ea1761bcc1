"""Split an ``ExportProfilesServiceRequest`` by trace on its wire bytes, as ``wire.py`` does
for spans: each sample is cut out of the request's bytes, not copied field by field.

``split.split_profiles`` copies every sample into a new message and compacts the
dictionary of each part to what its samples reference; that costs more than anything else
a gateway does with a profile (about 8 us a sample). Here the samples are byte ranges and no
index in them changes: every part carries the request's dictionary tables as received,
except its links (a request's biggest table, one entry per span its samples name): a part
keeps the links its samples name at their index, the others become empty entries of two
bytes. Stacks, locations, functions and strings are repeated in each part, so this is only
done when the partition count bounds the parts and the copies add fewer bytes than the
request has (or than ``ROOM``): ``split_profile_bytes`` answers ``None`` otherwise, and the
caller compacts.

Field numbers (opentelemetry/proto/profiles/v1development/profiles.proto, OTLP v1.10):
ExportProfilesServiceRequest ``resource_profiles = 1``, ``dictionary = 2``;
ProfilesDictionary ``link_table = 4``; ResourceProfiles ``resource = 1``,
``scope_profiles = 2``, ``schema_url = 3``; ScopeProfiles ``scope = 1``, ``profiles = 2``,
``schema_url = 3``; Profile ``samples = 2`` (its other fields, all carried, are the
profile's own). The request must have been validated (``profiles.decode_profiles``): its
wire is well formed, its link indices in range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)

from pipeline.otlp.split import MessageKeys
from pipeline.otlp.wire import _fields, _header, _skip, _varint, nested

Path = tuple[int, int, int]
# the dictionary's copies may always add this many bytes (a small request's dictionary is
# often bigger than its samples): over it, only as many as the request has
ROOM = 1 << 16
_NO_LINK = b"\x22\x00"  # an empty link_table entry (ProfilesDictionary field 4)


def split_profile_bytes(req: ExportProfilesServiceRequest, rejected: Iterable[Path] = (),
                        bucket_of: Callable[[str], object] | None = None
                        ) -> dict[str, bytes] | None:
    """As ``split.split_profiles`` (same keys, the same samples under each), each part
    serialised with the dictionary as received but for the links it does not name;
    ``None`` without ``bucket_of`` (one part per trace: the tables would be repeated per
    trace) or when their copies and the empty link entries would outweigh the request
    (beyond ``ROOM`` bytes)."""
    if bucket_of is None:
        return None
    data = req.SerializeToString()  # upb's order: samples as in ``prof.samples``
    skip = set(rejected)
    keys = MessageKeys(bucket_of)
    links = req.dictionary.link_table
    keys.prime([t for t in (bytes(lk.trace_id) for lk in links) if len(t) == 16])
    link_key: dict[int, str] = {}  # link index -> its part's key

    def key_of(li: int) -> str:
        tid = bytes(links[li].trace_id) if 0 < li < len(links) else b""
        if not tid.strip(b"\0"):
            key = ""
        else:
            key = keys.known.get(tid) or keys.new(tid)
        link_key[li] = key
        return key

    dictionary: list[bytes] = []  # its payloads: several merge as their concatenation
    # (key, ri, si, pi) -> runs of whole sample fields [start, end, ...], in order
    groups: dict[tuple[str, int, int, int], list[int]] = {}
    uses: dict[str, set[int]] = {}  # key -> the link indices its samples name
    heads: dict[Any, bytes] = {}  # (ri,) / (ri, si) / (ri, si, pi) -> fields but the nested
    ri = -1
    for num, _, p, q in _fields(data, 0, len(data)):
        if num == 2:
            dictionary.append(data[p:q])
        if num != 1:
            continue
        ri += 1
        rp = req.resource_profiles[ri]
        heads[(ri,)], scopes = nested(data, p, q)
        for si, (sp0, sp1) in enumerate(scopes):
            sp = rp.scope_profiles[si]
            heads[(ri, si)], profiles = nested(data, sp0, sp1)
            for pi, (pp, pq) in enumerate(profiles):
                if (ri, si, pi) not in skip:
                    _profile(data, pp, pq, (ri, si, pi), sp.profiles[pi], link_key, key_of,
                             groups, uses, heads)
    rest, link_fields = _dictionary(b"".join(dictionary))
    # what the parts add: the tables repeated, and two bytes per link a part skips
    extra = len(rest) * (len(uses) - 1) + sum(len(_NO_LINK) * max(u) for u in uses.values())
    if extra > max(len(data), ROOM):
        return None
    dictionaries = {key: _part_dictionary(rest, link_fields, used) for key, used in uses.items()}
    return _assemble(data, groups, heads, dictionaries)


def _dictionary(payload: bytes) -> tuple[bytes, list[bytes]]:
    """The dictionary's fields but its links, and each link_table entry (whole field)."""
    rest: list[bytes] = []
    links: list[bytes] = []
    for num, f0, _, q in _fields(payload, 0, len(payload)):
        (links if num == 4 else rest).append(payload[f0:q])
    return b"".join(rest), links


def _part_dictionary(rest: bytes, links: list[bytes], used: set[int]) -> bytes:
    """A part's dictionary (field 2 of the request, whole): every table as received but the
    links, of which only those its samples name are kept, at their index (the others
    become empty entries, two bytes each; none after the last used), so that no index in
    its samples changes. The zero entry stays, as the decoder checks it."""
    out = [rest]
    at = 0
    for i in sorted(used | {0}):
        if i >= len(links):
            break  # index 0 of an empty link_table (no links at all)
        out += (_NO_LINK * (i - at), links[i])
        at = i + 1
    payload = b"".join(out)
    return _header(2, len(payload)) + payload


def _profile(data: bytes, start: int, end: int, path: Path, prof: Any,
             link_key: dict[int, str], key_of: Callable[[int], str],
             groups: dict[tuple[str, int, int, int], list[int]],
             uses: dict[str, set[int]], heads: dict[Any, bytes]) -> None:
    """One profile's samples into their groups (runs of byte ranges), its other fields into
    ``heads[path]``. The loop over samples is the hot one: each sample's length read
    inline, its group looked up only when its link changes."""
    link_indices = [s.link_index for s in prof.samples]
    head: list[bytes] = []
    k = 0
    last_li = -1
    last: list[int] = []
    i = start
    while i < end:
        f0 = i
        if data[i] == 0x12:  # a sample (field 2, length-delimited), its tag one byte
            n = data[i + 1]
            if n < 0x80:
                i += 2 + n
            else:
                n, j = _varint(data, i + 1)
                i = j + n
        else:
            tag, i = _varint(data, i)
            if tag != 0x12:  # the profile's own fields
                i = _skip(data, i, tag & 7)
                head.append(data[f0:i])
                continue
            n, i = _varint(data, i)  # a sample whose tag is longer than it need be
            i += n
        li = link_indices[k]
        k += 1
        if li != last_li:
            key = link_key.get(li)
            if key is None:
                key = key_of(li)
            gkey = (key, *path)
            got = groups.get(gkey)
            last = groups[gkey] = [] if got is None else got
            last_li = li
            used = uses.get(key)
            if used is None:
                uses[key] = {li}
            else:
                used.add(li)
        if last and last[-1] == f0:
            last[-1] = i  # the run goes on
        else:
            last += (f0, i)
    if k != len(link_indices):  # the parsed request and its bytes disagree: never expected
        raise ValueError(f"profile {path}: {k} samples on the wire, {len(link_indices)} parsed")
    heads[path] = b"".join(head)


def _assemble(data: bytes, groups: dict[tuple[str, int, int, int], list[int]],
              heads: dict[Any, bytes], dictionaries: dict[str, bytes]) -> dict[str, bytes]:
    view = memoryview(data)
    # key -> ri -> si -> [serialised Profile fields]
    tree: dict[str, dict[int, dict[int, list[bytes]]]] = {}
    for (key, ri, si, pi), bounds in groups.items():
        prof = b"".join([heads[(ri, si, pi)],
                         *[view[bounds[j]:bounds[j + 1]] for j in range(0, len(bounds), 2)]])
        scopes = tree.setdefault(key, {}).setdefault(ri, {})
        scopes.setdefault(si, []).extend((_header(2, len(prof)), prof))
    out: dict[str, bytes] = {}
    for key, resources in tree.items():
        msg: list[bytes] = []
        for ri, scopes in resources.items():
            inner = [heads[(ri,)]]
            for si, profiles in scopes.items():
                sp = b"".join([heads[(ri, si)], *profiles])
                inner += (_header(2, len(sp)), sp)
            rp = b"".join(inner)
            msg += (_header(1, len(rp)), rp)
        msg.append(dictionaries[key])
        out[key] = b"".join(msg)
    return out

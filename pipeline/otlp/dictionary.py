"""One request's ``ProfilesDictionary``: every index checked, every entry resolved once.

The decoder refuses a profile that references anything out of range, and also checks
what it does not read itself but ``split.py`` copies when it re-encodes an accepted
request for Kafka (mapping indices, ``system_name_strindex``, attribute units, the zero
entry of every table): an accepted request must never fail later, in another stage.

Strings are read from the message when used, not copied into a list first: a table of
millions of one-byte strings costs the parser little and a list of Python strings a lot.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pipeline.otlp.bounds import UINT64_MAX
from pipeline.otlp.common import any_value_str, is_zero
from pipeline.otlp.stacks import Frames, StackRefused, StackTable


class Invalid(Exception):
    """A profile (or the dictionary) is malformed; the message names the field."""


_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)
# attribute keys that say where a sample was taken (semantic conventions), and the labels
# Go programs set with pprof.Do, which eBPF profilers pass on as process.context.label.*
WHERE_KEYS = frozenset({"thread.id", "thread.name", "span_name", "process.context.label.span_id",
                        "process.context.label.trace_id", "process.context.label.span_name"})


class Where(NamedTuple):
    thread_id: int
    thread_name: str
    span_name: str
    label_trace_id: bytes  # from process.context.label.*: a link in all but name
    label_span_id: bytes


def _label_id(v: Any, size: int) -> bytes:
    """A hex id label (Go's span_id labels) as bytes, b"" when absent, malformed or zero."""
    if not isinstance(v, str) or len(v) != 2 * size:
        return b""
    try:
        out = bytes.fromhex(v)
    except ValueError:
        return b""
    return out if any(out) else b""


def _thread_id(v: Any) -> int:
    """thread.id as UInt64: non-numbers and negatives are "not known" (0), as before; a
    number too large for the column is refused."""
    try:
        tid = int(v)
    except ValueError:
        return 0
    if tid > UINT64_MAX:
        raise Invalid(f"attribute thread.id {tid} is over UInt64")
    return max(0, tid)


class Dictionary:
    """Resolves and checks indices into one request's ``ProfilesDictionary``, with caches."""

    def __init__(self, d: Any, table: StackTable | None = None, build: bool = True) -> None:
        """``build=False``: every check and budget, but stacks are not built nor hashed
        (``stack`` answers the stack's index: a gateway, which stores no stack)."""
        self.strtab = d.string_table
        self.n_str = len(d.string_table)
        self.functions = d.function_table
        self.locations = d.location_table
        self.mappings = d.mapping_table
        self.stacks_tbl = d.stack_table
        self.links = d.link_table
        self.attrs = d.attribute_table
        self.n_attrs = len(d.attribute_table)
        self.table = table or StackTable()
        self.build = build
        # every entry checked natively, no use able to exceed the stack budget
        # (profiles.py ``_verified``): the usual samples' checks may skip per-entry work
        self.verified = False
        self.records = 0  # sample records made from this request so far
        self.value_total = 0  # and their values added up
        self._where_by_indices: dict[tuple[int, ...], Where] = {}
        self.stack_cache: dict[int, int] = {}
        self.link_cache: dict[int, tuple[bytes, bytes]] = {}
        self._loc_by_index: dict[int, Frames] = {}
        self._fn_by_index: dict[int, tuple[str, str]] = {}
        self._checked_attrs: set[int] = set()
        self._checked_mappings: set[int] = set()

    @property
    def stacks(self) -> dict[int, Any]:
        return self.table.stacks

    def string(self, i: int, what: str) -> str:
        if not 0 <= i < self.n_str:
            raise Invalid(f"{what} {i} out of range (string_table has {self.n_str})")
        return str(self.strtab[i])

    def attributes(self, kvs: Any, what: str) -> dict[str, str]:
        """Resource (or scope) attributes as strings, as ``attributes_dict`` makes them,
        with the string references the Collector writes resolved: pdata (v0.165) marshals
        profiles with ``KeyValue.key_strindex`` and ``AnyValue.string_value_strindex``
        into this request's ``string_table`` instead of ``key``/``string_value``.
        ``Invalid`` for a reference out of range."""
        out: dict[str, str] = {}
        for i, kv in enumerate(kvs):
            key = kv.key or (self.string(kv.key_strindex, f"{what}[{i}].key_strindex")
                             if kv.key_strindex else "")
            v = kv.value
            out[key] = (self.string(v.string_value_strindex,
                                    f"{what}[{i}].value.string_value_strindex")
                        if v.WhichOneof("value") == "string_value_strindex"
                        else any_value_str(v))
        return out

    def check_zero_entries(self) -> None:
        """The zero entry of every table is copied into each Kafka part (split.py), used or
        not, so it must be as valid as a used one."""
        try:
            if len(self.functions):
                self._function(0)
            if len(self.mappings):
                self._mapping(0)
            if self.n_attrs:
                self.attr_indices([0])
            if len(self.locations):
                self._location(0)
            if len(self.stacks_tbl):
                self.stack(0)
        except StackRefused as err:
            raise Invalid(str(err)) from None

    def attr_indices(self, indices: Any) -> None:
        """Every index in range, and each entry's key and unit strings too."""
        for ai in indices:
            if ai in self._checked_attrs:
                continue
            if not 0 <= ai < self.n_attrs:
                raise Invalid(f"attribute_indices {ai} out of range "
                              f"(attribute_table has {self.n_attrs})")
            kv = self.attrs[ai]
            self.string(kv.key_strindex, f"attribute_table[{ai}].key_strindex")
            self.string(kv.unit_strindex, f"attribute_table[{ai}].unit_strindex")
            self._checked_attrs.add(ai)

    def where(self, indices: Any) -> Where:
        """Thread, span name and label-borne ids from a sample's (or profile's) attributes."""
        key = tuple(indices)
        got = self._where_by_indices.get(key)
        if got is not None:
            return got
        self.attr_indices(key)
        found: dict[str, Any] = {}
        for ai in key:
            kv = self.attrs[ai]
            name = str(self.strtab[kv.key_strindex])
            if name in WHERE_KEYS:
                v = kv.value
                found[name] = v.int_value if v.HasField("int_value") else self.string(
                    v.string_value_strindex, f"attribute_table[{ai}].value.string_value_strindex"
                ) if v.WhichOneof("value") == "string_value_strindex" else v.string_value
        span = _label_id(found.get("process.context.label.span_id", ""), 8)
        trace = _label_id(found.get("process.context.label.trace_id", ""), 16) if span else b""
        got = self._where_by_indices[key] = Where(
            _thread_id(found.get("thread.id", 0)), str(found.get("thread.name", "")),
            str(found.get("span_name", "") or found.get("process.context.label.span_name", "")),
            trace, span)
        return got

    def _function(self, fi: int) -> tuple[str, str]:
        got = self._fn_by_index.get(fi)
        if got is None:
            fn = self.functions[fi]
            name = self.string(fn.name_strindex, f"function_table[{fi}].name_strindex")
            self.string(fn.system_name_strindex, f"function_table[{fi}].system_name_strindex")
            got = self._fn_by_index[fi] = (
                name, self.string(fn.filename_strindex, f"function_table[{fi}].filename_strindex"))
        return got

    def _mapping(self, mi: int) -> None:
        if mi in self._checked_mappings:
            return
        n = len(self.mappings)
        if not n and mi == 0:
            return  # no mapping_table: index 0 is "no mapping"
        if not 0 <= mi < n:
            raise Invalid(f"mapping_index {mi} out of range (mapping_table has {n})")
        m = self.mappings[mi]
        self.string(m.filename_strindex, f"mapping_table[{mi}].filename_strindex")
        self.attr_indices(m.attribute_indices)
        self._checked_mappings.add(mi)

    def _location(self, li: int, where: str = "") -> Frames:
        got = self._loc_by_index.get(li)
        if got is not None:
            return got
        n_loc, n_fn = len(self.locations), len(self.functions)
        if not 0 <= li < n_loc:
            raise Invalid(f"{where}location index {li} out of range "
                          f"(location_table has {n_loc})")
        loc = self.locations[li]
        self._mapping(loc.mapping_index)
        self.attr_indices(loc.attribute_indices)
        what = f"location_table[{li}]"
        if not loc.lines:
            got = self.table.location([(f"0x{loc.address:x}", "", 0)], what)
        else:
            self.table.check_depth(len(loc.lines), what)
            frames = []
            # pprof/OTLP: several lines = inlined calls, innermost first, the caller last
            for line in loc.lines:
                fi = line.function_index
                if not 0 <= fi < n_fn:
                    raise Invalid(f"{what} function_index {fi} out of range "
                                  f"(function_table has {n_fn})")
                fn, fl = self._function(fi)
                frames.append((fn, fl, int(line.line)))
            got = self.table.location(frames, what)
        self._loc_by_index[li] = got
        return got

    def stack(self, i: int) -> int:
        sid = self.stack_cache.get(i)
        if sid is not None:
            return sid
        if not 0 <= i < len(self.stacks_tbl):
            raise Invalid(f"stack_index {i} out of range (stack_table has "
                          f"{len(self.stacks_tbl)})")
        indices = self.stacks_tbl[i].location_indices
        what = f"stack_table[{i}]"
        self.table.check_depth(len(indices), what)
        locs = [self._location(li, f"{what} ") for li in indices]
        if self.build:
            sid = self.table.stack(locs, what)
        else:
            self.table.spend(locs, what)
            sid = i
        self.stack_cache[i] = sid
        return sid

    def link(self, i: int) -> tuple[bytes, bytes]:
        """(trace_id, span_id) or (b"", b"") for no link; index 0 is the no-link entry."""
        got = self.link_cache.get(i)
        if got is not None:
            return got
        if not 0 <= i < len(self.links):
            if i == 0:
                return (b"", b"")  # an empty link_table: nothing links
            raise Invalid(f"link_index {i} out of range (link_table has {len(self.links)})")
        lk = self.links[i]
        tid, sid = bytes(lk.trace_id), bytes(lk.span_id)
        if i and len(tid) == 16 and len(sid) == 8 and tid != _ZERO_TRACE and sid != _ZERO_SPAN:
            got = (tid, sid)  # the usual link, in one test; the chain below names problems
        elif i == 0 or (is_zero(tid) and is_zero(sid)):
            got = (b"", b"")
        elif len(tid) != 16 or len(sid) != 8:
            raise Invalid(f"link_table[{i}] needs a 16-byte trace_id and an 8-byte span_id, "
                          f"got {len(tid)} and {len(sid)} bytes")
        elif is_zero(sid):
            raise Invalid(f"link_table[{i}] span_id must not be all zero when trace_id is set")
        elif is_zero(tid):
            # a span-only link (SDKs that label samples with span_id alone): the trace is
            # resolved by span id in ClickHouse (span_index), whichever worker has the span
            got = (b"", sid)
        else:
            got = (tid, sid)
        self.link_cache[i] = got
        return got

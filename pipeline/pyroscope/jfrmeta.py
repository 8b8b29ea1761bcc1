"""The metadata event of a JFR chunk (the recording's own description of its types) ->
``TypeDef``s, and how a value of each type is written: ``Layouts`` (one ``Spec`` per type
and field) and ``read_value``. Integers and strings are read with ``jfrwire``.

Facts of the format used here (JDK's JFR file format, as async-profiler writes it):

* the metadata event holds a string table and a tree of elements (``root`` > ``metadata``
  > ``class`` > ``field`` > ``annotation``) whose attributes are string-table indexes; a
  class has ``name``, ``id``, ``superType``; a field ``name``, ``class`` (a type id),
  ``constantPool="true"`` (a pool key is written, not the value) and ``dimension="1"``
  (an array: a varint count, then the elements). Field types other than the primitives
  and ``java.lang.String`` are written inline, field after field;
* ``boolean`` and ``byte`` are one raw byte, ``float``/``double`` big-endian IEEE.

As in ``jfrwire``, nothing read is trusted: every count is checked against the bytes left
and against ``Limits`` before anything is allocated for it, elements and types nest only
so deep, and a type that contains itself is refused.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from pipeline.pyroscope.jfrwire import Budget, JfrError, JfrTooLarge, PoolString, read_string, uvar

# --- metadata ----------------------------------------------------------------------------

class Field(NamedTuple):
    name: str
    type_id: int
    cpool: bool  # a constant-pool key is written
    array: bool
    unit: str  # the value of its @Timespan / @Timestamp annotation ("TICKS", ...), or ""


class TypeDef(NamedTuple):
    id: int
    name: str
    super_type: str
    fields: tuple[Field, ...]
    positions: dict[str, int]  # field name -> its first position

    def field_at(self, name: str, types: dict[int, TypeDef], type_names: tuple[str, ...], *,
                 cpool: bool = False, array: bool = False) -> int:
        """Position of the field ``name`` if it is declared as expected (of one of
        ``type_names``, a pool key or not, an array or not), else -1: a field of another
        shape is ignored, never misread."""
        i = self.positions.get(name, -1)
        if i < 0:
            return -1
        f = self.fields[i]
        t = types.get(f.type_id)
        ok = t is not None and t.name in type_names and f.cpool == cpool and f.array == array
        return i if ok else -1


# ``type_names`` for ``field_at``: a field read as an int (declared int or long), a long, a
# string
INT_TYPES, LONG_TYPES, STRING_TYPES = ("int", "long"), ("long",), ("java.lang.String",)


class _Element(NamedTuple):
    name: str
    attrs: dict[str, str]
    children: list[_Element]


_MAX_ELEMENT_DEPTH = 8  # root > metadata > class > field > annotation: 5 in practice


def parse_metadata(buf: bytes, pos: int, base: int, budget: Budget) -> dict[int, TypeDef]:
    """The metadata event whose payload (after size and type) starts at ``pos`` -> its
    types by id."""
    for _ in range(3):  # start time, duration, metadata id
        _, pos = uvar(buf, pos)
    n, p = uvar(buf, pos)
    if n > len(buf) - p:
        raise JfrError(f"jfr: metadata of {n} strings at byte {base + pos}, "
                       f"{len(buf) - p} bytes left")
    strings: list[str] = []
    for _ in range(n):
        s, p = read_string(buf, p, budget, base)
        if isinstance(s, PoolString):
            raise JfrError(f"jfr: metadata string refers to a constant pool (byte {base + p})")
        strings.append(s or "")
    count = [0]
    root, p = _element(buf, p, base, strings, 0, count, budget.limits.max_metadata_elements)
    if root.name != "root":
        raise JfrError(f"jfr: metadata starts with element {root.name[:40]!r}, not 'root' "
                       f"(byte {base + pos})")
    classes = [c for m in root.children if m.name == "metadata" for c in m.children
               if c.name == "class"]
    names = {c.attrs.get("id", ""): c.attrs.get("name", "") for c in classes}
    types: dict[int, TypeDef] = {}
    for c in classes:
        tid = _int_attr(c, "id", base + pos)
        fields = []
        for f in c.children:
            if f.name != "field":
                continue
            unit = ""
            for a in f.children:
                if names.get(a.attrs.get("class", "")) in ("jdk.jfr.Timespan",
                                                           "jdk.jfr.Timestamp"):
                    unit = a.attrs.get("value", "")
            dim = f.attrs.get("dimension", "0")
            if dim not in ("0", "1"):
                raise JfrError(f"jfr: field {f.attrs.get('name', '')[:40]!r} has dimension "
                               f"{dim[:20]!r}, not 0 or 1 (metadata at byte {base + pos})")
            fields.append(Field(f.attrs.get("name", ""), _int_attr(f, "class", base + pos),
                                f.attrs.get("constantPool") == "true", dim == "1", unit))
        positions: dict[str, int] = {}
        for i, field in enumerate(fields):
            positions.setdefault(field.name, i)
        types[tid] = TypeDef(tid, c.attrs.get("name", ""), c.attrs.get("superType", ""),
                             tuple(fields), positions)
    return types


def _int_attr(e: _Element, key: str, at: int) -> int:
    v = e.attrs.get(key, "")
    if not (v.isascii() and v.isdigit()) or len(v) > 19:
        raise JfrError(f"jfr: metadata {e.name} {e.attrs.get('name', '')[:40]!r} has "
                       f"{key}={v[:20]!r}, not a type id (metadata at byte {at})")
    return int(v)


def _element(buf: bytes, pos: int, base: int, strings: list[str], depth: int,
             count: list[int], most: int) -> tuple[_Element, int]:
    if depth > _MAX_ELEMENT_DEPTH:
        raise JfrError(f"jfr: metadata elements nested more than {_MAX_ELEMENT_DEPTH} deep "
                       f"(byte {base + pos})")
    count[0] += 1
    if count[0] > most:
        raise JfrTooLarge(f"jfr: metadata of more than max_metadata_elements={most} "
                          f"elements (byte {base + pos})")
    at = pos
    name, pos = _string_index(buf, pos, base, strings)
    n, pos = uvar(buf, pos)
    if n > (len(buf) - pos) // 2:
        raise JfrError(f"jfr: metadata element with {n} attributes at byte {base + at}, "
                       f"{len(buf) - pos} bytes left")
    attrs = {}
    for _ in range(n):
        k, pos = _string_index(buf, pos, base, strings)
        attrs[k], pos = _string_index(buf, pos, base, strings)
    n, pos = uvar(buf, pos)
    if n > (len(buf) - pos) // 3:
        raise JfrError(f"jfr: metadata element with {n} children at byte {base + at}, "
                       f"{len(buf) - pos} bytes left")
    children = []
    for _ in range(n):
        child, pos = _element(buf, pos, base, strings, depth + 1, count, most)
        children.append(child)
    return _Element(name, attrs, children), pos


def _string_index(buf: bytes, pos: int, base: int, strings: list[str]) -> tuple[str, int]:
    i, p = uvar(buf, pos)
    if i >= len(strings):
        raise JfrError(f"jfr: metadata string index {i} at byte {base + pos}, "
                       f"the table has {len(strings)}")
    return strings[i], p


# --- value layouts -----------------------------------------------------------------------

# A Spec says how one value is written: (kind, argument, fewest bytes it takes).
K_BYTE, K_VAR, K_F4, K_F8, K_STR, K_ARRAY, K_STRUCT = range(7)
Spec = tuple[int, Any, int]
_PRIMITIVES = {"boolean": K_BYTE, "byte": K_BYTE, "char": K_VAR, "short": K_VAR,
               "int": K_VAR, "long": K_VAR, "float": K_F4, "double": K_F8,
               "java.lang.String": K_STR}
_MIN = {K_BYTE: 1, K_VAR: 1, K_F4: 4, K_F8: 8, K_STR: 1, K_ARRAY: 1}
_MAX_NESTING = 16
FRAME_TYPE = "jdk.types.StackFrame"


class Layouts:
    """The Spec of each type and field of one chunk's metadata, made when first needed."""

    def __init__(self, types: dict[int, TypeDef]) -> None:
        self.types = types
        self._specs: dict[int, Spec] = {}

    def of_type(self, tid: int, at: int) -> Spec:
        """How a value of type ``tid`` is written where it is not a pool key (a pool entry)."""
        return self._type(tid, at, ())

    def of_field(self, f: Field, at: int) -> Spec:
        spec = self._field(f, at, ())
        if spec[2] == 0:
            raise JfrError(f"jfr: field {f.name[:40]!r} is of a type with no fields "
                           f"(metadata; byte {at})")
        return spec

    def _type(self, tid: int, at: int, outer: tuple[int, ...]) -> Spec:
        spec = self._specs.get(tid)
        if spec is not None:
            return spec
        t = self.types.get(tid)
        if t is None:
            raise JfrError(f"jfr: type id {tid} is not in the metadata (byte {at})")
        kind = _PRIMITIVES.get(t.name)
        if kind is not None:
            spec = (kind, None, _MIN[kind])
        else:
            if tid in outer or len(outer) >= _MAX_NESTING:
                raise JfrError(f"jfr: type {t.name[:60]!r} contains itself or nests more than "
                               f"{_MAX_NESTING} deep (metadata; byte {at})")
            fields = tuple(self._field(f, at, (*outer, tid)) for f in t.fields)
            spec = (K_STRUCT, fields, sum(s[2] for s in fields))
            for f, fs in zip(t.fields, fields, strict=True):
                if fs[2] == 0:  # so that reading any value takes at least a byte per value
                    raise JfrError(f"jfr: field {f.name[:40]!r} of type {t.name[:60]!r} is of "
                                   f"a type with no fields (metadata; byte {at})")
        self._specs[tid] = spec
        return spec

    def _field(self, f: Field, at: int, outer: tuple[int, ...]) -> Spec:
        elem: Spec = (K_VAR, None, 1) if f.cpool else self._type(f.type_id, at, outer)
        if not f.array:
            return elem
        t = self.types.get(f.type_id)
        return (K_ARRAY, (elem, t is not None and t.name == FRAME_TYPE), 1)


def read_value(spec: Spec, buf: bytes, pos: int, budget: Budget, base: int) -> tuple[Any, int]:
    """A value written as ``spec`` says -> (value, next position). Structs become tuples of
    their fields, arrays lists, pool keys and integers unsigned ints."""
    kind = spec[0]
    if kind == K_VAR:
        return uvar(buf, pos)
    if kind == K_STRUCT:
        out = []
        for s in spec[1]:
            v, pos = read_value(s, buf, pos, budget, base)
            out.append(v)
        return tuple(out), pos
    if kind == K_BYTE:
        return buf[pos], pos + 1
    if kind == K_STR:
        return read_string(buf, pos, budget, base)
    if kind == K_ARRAY:
        n, p = uvar(buf, pos)
        elem, frames = spec[1]
        if n > (len(buf) - p) // max(1, elem[2]):
            raise JfrError(f"jfr: an array of {n} values at byte {base + pos}, "
                           f"{len(buf) - p} bytes left")
        if frames:
            budget.take_frames(n, base + pos)
        items = []
        for _ in range(n):
            v, p = read_value(elem, buf, p, budget, base)
            items.append(v)
        return items, p
    size = 4 if kind == K_F4 else 8
    if pos + size > len(buf):
        raise IndexError(pos)
    return struct.unpack_from(">f" if size == 4 else ">d", buf, pos)[0], pos + size


def read_fields(specs: list[Spec], buf: bytes, budget: Budget, base: int) -> list[Any]:
    """The values of the first fields of an event whose payload (after size and type) is
    ``buf``, at byte ``base`` of the recording, as ``specs`` say they are written."""
    pos, vals = 0, []
    for spec in specs:
        v, pos = read_value(spec, buf, pos, budget, base)
        vals.append(v)
    return vals

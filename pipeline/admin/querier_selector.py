"""Profile type ids and label selectors of Pyroscope's query API, read strictly and
turned into SQL over ``profile_samples`` (admin/querier.py answers the RPCs).

**Profile types.** spanprof keeps a sample's measure (``cpu``, ``wall``, ``off_cpu`` in
nanoseconds whatever the profiler sent, or ``other`` with its own sample type and unit),
not the profile's name nor its period type, so it offers one profile type per measure,
with the id Pyroscope's SDKs use where there is one::

    process_cpu:cpu:nanoseconds:cpu:nanoseconds          measure cpu (ns)
    wall:wall:nanoseconds:wall:nanoseconds               measure wall (ns)
    off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds      measure off_cpu (ns)
    other:<sample type>:<unit>:<sample type>:<unit>      measure other, e.g. alloc_space

**Labels.** What ``profile_samples`` holds per sample: ``service_name`` (the service),
``span_name``, ``thread_name``, ``host_name``, and the private ``__name__`` (the id's
first part) and ``__profile_type__``. A label with an empty value is absent (Prometheus's
rule). A selector naming any other label is refused: spanprof does not store it, and
silently matching nothing would hide the mistake.

**Selectors.** ``{name="v", name!="v", name=~"re", name!~"re"}`` (Prometheus's syntax,
as Grafana writes it; a trailing comma, single quotes and raw back-quoted strings too),
optionally after a name: a profile type id there selects that type (older Grafana
versions write ``<profile type>{...}``), any other name is ``__name__``'s value. Regular
expressions are anchored and run by ClickHouse's RE2 (linear time); constructs RE2 lacks
(look-around, back-references, possessive repeats) are refused before a query runs.
Everything is bounded before anything is built: ``MAX_SELECTOR`` characters,
``MAX_MATCHERS`` matchers, ``MAX_VALUE`` characters a value. Errors are ``Invalid``,
their message naming the request field.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, NamedTuple

MAX_SELECTOR = 4096
MAX_MATCHERS = 32
MAX_VALUE = 1024
MAX_PART = 128  # characters in one part of a profile type id

# label -> its SQL expression over profile_samples
LABELS = {
    "service_name": "service",
    "span_name": "span_name",
    "thread_name": "thread_name",
    "host_name": "host",
    "__name__": ("multiIf(measure = 'cpu', 'process_cpu', measure = 'wall', 'wall', "
                 "measure = 'off_cpu', 'off_cpu', measure = 'lock', 'mutex', "
                 "measure = 'alloc', 'memory', 'other')"),
    "__profile_type__": (
        "multiIf(measure = 'cpu', 'process_cpu:cpu:nanoseconds:cpu:nanoseconds', "
        "measure = 'wall', 'wall:wall:nanoseconds:wall:nanoseconds', "
        "measure = 'off_cpu', 'off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds', "
        "measure = 'lock', 'mutex:delay:nanoseconds:contentions:count', "
        "measure = 'alloc', 'memory:alloc_space:bytes:space:bytes', "
        "concat('other:', sample_type, ':', unit, ':', sample_type, ':', unit))"),
}
PUBLIC = ("host_name", "service_name", "span_name", "thread_name")


class Invalid(ValueError):
    """A request field spanprof cannot answer: ``invalid_argument``, naming the field."""


class ProfileType(NamedTuple):
    id: str
    name: str
    sample_type: str
    sample_unit: str
    measure: str

    def where(self, params: dict[str, Any], key: str = "pt") -> str:
        """Its rows, by the columns at the front of profile_samples' key."""
        params[f"{key}_m"] = self.measure
        if self.measure != "other":
            return f"measure = {{{key}_m:String}}"
        params[f"{key}_t"], params[f"{key}_u"] = self.sample_type, self.sample_unit
        return (f"(measure = {{{key}_m:String}} AND sample_type = {{{key}_t:String}} "
                f"AND unit = {{{key}_u:String}})")


FIXED = {t.id: t for t in (
    ProfileType("process_cpu:cpu:nanoseconds:cpu:nanoseconds", "process_cpu", "cpu",
                "nanoseconds", "cpu"),
    ProfileType("wall:wall:nanoseconds:wall:nanoseconds", "wall", "wall", "nanoseconds",
                "wall"),
    ProfileType("off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds", "off_cpu", "off_cpu",
                "nanoseconds", "off_cpu"),
    # every lock wait (Go mutex and block delay, JFR monitor and park) and every allocation
    # (bytes) is one type each, under the names Pyroscope gives Go's
    ProfileType("mutex:delay:nanoseconds:contentions:count", "mutex", "delay", "nanoseconds",
                "lock"),
    ProfileType("memory:alloc_space:bytes:space:bytes", "memory", "alloc_space", "bytes",
                "alloc"))}
BY_MEASURE = {t.measure: t for t in FIXED.values()}


def _part_ok(p: str) -> bool:
    return 0 < len(p) <= MAX_PART and ":" not in p and printable(p)


def printable(s: str) -> bool:
    """No control characters, NUL or lone surrogates (a value a column could hold)."""
    return not any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) < 0xE000 for c in s)


def type_of(measure: str, sample_type: str, unit: str) -> ProfileType | None:
    """The profile type rows of this measure, sample type and unit belong to; None for an
    ``other`` type whose name cannot be written in an id (a ``:`` in it, say)."""
    if measure != "other":
        return BY_MEASURE.get(measure)
    if not (_part_ok(sample_type) and _part_ok(unit)):
        return None
    return ProfileType(f"other:{sample_type}:{unit}:{sample_type}:{unit}", "other",
                       sample_type, unit, "other")


def parse_type(text: str, field: str = "profile_typeID") -> ProfileType:
    found = FIXED.get(text)
    if found is not None:
        return found
    parts = text.split(":") if len(text) <= 5 * MAX_PART + 4 else []
    if len(parts) == 5 and parts[0] == "other" and parts[1] == parts[3] and \
            parts[2] == parts[4] and all(_part_ok(p) for p in parts):
        t = type_of("other", parts[1], parts[2])
        if t is not None:
            return t
    raise Invalid(f"{field}: {text[:200]!r} is not a profile type spanprof has: "
                  f"{', '.join(FIXED)} or other:<sample type>:<unit>:<sample type>:<unit> "
                  "(ProfileTypes lists them)")


class Matcher(NamedTuple):
    name: str
    op: str  # = != =~ !~
    value: str


_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_OPS = ("=~", "!~", "!=", "=")
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "\\": "\\", "'": "'", '"': '"'}
# regular-expression constructs Python's re accepts and RE2 does not
_NOT_RE2 = re.compile(r"\(\?(?!:)|\\[1-9]|\\Z|[*+?}]\+")
_REPEAT = re.compile(r"\{\s*(\d+)(?:\s*,\s*(\d*))?\s*\}")
MAX_REPEAT = 100  # RE2 refuses counts over 1000, and their products blow its memory up


def parse_selector(text: str, field: str = "label_selector") -> list[Matcher]:
    """``{a="b", c=~"d"}`` -> its matchers; ``Invalid`` naming ``field`` and saying where."""
    if len(text) > MAX_SELECTOR:
        raise Invalid(f"{field}: longer than {MAX_SELECTOR} characters")
    if not printable(text.replace("\n", " ").replace("\t", " ")):
        raise Invalid(f"{field}: control characters, NUL and lone surrogates are not allowed")
    p = _Reader(text, field)
    out: list[Matcher] = []
    p.space()
    if p.done():
        return out
    if (m := _METRIC.match(text, p.i)) is not None:
        name, p.i = m.group(), m.end()
        ptype = FIXED.get(name) or (parse_or_none(name) if name.startswith("other:") else None)
        out.append(Matcher("__profile_type__", "=", name) if ptype or ":" in name
                   else Matcher("__name__", "=", name))
        p.space()
        if p.done():
            return out
    p.expect("{")
    p.space()
    while not p.peek("}"):
        if len(out) >= MAX_MATCHERS:
            raise Invalid(f"{field}: more than {MAX_MATCHERS} matchers")
        out.append(p.matcher())
        p.space()
        if p.peek(","):
            p.i += 1
            p.space()
        elif not p.peek("}"):
            p.fail("expected ',' or '}'")
    p.i += 1
    p.space()
    if not p.done():
        p.fail("unexpected text after '}'")
    return out


def parse_or_none(text: str) -> ProfileType | None:
    try:
        return parse_type(text)
    except Invalid:
        return None


class _Reader:
    def __init__(self, text: str, field: str) -> None:
        self.s, self.i, self.field = text, 0, field

    def fail(self, why: str) -> None:
        raise Invalid(f"{self.field}: {why} at character {self.i + 1} of {self.s[:200]!r}")

    def done(self) -> bool:
        return self.i >= len(self.s)

    def peek(self, c: str) -> bool:
        return self.s.startswith(c, self.i)

    def space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def expect(self, c: str) -> None:
        if not self.peek(c):
            self.fail(f"expected {c!r}")
        self.i += len(c)

    def matcher(self) -> Matcher:
        m = _NAME.match(self.s, self.i)
        if m is None:
            self.fail("expected a label name")
        assert m is not None
        name, self.i = m.group(), m.end()
        if name not in LABELS:
            raise Invalid(f"{self.field}: label {name!r} is not one spanprof stores (it has "
                          f"{', '.join(sorted(LABELS))})")
        self.space()
        op = next((o for o in _OPS if self.peek(o)), None)
        if op is None:
            self.fail("expected =, !=, =~ or !~")
        assert op is not None
        self.i += len(op)
        self.space()
        value = self.string()
        if op in ("=~", "!~"):
            check_regex(value, f"{self.field}: {name}{op}")
        return Matcher(name, op, value)

    def string(self) -> str:
        q = self.s[self.i] if self.i < len(self.s) else ""
        if q not in ("\"", "'", "`"):
            self.fail("expected a quoted value")
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s):
                self.fail("unterminated string")
            c = self.s[self.i]
            self.i += 1
            if c == q:
                break
            if c == "\\" and q != "`":
                out.append(self._escape())
            elif c == "\n" and q != "`":
                self.fail("newline in a string")
            else:
                out.append(c)
            if len(out) > MAX_VALUE:
                raise Invalid(f"{self.field}: a value longer than {MAX_VALUE} characters")
        return "".join(out)

    def _escape(self) -> str:
        c = self.s[self.i] if self.i < len(self.s) else ""
        self.i += 1
        if c in _ESCAPES:
            return _ESCAPES[c]
        digits = {"x": 2, "u": 4, "U": 8}.get(c)
        h = self.s[self.i:self.i + digits] if digits else ""
        if digits and len(h) == digits and all(d in "0123456789abcdefABCDEF" for d in h):
            self.i += digits
            code = int(h, 16)
            if code < 0x110000 and not 0xD800 <= code < 0xE000 and (code >= 32 or c != "x"):
                ch = chr(code)
                if printable(ch) or ch in "\n\t":
                    return ch
        self.i -= 1
        self.fail("unknown or invalid escape")
        return ""


def check_regex(value: str, where: str) -> None:
    """A regular expression RE2 (ClickHouse's ``match``) compiles as Python's re would."""
    if _NOT_RE2.search(value):
        raise Invalid(f"{where}: look-around, back-references, \\Z and possessive repeats "
                      "are not supported (RE2 syntax)")
    if any(int(g) > MAX_REPEAT for m in _REPEAT.finditer(value) for g in m.groups() if g):
        raise Invalid(f"{where}: a repeat count over {MAX_REPEAT}")
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: RE2's syntax
            warnings.simplefilter("ignore")
            re.compile(value)
    except (re.error, RecursionError, OverflowError) as err:
        raise Invalid(f"{where}: not a regular expression: {err}") from None


def where(matchers: list[Matcher], params: dict[str, Any], key: str) -> str:
    """The SQL conjunction of ``matchers`` (values bound as ``{key}_i``); ``1`` for none."""
    out = []
    for i, m in enumerate(matchers):
        p = f"{key}_{i}"
        if m.name == "__profile_type__" and m.op == "=":
            t = parse_or_none(m.value)  # by the key's columns; an unknown type is no rows
            out.append(t.where(params, p) if t is not None else "0")
            continue
        expr = LABELS[m.name]
        if m.op in ("=", "!="):
            params[p] = m.value
            out.append(f"{expr} {m.op} {{{p}:String}}")
        else:
            params[p] = f"^(?:{m.value})$"  # Prometheus's regexes match the whole value
            out.append(f"{'NOT ' if m.op == '!~' else ''}match({expr}, {{{p}:String}})")
    return " AND ".join(out) or "1"


def where_any(selectors: list[list[Matcher]], params: dict[str, Any], key: str) -> str:
    """Rows matching any of ``selectors`` (LabelNames', LabelValues' and Series' matchers:
    a series matching any of them); every row for none."""
    parts = [f"({where(s, params, f'{key}{i}')})" for i, s in enumerate(selectors)]
    return " OR ".join(parts) or "1"

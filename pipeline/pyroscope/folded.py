"""Folded stacks (``a;b;c 12`` a line) and ``lines`` (``a;b;c`` a line, one sample each):
the legacy ``/ingest`` text formats. Pyroscope's server takes folded text when a request
names no format and is not a multipart form.

Frames are root first, separated by ``;``; the count after the last space is a number of
profiler ticks (``units=samples``, the default) at ``sampleRate`` Hz, or a raw quantity
in ``units`` (``objects``, ``bytes``...). What the ticks measure comes from the app
name's suffix, as Pyroscope reads it: ``.cpu`` (or none) CPU, ``.wall`` wall time,
anything else (``.alloc_space``...) a raw ``other`` measure. Samples carry no span
labels, so they are never linked to a span: their CPU is the service's, unattributed.

Bounded like pprof: lines are counted before any is parsed (``max_samples``), the frames
of a line before it is split (``max_stack_depth``), stacks share the push's budget
(``pipeline/otlp/stacks.py``), and values are checked before they are added up.
"""

from __future__ import annotations

from pipeline.errors import InvalidData, TooLarge
from pipeline.otlp.bounds import MAX_COUNT, MAX_REQUEST_VALUE, MAX_SAMPLE_VALUE
from pipeline.otlp.profiles import Kind, classify
from pipeline.otlp.stacks import Frames, StackRefused
from pipeline.pyroscope.pprof import Budget
from pipeline.records import ProfileBatch, Sample

EXAMPLE = "'a;b;c 12'"


class NotFolded(InvalidData):
    """The body is not folded text at all (as opposed to folded text over a limit)."""


# bytes that never occur in text: C0 controls other than tab, LF and CR, and DEL
_NOT_TEXT = bytes(b for b in range(32) if b not in b"\t\n\r") + b"\x7f"


def text_problem(data: bytes) -> str | None:
    """Why ``data`` is not text (the first control byte, or invalid UTF-8), or None."""
    cut = data.translate(None, _NOT_TEXT)
    if len(cut) != len(data):
        at = next(i for i, b in enumerate(data) if b in _NOT_TEXT)
        return f"byte 0x{data[at]:02x} at offset {at} is not text"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 at offset {err.start}"
    return None


def kind_of(profile_type: str, units: str, sample_rate: int) -> tuple[Kind, str, str]:
    """(kind, sample type, unit) of the values of a text profile (module docstring)."""
    units = units or "samples"
    if units == "samples":
        period_type = {"": "cpu", "itimer": "cpu"}.get(profile_type, profile_type)
        period_ns = 1_000_000_000 // sample_rate
        k = classify("samples", "count", period_type, "nanoseconds", period_ns)
        return k, profile_type if k.measure == "other" else "samples", "count"
    name = profile_type or units
    return classify(name, units, "", "", 0), name, units


def decode_text(data: bytes, service: str, time_ns: int, kind: tuple[Kind, str, str],
                budget: Budget, counted: bool = True) -> ProfileBatch:
    """Folded (``counted``) or ``lines`` text -> one record per distinct stack."""
    problem = text_problem(data)
    if problem:
        raise NotFolded(f"not folded text: {problem}")
    limits = budget.limits
    n_lines = data.count(b"\n") + 1
    if n_lines > limits.max_samples:
        raise TooLarge(f"folded text: {n_lines} lines, over max_samples_per_request="
                       f"{limits.max_samples}")
    k, sample_type, unit = kind
    stacks = budget.stacks
    frames: dict[str, Frames] = {}
    ticks_of: dict[int, int] = {}
    for n, raw in enumerate(data.decode("utf-8").split("\n"), 1):
        line = raw.rstrip("\r\t ")
        if not line:
            continue
        stack, count = line, 1
        if counted:
            stack, _, tail = line.rpartition(" ")
            if not stack or not (tail.isascii() and tail.isdigit()):
                raise NotFolded(f"not folded text: line {n}: {line[:80]!r} does not end "
                                f"in a sample count (expected {EXAMPLE})")
            count = int(tail) if len(tail) <= 10 else MAX_COUNT + 1  # no 4300-digit parse
            if count > MAX_COUNT:
                raise InvalidData(f"folded text: line {n}: count {tail[:40]} is over UInt32")
        what = f"line {n}"
        try:
            stacks.check_depth(stack.count(";") + 1, what)
            names = stack.split(";")
            if any(not name for name in names):
                raise NotFolded(f"not folded text: line {n}: an empty frame in "
                                f"{stack[:80]!r} (expected {EXAMPLE})")
            locs = []
            for name in reversed(names):  # leaf first, as pprof
                got = frames.get(name)
                if got is None:
                    got = frames[name] = stacks.location([(name, "", 0)], what)
                locs.append(got)
            sid = stacks.stack(locs, what)
        except StackRefused as err:
            raise TooLarge(f"folded text: {err}") from None
        ticks_of[sid] = ticks_of.get(sid, 0) + count
    samples: list[Sample] = []
    total = budget.value_total
    for sid, raw_count in ticks_of.items():
        if raw_count <= 0:
            continue
        value = raw_count * k.per_value
        ticks = raw_count if k.value_is_count else 1
        if value > MAX_SAMPLE_VALUE or ticks > MAX_COUNT:
            raise InvalidData(f"folded text: a stack's count {raw_count} ({value} after "
                              f"units) is over the per-sample limit {MAX_SAMPLE_VALUE} or "
                              "UInt32 ticks")
        total += value
        samples.append(Sample(b"", b"", service, time_ns, sid, k.measure, value, ticks,
                              sample_type, unit))
    if total > MAX_REQUEST_VALUE:
        raise InvalidData(f"folded text: counts add up to {total}, over {MAX_REQUEST_VALUE}")
    budget.value_total = total
    return ProfileBatch(samples, {s.stack_id: stacks.stacks[s.stack_id] for s in samples})

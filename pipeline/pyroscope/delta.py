"""``prev_profile``: cumulative sample types made into deltas, as Pyroscope's server did.

Go SDKs before ``pyroscope-go`` v0.37 uploaded heap, mutex and block profiles as the
runtime keeps them, cumulative since the process started, with the previous upload's
profile in the form's ``prev_profile`` part; the server subtracted it, per stack and
labels, for the sample types that are cumulative (``sample_type_config``'s
``cumulative: true``, or by default ``alloc_objects``, ``alloc_space``, ``contentions``
and ``delay``). Today's SDKs compute deltas themselves (``godeltaprof``), never send
``prev_profile`` (v1.5.0 still has the field, unused), and Pyroscope v1 refuses a form
that has one; spanprof still takes them, so old agents are not cut off.

None of these types is CPU: they are stored as ``other`` measures, never attributed to
spans. A stack's previous value is taken off the current one, never below zero (the
runtime's counters only grow; a stack whose value went back has nothing new).

The previous profile is bounded as the current one is: inflated within what is left of
``max_decompressed_bytes``, its tables checked, its samples counted with the push's, and
its stacks no deeper than ``max_stack_depth``; a sample's key holds one small integer per
location, so the index is no bigger than the profile it came from.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import InvalidData, TooLarge
from pipeline.pyroscope.pprof import Limits, Strings, check_tables

DEFAULT_CUMULATIVE = frozenset({"alloc_objects", "alloc_space", "contentions", "delay"})
Key = tuple[tuple[int, ...], tuple[tuple[str, str, int], ...]]


def cumulative_types(p: Any, sample_types: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(type, unit) of the profile's cumulative sample types: ``sample_type_config``
    decides when the form has one (as it replaced Pyroscope's default mapping)."""
    s = Strings(p)
    out = []
    for vt in p.sample_type:
        t, u = s(vt.type, "sample_type"), s(vt.unit, "sample_type")
        if sample_types is None:
            cumulative = t in DEFAULT_CUMULATIVE
        else:
            conf = sample_types.get(t)
            cumulative = isinstance(conf, dict) and conf.get("cumulative") is True
        if cumulative:
            out.append((t, u))
    return out


class _Keys:
    """The key of a sample: its locations, each as an integer standing for its frames (so
    that the same stack in two profiles with other location ids has the same key), and its
    labels."""

    def __init__(self, p: Any, interned: dict[tuple[Any, ...], int], limits: Limits,
                 what: str) -> None:
        self.p, self.s, self.interned, self.limits, self.what = (
            p, Strings(p), interned, limits, what)
        self.locations = {loc.id: loc for loc in p.location}
        self.functions = {fn.id: fn for fn in p.function}
        self.of_location: dict[int, int] = {}

    def _location(self, lid: int, n: int) -> int:
        got = self.of_location.get(lid)
        if got is not None:
            return got
        loc = self.locations.get(lid)
        if loc is None:
            raise InvalidData(f"{self.what}: sample[{n}] references location {lid}, "
                              "which the profile does not define")
        if len(loc.line) > self.limits.max_stack_depth:
            raise TooLarge(f"{self.what}: location {lid} has {len(loc.line)} lines, over "
                           f"max_stack_depth={self.limits.max_stack_depth}")
        frames: list[Any] = []
        for line in loc.line:
            fn = self.functions.get(line.function_id)
            if fn is None:
                raise InvalidData(f"{self.what}: location {lid} references function "
                                  f"{line.function_id}, which is not defined")
            frames += (self.s(fn.name, "function name"),
                       self.s(fn.filename, "function filename"), int(line.line))
        ident = tuple(frames) if frames else (int(loc.address),)
        got = self.of_location[lid] = self.interned.setdefault(ident, len(self.interned))
        return got

    def __call__(self, smp: Any, n: int) -> Key:
        if len(smp.location_id) > self.limits.max_stack_depth:
            raise TooLarge(f"{self.what}: sample[{n}] has {len(smp.location_id)} frames, "
                           f"over max_stack_depth={self.limits.max_stack_depth}")
        if len(smp.label) > self.limits.max_labels:
            raise TooLarge(f"{self.what}: sample[{n}] has {len(smp.label)} labels, over "
                           f"max_labels={self.limits.max_labels}")
        labels = tuple(sorted((self.s(lb.key, "label key"), self.s(lb.str, "label value"),
                               int(lb.num)) for lb in smp.label))
        return tuple(self._location(lid, n) for lid in smp.location_id), labels


def subtract_previous(p: Any, prev: Any, types: list[tuple[str, str]],
                      limits: Limits) -> None:
    """Take ``prev``'s values of the cumulative ``types`` off ``p``'s, in place."""
    if not types:
        return
    check_tables(prev, limits)
    sp, sq = Strings(p), Strings(prev)
    cur = {(sp(vt.type, "sample_type"), sp(vt.unit, "sample_type")): i
           for i, vt in enumerate(p.sample_type)}
    old = {(sq(vt.type, "sample_type"), sq(vt.unit, "sample_type")): i
           for i, vt in enumerate(prev.sample_type)}
    pairs = [(cur[t], old[t]) for t in types if t in old]
    if not pairs:
        return
    interned: dict[tuple[Any, ...], int] = {}
    keys = _Keys(prev, interned, limits, "prev_profile")
    before: dict[Key, list[int]] = {}
    for n, smp in enumerate(prev.sample):
        if max(j for _, j in pairs) >= len(smp.value):
            raise InvalidData(f"prev_profile: sample[{n}] has {len(smp.value)} values for "
                              f"{len(prev.sample_type)} sample types")
        acc = before.setdefault(keys(smp, n), [0] * len(pairs))
        for x, (_, j) in enumerate(pairs):
            acc[x] += int(smp.value[j])
    keys = _Keys(p, interned, limits, "pprof")
    for n, smp in enumerate(p.sample):
        left = before.get(keys(smp, n))
        if left is None:
            continue
        for x, (i, _) in enumerate(pairs):
            if i >= len(smp.value):
                raise InvalidData(f"pprof: sample[{n}] has {len(smp.value)} values for "
                                  f"{len(p.sample_type)} sample types")
            now = int(smp.value[i])
            taken = min(max(left[x], 0), max(now, 0))  # never below zero
            smp.value[i] = now - taken
            left[x] -= taken

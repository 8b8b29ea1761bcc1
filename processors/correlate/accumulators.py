"""What the correlator joins to a span between two reports: per-method accumulators.

A span's report is one row per ``method`` (how its samples found it, see ``placement``);
each row carries self CPU and wall time, sample counts, inclusive CPU, and self time per
leaf function and per stack (flame graphs); lock wait and allocated bytes in all and per
leaf function (no stacks: their flame graphs are read from the raw samples). ``Acc`` holds
those for one span (or orphan label, or a service's unattributed minute) until it is
reported; ``add`` adds one sample.
Each accumulator knows its size in items (``ITEM_BYTES`` each), which the memory bound of
``CorrelatorState`` counts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.records import Attribution, ProfileBatch, Sample
from processors.correlate.sizes import METHOD_ITEMS

Key = tuple[bytes, bytes]  # (trace_id, span_id)
MINUTE_NS = 60_000_000_000
UNKNOWN_FRAME = "[unknown]"
LINK, LINK_TIME, THREAD, WINDOW = "link", "link+time", "thread", "window"
SHARE = "link+share"  # an untimed sample's estimated share in a child of its labelled span
EXACT_METHODS = (LINK, LINK_TIME)
LABELLED_METHODS = (LINK, LINK_TIME, SHARE)  # from labelled samples: reconciled per trace


# msgspec Structs with gc=False, like SpanInfo and Pending (``spans.py``): one of each is
# held per span with CPU, hundreds of thousands at a long grace, and the garbage collector
# scanning them is what stalls the event loop; they hold no cycles
class M(msgspec.Struct, gc=False):
    """What one method contributed to one span since it was last reported."""

    cpu_ns: int = 0
    wall_ns: int = 0
    count: int = 0
    incl_cpu: int = 0
    # self CPU per leaf function (its name, a str key) and per stack (its id, an int key)
    # in one dict, split when reported (``fns_and_stacks``): a dict for each was 448 of a
    # held span's ~1 700 bytes
    cpu: dict[str | int, int] = msgspec.field(default_factory=dict)
    lock_ns: int = 0
    alloc_bytes: int = 0
    # made at first use: most spans have none of these (wall time comes from wall-clock
    # profilers only; empty dicts were 128 of a held span's ~1 450 bytes)
    wall: dict[str | int, int] | None = None  # as ``cpu``, wall time
    self_lock: dict[str, int] | None = None  # leaf function -> ns waited for a lock
    self_alloc: dict[str, int] | None = None  # leaf function -> bytes

    def any(self) -> bool:
        """Whether anything was joined (a row is worth writing)."""
        return bool(self.cpu_ns or self.wall_ns or self.count or self.incl_cpu
                    or self.lock_ns or self.alloc_bytes)


def fns_and_stacks(d: dict[str | int, int] | None) -> tuple[dict[str, int], dict[int, int]]:
    """``M.cpu`` or ``M.wall`` as its two maps: per leaf function, per stack id."""
    if not d:
        return {}, {}
    items = d.items()
    return ({k: v for k, v in items if type(k) is str},
            {k: v for k, v in items if type(k) is not str})  # type: ignore[misc]


def attribution(trace_id: bytes, span_id: bytes, method: str, service: str, name: str,
                parent_span_id: bytes, start_ns: int, duration_ns: int, span_known: bool,
                m: M, source: int) -> Attribution:
    """The row of what ``m`` joined to a span (positional: Attribution's field order)."""
    self_cpu, stack_cpu = fns_and_stacks(m.cpu)
    self_wall, stack_wall = fns_and_stacks(m.wall)
    return Attribution(trace_id, span_id, method, service, name, parent_span_id, start_ns,
                       duration_ns, span_known, m.cpu_ns, m.wall_ns, m.count, self_cpu,
                       self_wall, source, m.incl_cpu, stack_cpu, stack_wall,
                       m.lock_ns, m.alloc_bytes, m.self_lock or {}, m.self_alloc or {})


def _m_items(m: M) -> int:
    return (METHOD_ITEMS + len(m.cpu) + len(m.wall or ()) + len(m.self_lock or ())
            + len(m.self_alloc or ()))


class Acc(msgspec.Struct, gc=False):
    """CPU and wall time joined to one span since it was last reported, per method.

    The ``link`` method's part (nearly every span's only one) is a field of its own and the
    others a dict made at their first use: a span then holds no object the garbage
    collector tracks (a dict holding structs is tracked, and one per held span made the
    collections of the older generations take up to a second)."""

    since: float
    service: str = ""
    link: M | None = None
    others: dict[str, M] | None = None

    def methods(self) -> list[tuple[str, M]]:
        """(method, what it contributed), ``link`` first, the others in order of first use."""
        out = [(LINK, self.link)] if self.link is not None else []
        if self.others:
            out.extend(self.others.items())
        return out

    def count(self) -> int:
        """How many methods contributed."""
        return (self.link is not None) + (len(self.others) if self.others else 0)

    def get(self, method: str) -> M | None:
        if method == LINK:
            return self.link
        return self.others.get(method) if self.others else None

    def items(self) -> int:
        """Size in ``ITEM_BYTES``: methods and their function and stack entries."""
        if self.others is None:  # the usual: the link method only, or nothing yet
            return 0 if self.link is None else _m_items(self.link)
        return sum(_m_items(m) for _, m in self.methods())

    def add(self, method: str, measure: str, value: int, count: int, leaf: str | None,
            stack: int = 0) -> int:
        """Add a sample under ``method``; how many items (``items``) that created."""
        m = self.get(method)
        new = 0
        if m is None:
            m = self.m(method)
            new = METHOD_ITEMS
        return new + add(m, measure, value, count, leaf, stack)

    def m(self, method: str) -> M:
        """The method's part, made at its first use."""
        if method == LINK:
            if self.link is None:
                self.link = M()
            return self.link
        if self.others is None:
            self.others = {}
        got = self.others.get(method)
        if got is None:
            got = self.others[method] = M()
        return got

    def merge(self, other: Acc) -> None:
        for method, o in other.methods():
            m = self.m(method)
            m.cpu_ns += o.cpu_ns
            m.wall_ns += o.wall_ns
            m.count += o.count
            m.incl_cpu += o.incl_cpu
            m.lock_ns += o.lock_ns
            m.alloc_bytes += o.alloc_bytes
            if o.self_lock:
                m.self_lock = m.self_lock or {}
            if o.self_alloc:
                m.self_alloc = m.self_alloc or {}
            if o.wall:
                m.wall = m.wall or {}
            pairs: tuple[tuple[dict[Any, int] | None, dict[Any, int] | None], ...] = (
                (m.cpu, o.cpu), (m.wall, o.wall), (m.self_lock, o.self_lock),
                (m.self_alloc, o.self_alloc))
            for d, od in pairs:
                if d is None or not od:
                    continue
                for k, v in od.items():
                    d[k] = d.get(k, 0) + v


def add(m: M, measure: str, value: int, count: int, leaf: str | None,
        stack: int = 0) -> int:
    """Add a sample to ``m``; how many function and stack entries that created."""
    if measure == "cpu":
        m.cpu_ns += value
        m.incl_cpu += value
        m.count += count
        if leaf is None:
            return 0
        d = m.cpu
    elif measure == "lock" or measure == "alloc":
        if measure == "lock":
            m.lock_ns += value
            if leaf is None:
                return 0
            fns = m.self_lock if m.self_lock is not None else {}
            m.self_lock = fns
        else:
            m.alloc_bytes += value
            if leaf is None:
                return 0
            fns = m.self_alloc if m.self_alloc is not None else {}
            m.self_alloc = fns
        got = fns.get(leaf)
        fns[leaf] = value if got is None else got + value
        return int(got is None)
    else:
        m.wall_ns += value
        if leaf is None:
            return 0
        if m.wall is None:
            m.wall = {}
        d = m.wall
    # the stack first: a dict whose first key is a str has a table for str keys only,
    # remade twice as large at its first int key
    new = 0
    got = d.get(stack)
    if got is None:
        d[stack] = value
        new += 1
    else:
        d[stack] = got + value
    got = d.get(leaf)
    if got is None:
        d[leaf] = value
        new += 1
    else:
        d[leaf] = got + value
    return new


def leaf_of(batch: ProfileBatch, smp: Sample) -> str:
    stack = batch.stacks.get(smp.stack_id)
    return stack.functions[0] if stack is not None and stack.functions else UNKNOWN_FRAME

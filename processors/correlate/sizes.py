"""Estimated sizes of what the correlator holds, for its ``max_bytes`` bound.

``CorrelatorState.bytes`` is an estimate kept as entries come and go rather than measured:
a known span with its strings and its seconds in the time index (``span_cost``), an
accumulator and each function or stack it holds (``accumulators.Acc.items``), a held
sample. The sizes are CPython's, checked against tracemalloc in
tests/processors/test_state_memory.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from processors.correlate.spans import SpanInfo

# Estimated sizes, in bytes (CPython 3.11 on 64 bits; tests/processors/test_state_memory.py
# holds the total within a factor of 1.5 of what tracemalloc measures)
SPAN_BYTES = 460  # a known span: SpanInfo, trees, trace_of, emitted entries (+ its strings)
SLOT_BYTES = 40  # one second of a span in the time index (``slots``)
ACC_BYTES = 250  # an accumulator (held span, orphan, late entry), without methods
ITEM_BYTES = 40  # one function or stack entry of an accumulator
METHOD_ITEMS = 12  # a method's entry in an accumulator (``M``), counted in items
SAMPLE_BYTES = 350  # a timed sample held for grace
# what ``frames.Frames`` holds: a held sample's stack by id (the decoded list of its
# functions, kept alive), a frame of it, an operation learnt, a frame it learnt (its entry
# and float; the strings are shared with the stacks, but may outlive them)
STACK_BYTES = 120
FRAME_BYTES = 70
OP_BYTES = 400
LEARNT_FRAME_BYTES = 130


def span_cost(info: SpanInfo, slots: int) -> int:
    return (SPAN_BYTES + SLOT_BYTES * slots + len(info.name) + len(info.service)
            + len(info.host))

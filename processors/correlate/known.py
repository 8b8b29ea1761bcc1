"""The index of known spans, in which samples look for theirs: kept as spans come and go.

A span is known from its arrival (``add_spans``) until it has been reported and its marker
expires (``late_window``) or is dropped at the memory bounds (``windows``). Known, it is in
its trace's ``Tree`` (parent links, thread and process), in ``trace_of`` (span id -> trace
id, for samples labelled with a span id alone) and in the time index ``slots`` (by service
and second, ``SLOT_NS``, at most ``MAX_SLOTS`` of a span), in which unlabelled samples find
the spans open at their instant. ``_know`` and ``_forget`` keep the three together, with
``_span_bytes``, the estimated size of what they hold (``sizes.span_cost``); a trace's tree
goes with its last span, and with it the inclusive CPU that waited there for parents
never seen.

``KnownSpans`` holds these methods of ``CorrelatorState``, under ``Placement``, which reads
the index; the tables are the state's, declared here for the type checker only.
"""

from __future__ import annotations

from processors.correlate.accumulators import Key
from processors.correlate.sizes import span_cost
from processors.correlate.spans import MAX_SLOTS, SLOT_NS, SpanInfo, Tree


class KnownSpans:
    """Knowing and forgetting spans: a part of ``CorrelatorState`` (see the module)."""

    trees: dict[bytes, Tree]
    slots: dict[tuple[str, int], dict[Key, None]]
    trace_of: dict[bytes, bytes]
    _span_bytes: int
    _items: int

    def _know(self, key: Key, info: SpanInfo) -> None:
        self.trace_of[key[1]] = key[0]
        tree = self.trees.get(key[0])
        if tree is None:
            tree = self.trees[key[0]] = Tree()
        tree.add(key[1], info)
        start = info.start_ns
        first = start // SLOT_NS
        last = min(max(first, (start + info.duration_ns - 1) // SLOT_NS),
                   first + MAX_SLOTS - 1)
        self._span_bytes += span_cost(info, last - first + 1)
        slots, service = self.slots, info.service
        for slot in range(first, last + 1):
            keys = slots.get((service, slot))
            if keys is None:
                slots[(service, slot)] = {key: None}
            else:
                keys[key] = None

    def _forget(self, key: Key, info: SpanInfo) -> None:
        if self.trace_of.get(key[1]) == key[0]:
            del self.trace_of[key[1]]
        tree = self.trees.get(key[0])
        if tree is not None:
            tree.remove(key[1])
            if not tree.spans:
                if tree.waiting:
                    self._items -= sum(len(w) for w in tree.waiting.values())
                del self.trees[key[0]]
        first = info.start_ns // SLOT_NS
        last = min(max(first, (info.end_ns - 1) // SLOT_NS), first + MAX_SLOTS - 1)
        self._span_bytes -= span_cost(info, last - first + 1)
        for slot in range(first, last + 1):
            keys = self.slots.get((info.service, slot))
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self.slots[(info.service, slot)]

"""What each operation runs, learnt from its samples: to place by its stack a sample whose
instant cannot tell its span.

A sample's instant picks the span open then; it cannot where several are open on one
thread (asyncio tasks taking turns, each a child span) or where spans say no thread (an
eBPF profiler's unlabelled samples, several requests running at once). Its stack can: a
task's samples show the task's own functions (its handler, its client library), a request
its endpoint's. ``Frames`` learns, per operation (service, span name), how often each frame
is on the stacks of its samples: from samples placed exactly (``link``, ``link+time``) with
weight one, and from the ambiguous ones by what it then believed (their posterior, so that
a service with no exact samples, unlabelled only, learns too: an operation's frames are on
the stacks whenever one of its spans is a candidate, other frames only by chance).

``choose`` compares the candidate operations by Bernoulli naive Bayes over the frames the
service has shown (a frame on the stack is evidence for the operations that run it, a
frame an operation always runs and the stack lacks, evidence against it); an operation
not learnt yet stands for the service's average. It answers only where one operation is
clearly likelier (``MARGIN``); otherwise the sample is placed as without stacks.

Bounded: stacks of held samples by id (``MAX_STACKS``, the oldest dropped first), the
operations (``MAX_OPS``), the frames of each (``TOP_FRAMES``, the most frequent), counts
halved as they grow (``DECAY_AT``) so that a changed release is followed; learnt only for
services where a sample was ambiguous. ``bytes`` estimates what it holds (``sizes``); under
memory pressure the state drops it first (that loses no data, only placement quality).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from processors.correlate.sizes import (
    FRAME_BYTES,
    LEARNT_FRAME_BYTES,
    OP_BYTES,
    STACK_BYTES,
)

MAX_FRAMES = 64  # frames of a stack kept, from the leaf
MAX_STACKS = 50_000  # stacks of held samples kept by id
MAX_OPS = 5_000  # operations learnt (services' backgrounds included)
TOP_FRAMES = 32  # frames kept per operation (pruned back to this at twice as many)
DECAY_AT = 4_000.0  # an operation's weight at which its counts are halved
SMOOTH = 2.0  # pseudo-samples of the service's average in each operation's estimate
MARGIN = math.log(4.0)  # how much likelier the chosen operation must be than the next
FLOOR = 1e-3  # no frequency is taken as exactly 0 or 1
SIGNATURE = 0.5  # frames on at least this share of an operation's samples: its signature
MAX_SERVICES = 100_000
BACKGROUND = "\x00"  # the name under which a service's frames are learnt, all operations


class Freq:
    """How often each frame is on the stacks of one operation's samples (weighted)."""

    __slots__ = ("n", "f", "_sig", "_adds")

    def __init__(self) -> None:
        self.n = 0.0
        self.f: dict[str, float] = {}
        self._sig: tuple[str, ...] | None = None
        self._adds = 0

    def p(self, frame: str) -> float:
        return self.f.get(frame, 0.0) / self.n if self.n else 0.0

    def signature(self) -> tuple[str, ...]:
        """Frames on most of its stacks (recomputed every 32 additions)."""
        if self._sig is None:
            cut = SIGNATURE * self.n
            self._sig = tuple(k for k, v in self.f.items() if v >= cut)
        return self._sig

    def add(self, frames: Iterable[str], w: float) -> int:
        """Add one sample's (deduplicated) frames with weight ``w``; the change in entries."""
        before = len(self.f)
        self.n += w
        f = self.f
        for fr in frames:
            f[fr] = f.get(fr, 0.0) + w
        self._adds += 1
        if self._adds >= 32:
            self._adds, self._sig = 0, None
        if len(f) > 2 * TOP_FRAMES:
            keep = sorted(f.items(), key=lambda kv: -kv[1])[:TOP_FRAMES]
            self.f = f = dict(keep)
            self._sig = None
        if self.n > DECAY_AT:
            self.n /= 2
            self.f = f = {k: v / 2 for k, v in f.items() if v > 0.5}
            self._sig = None
        return len(f) - before


class Frames:
    """Stacks of held samples, and what each operation's samples run (see the module)."""

    def __init__(self) -> None:
        self.stacks: dict[int, Sequence[str]] = {}
        self.ops: dict[tuple[str, str], Freq] = {}  # (service, name), or BACKGROUND
        self.services: set[str] = set()  # where a sample was ambiguous: learnt
        self._stack_frames = 0
        self._op_frames = 0

    def __repr__(self) -> str:
        return (f"<Frames stacks={len(self.stacks)} ops={len(self.ops)} "
                f"services={len(self.services)}>")

    @property
    def bytes(self) -> int:
        return (STACK_BYTES * len(self.stacks) + FRAME_BYTES * self._stack_frames
                + OP_BYTES * len(self.ops) + LEARNT_FRAME_BYTES * self._op_frames)

    def clear(self, learnt: bool = True) -> None:
        """Forget the stacks kept, and what was learnt unless ``learnt`` is False (memory
        is short): placement falls back to time alone until it has learnt again."""
        self.stacks.clear()
        self._stack_frames = 0
        if learnt:
            self.ops.clear()
            self._op_frames = 0

    def keep(self, stack_id: int, functions: list[str]) -> None:
        """The frames of a held sample's stack (ids are hashes of frames: stable)."""
        if stack_id in self.stacks or not functions:
            return
        frames = functions if len(functions) <= MAX_FRAMES else functions[:MAX_FRAMES]
        if len(self.stacks) >= MAX_STACKS:
            old = next(iter(self.stacks))
            self._stack_frames -= len(self.stacks.pop(old))
        self.stacks[stack_id] = frames
        self._stack_frames += len(frames)

    def ambiguous(self, service: str) -> None:
        """A sample of ``service`` could not be told apart by time: learn it from now on."""
        if len(self.services) < MAX_SERVICES:
            self.services.add(service)

    def learn(self, service: str, weights: dict[str, float], stack_id: int) -> None:
        """A sample of ``service`` with stack ``stack_id`` ran each operation with the
        weight given (one for an exact placement, a posterior for an ambiguous one)."""
        frames = self.stacks.get(stack_id)
        if frames is None:
            return
        uniq = dict.fromkeys(frames)  # in order: pruning ties fall the same way every run
        for op, w in (*weights.items(), (BACKGROUND, 1.0)):
            if w <= 0.0:
                continue
            freq = self.ops.get((service, op))
            if freq is None:
                if len(self.ops) >= MAX_OPS:
                    old = self.ops.pop(next(iter(self.ops)))
                    self._op_frames -= len(old.f)
                freq = self.ops[(service, op)] = Freq()
            self._op_frames += freq.add(uniq, w)

    def choose(self, service: str, names: Sequence[str], stack_id: int
               ) -> tuple[str | None, dict[str, float]]:
        """The operation among ``names`` (of the spans open) whose learnt frames match the
        stack, if one is clearly likelier than the others (else None), and the posterior
        of each (by how many spans of it are open where none of the stack's frames was
        learnt; empty where no stack is kept or all are of one operation)."""
        frames = self.stacks.get(stack_id)
        background = self.ops.get((service, BACKGROUND))
        ops = list(dict.fromkeys(names))
        if frames is None or len(ops) < 2:
            return None, {}
        seen = [fr for fr in dict.fromkeys(frames) if fr in background.f] \
            if background is not None else []
        if not seen:  # nothing learnt that it shows: each span as likely (learnt so)
            return None, {op: names.count(op) / len(names) for op in ops}
        present = set(seen)
        bg_n = background.n if background is not None else 1.0
        bg_f = background.f if background is not None else {}
        scores: dict[str, float] = {}
        log = math.log
        for op in ops:
            freq = self.ops.get((service, op))
            if freq is None:  # not learnt: the service's average, the same for every op
                scores[op] = sum(log(min(max(bg_f[fr] / bg_n, FLOOR), 1.0 - FLOOR))
                                 for fr in seen)
                continue
            n, fs = freq.n + SMOOTH, freq.f
            prior = SMOOTH / bg_n
            s = 0.0
            for fr in seen:
                p = (fs.get(fr, 0.0) + prior * bg_f[fr]) / n
                s += log(min(max(p, FLOOR), 1.0 - FLOOR))
            for fr in freq.signature():
                if fr not in present:
                    p = (fs[fr] + prior * bg_f.get(fr, 0.0)) / n
                    s += log(min(max(1.0 - p, FLOOR), 1.0 - FLOOR))
            scores[op] = s
        top = max(scores.values())
        weights = {op: math.exp(s - top) for op, s in scores.items()}
        # the posterior over spans: an operation with two open spans is twice as likely
        for op in ops:
            weights[op] *= names.count(op)
        total = sum(weights.values())
        posterior = {op: w / total for op, w in weights.items()}
        ranked = sorted(scores.items(), key=lambda kv: -kv[1])
        best = ranked[0][0] if ranked[0][1] - ranked[1][1] >= MARGIN else None
        return best, posterior

"""Hypothesis profiles for the decoder fuzz suite, and a count of the inputs it ran.

* ``ci`` (default, ``make test``): a few hundred examples per test, the directory in well
  under a minute;
* ``fuzz`` (``make fuzz``: ``SPANPROF_FUZZ=1`` or ``HYPOTHESIS_PROFILE=fuzz``): 2,000
  examples per hypothesis test and 120,000 mutants per decoder in test_mutations.py, over
  a million decoder inputs in all (``SPANPROF_FUZZ_EXAMPLES``, ``SPANPROF_FUZZ_MUTATIONS``
  override them).

Tests take their settings from ``FUZZ`` (not ``load_profile``: other directories'
property tests keep their own). Every decoder call made by a fuzz test is counted
(``count``); conftest.py prints the totals at the end of the session and writes them down,
so a run can report how many inputs it executed.

``run_mutants`` is the mutation loop of test_mutations.py and test_jfr.py: seeded mutants
of a corpus through a check, a failure replayable from its seed.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, settings

_COMMON: dict[str, Any] = dict(deadline=None, print_blob=True,
                               suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much,
                                                      HealthCheck.large_base_example])
settings.register_profile("ci", max_examples=int(os.environ.get("SPANPROF_FUZZ_EXAMPLES", 150)),
                          **_COMMON)
# hypothesis explores structure (~100 inputs/s); the volume comes from test_mutations.py
settings.register_profile("fuzz", max_examples=int(os.environ.get("SPANPROF_FUZZ_EXAMPLES",
                                                                  2_000)),
                          database=None, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or (
    "fuzz" if os.environ.get("SPANPROF_FUZZ") else "ci")
FUZZ = settings.get_profile(PROFILE)  # decorate each fuzz test: other suites keep theirs

INPUTS: Counter[str] = Counter()


def count(decoder: str, n: int = 1) -> None:
    INPUTS[decoder] += n


# (random source, an input to mutate, the corpus to splice from) -> a mutant
Mutator = Callable[[random.Random, bytes, list[bytes]], bytes]


def byte_mutator(inserts: Sequence[bytes], *, odd: Sequence[bytes] = (),
                 repeats: Sequence[int] = (2, 10, 1000), cap: int) -> Mutator:
    """A mutant is 1-4 edits of the input, each at a random place: a byte replaced, one of
    ``inserts`` inserted (extreme lengths, magic bytes), a slice repeated one of ``repeats``
    times (many lines, messages, frames), the rest cut, the rest taken from another corpus
    input, one of ``odd`` inserted (when given: bad UTF-8, deep nesting), a few bytes
    deleted. At most ``cap`` bytes."""
    ops = 7 if odd else 6

    def mutate(rnd: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
        out = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randint(0, len(out)) if out else 0
            op = rnd.randrange(ops)
            if op == 0 and out:
                out[min(i, len(out) - 1)] = rnd.randrange(256)
            elif op == 1:
                out[i:i] = rnd.choice(inserts)
            elif op == 2 and out:
                j = min(len(out), i + rnd.randint(1, 64))
                out[i:i] = out[i:j] * rnd.choice(repeats)
            elif op == 3:
                del out[i:]
            elif op == 4:
                other = rnd.choice(corpus)
                out[i:] = other[rnd.randint(0, len(other)):]
            elif op == 5 and odd:
                out[i:i] = rnd.choice(odd)
            else:
                del out[i:i + rnd.randint(1, 8)]
        return bytes(out[:cap])
    return mutate


def run_mutants(name: str, corpus: list[bytes], mutate: Mutator, run: Callable[[bytes], Any],
                mutants: int, *, round_robin: bool = False, counted: bool = True) -> None:
    """``mutants`` mutants of ``corpus`` through ``run``, which raises if one breaks the
    property it checks. The seed is ``SPANPROF_FUZZ_SEED``, else random; the first failure,
    of any exception type, becomes an AssertionError naming ``name``, the seed, the
    mutant's number and its bytes.

    Mutant n is made from ``corpus[n % len(corpus)]`` with ``round_robin`` (each input as
    often), else from one drawn at random. ``counted``: the inputs are counted under
    ``name``; False when ``run`` counts its own."""
    seed = int(os.environ.get("SPANPROF_FUZZ_SEED") or random.randrange(1 << 32))
    rnd = random.Random(seed)
    for n in range(mutants):
        data = mutate(rnd, corpus[n % len(corpus)] if round_robin else rnd.choice(corpus),
                      corpus)
        try:
            run(data)
        except BaseException as err:
            if counted:
                count(name, n + 1)
            raise AssertionError(f"{name}: mutant {n} of SPANPROF_FUZZ_SEED={seed} "
                                 f"raised {type(err).__name__}: {err}\n"
                                 f"input ({len(data)} bytes): {data[:4000]!r}") from err
    if counted:
        count(name, mutants)

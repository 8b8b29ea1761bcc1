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
"""

from __future__ import annotations

import os
from collections import Counter
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

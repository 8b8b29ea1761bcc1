"""Prints and records how many decoder inputs the fuzz suite ran (see support.py): in
``$SPANPROF_FUZZ_REPORT`` when set, else ``.pytest_cache/d/spanprof/fuzz-inputs.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.fuzz.support import INPUTS, PROFILE


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if not INPUTS:
        return
    total = sum(INPUTS.values())
    terminalreporter.write_sep("-", f"decoder fuzz ({PROFILE}): {total} inputs")
    for name, n in sorted(INPUTS.items()):
        terminalreporter.write_line(f"{name:32} {n:>10}")
    report = os.environ.get("SPANPROF_FUZZ_REPORT")
    cache = getattr(config, "cache", None)
    if report:
        path = Path(report)
    elif cache is not None:
        path = cache.mkdir("spanprof") / "fuzz-inputs.json"
    else:
        return
    path.write_text(json.dumps({"profile": PROFILE, "total": total, "by_decoder": INPUTS},
                               indent=1))
    terminalreporter.write_line(f"written to {path}")

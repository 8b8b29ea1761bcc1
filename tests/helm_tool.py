"""The ``helm`` binary for the chart tests: one on PATH (v3.8+ or v4), else Helm built once
from its Go module with ``go install`` and cached in ``~/.cache/spanprof/helm-VERSION``
(``SPANPROF_CACHE`` overrides the root). Building takes about 4 minutes on 2 cores."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HELM_MODULE = "helm.sh/helm/v4/cmd/helm"
HELM_VERSION = "v4.3.2"


class HelmUnavailable(RuntimeError):
    pass


def _usable(path: str) -> bool:
    try:
        out = subprocess.run([path, "version", "--short"], capture_output=True, text=True,
                             timeout=30).stdout
    except OSError:
        return False
    m = re.match(r"v(\d+)\.(\d+)", out.strip())
    return bool(m) and (int(m[1]), int(m[2])) >= (3, 8)


def helm_binary() -> str:
    found = shutil.which("helm")
    if found and _usable(found):
        return found
    cache = Path(os.environ.get("SPANPROF_CACHE", Path.home() / ".cache" / "spanprof"))
    target = cache / f"helm-{HELM_VERSION}"
    binary = target / "helm"
    if binary.exists():
        return str(binary)
    if shutil.which("go") is None:
        raise HelmUnavailable("the Helm chart tests need `helm` (3.8+) or `go` on PATH to "
                              "build it: install either")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"helm-{HELM_VERSION}.", dir=cache))  # one per build
    try:
        res = subprocess.run(["go", "install", f"{HELM_MODULE}@{HELM_VERSION}"],
                             env=dict(os.environ, GOBIN=str(tmp)), capture_output=True,
                             text=True, timeout=1200)
        if res.returncode != 0:
            raise HelmUnavailable(f"building Helm {HELM_VERSION} with go failed:\n"
                                  f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        try:
            tmp.rename(target)
        except OSError:  # another session's build got there first: use that one
            if not binary.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(binary)

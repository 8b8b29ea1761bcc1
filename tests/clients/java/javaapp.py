"""The Java programs beside this file and the three agents they run under, shared by
capture.py (run as a script: it puts the repository on ``sys.path``) and
tests/e2e/test_java_agent.py (``tests.clients.java.javaapp``).

``build()`` runs ``mvn -q -B package`` here: the programs are compiled into
``target/capture-app.jar`` (the OpenTelemetry API copied to ``target/lib``) and the agents,
as published on Maven Central and pinned in pom.xml, copied into ``target/agents``.
Maven's local repository is ``~/.cache/spanprof/m2`` (``SPANPROF_CACHE`` overrides
``~/.cache/spanprof``), so only the first build downloads anything. ``command()`` is the
``java`` command line that runs one of the programs under the Pyroscope Java agent, the
OpenTelemetry Java agent and the Pyroscope OTel extension (``io.pyroscope:otel``), which
labels the profiler's samples with the local root span.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.cachelock import cache_lock

HERE = Path(__file__).resolve().parent
M2 = Path(os.environ.get("SPANPROF_CACHE") or Path.home() / ".cache" / "spanprof") / "m2"
TARGET = HERE / "target"
JAR = TARGET / "capture-app.jar"
AGENTS = TARGET / "agents"
PYROSCOPE_AGENT = "agent-2.9.2.jar"
OTEL_AGENT = "opentelemetry-javaagent-2.33.1.jar"
OTEL_EXTENSION = "otel-1.0.2.jar"


class BuildFailed(RuntimeError):
    """No ``java`` or ``mvn``, or Maven failed (the message ends with its output)."""


def build(timeout: float = 900) -> None:
    """``mvn package`` here; raises ``BuildFailed``."""
    with cache_lock("java-client"):
        _build(timeout)


def _build(timeout: float) -> None:
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            raise BuildFailed(f"`{tool}` is not on PATH: the Java client needs a JDK 17+ "
                              "and Maven")
    M2.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(["mvn", "-q", "-B", f"-Dmaven.repo.local={M2}", "package"],
                             cwd=HERE, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise BuildFailed(f"mvn package in {HERE} took over {timeout:.0f} s") from err
    if res.returncode != 0:
        raise BuildFailed(f"mvn package in {HERE} failed ({res.returncode}):\n"
                          f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    missing = [p.name for p in (JAR, AGENTS / PYROSCOPE_AGENT, AGENTS / OTEL_AGENT,
                                AGENTS / OTEL_EXTENSION) if not p.is_file()]
    if missing:
        raise BuildFailed(f"mvn package in {HERE} left no {', '.join(missing)}")


def command(*args: str, main: str | None = None) -> list[str]:
    """``java`` with the three agents running ``main`` (a class of the jar; its
    manifest's main class, ``App``, by default) with ``args``. The agents read their
    settings from the environment (``PYROSCOPE_*``, ``OTEL_*``)."""
    agents = [f"-javaagent:{AGENTS / PYROSCOPE_AGENT}", f"-javaagent:{AGENTS / OTEL_AGENT}",
              f"-Dotel.javaagent.extensions={AGENTS / OTEL_EXTENSION}"]
    # the jar's manifest puts target/lib (the OpenTelemetry API) on the class path either way
    run = ["-jar", str(JAR)] if main is None else ["-cp", str(JAR), main]
    return ["java", *agents, *run, *args]

"""pipeline/graph.py: what the graph tells the components it builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_file
from pipeline.graph import build
from pipeline.registry import default_factories

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = default_factories()


@pytest.mark.parametrize(("config", "records"), [
    # the gateway only passes OTLP on (memory_limiter, kafka): requests are validated, no
    # records built
    ("gateway.yaml", {"traces": False, "profiles": False}),
    # the embedded pipeline stores and correlates: records everywhere
    ("local.yaml", {"traces": True, "profiles": True}),
])
def test_receivers_build_records_only_when_something_reads_them(
        config: str, records: dict[str, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANPROF_KAFKA_BROKERS", "127.0.0.1:1")
    graph = build(load_file(str(ROOT / "config" / config), FACTORIES), FACTORIES)
    otlp = graph.component("receiver", "otlp")
    assert otlp.grpc.ctx.records == records

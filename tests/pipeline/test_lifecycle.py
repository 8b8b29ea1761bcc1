"""Every registered component: create from defaults, start, shutdown twice; shutdown
without start. (The Collector's generated lifecycle test.)"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pipeline.records import Batch
from pipeline.registry import Context, default_factories

FACTORIES = default_factories()
ALL = [(kind, t) for kind, fs in FACTORIES.items() for t in fs]


class Sink:
    async def consume(self, batch: Batch) -> None:
        pass


def make(kind: str, type_: str, tmp_path: Path, request: pytest.FixtureRequest) -> object:
    f = FACTORIES[kind][type_]  # type: ignore[index]
    raw: dict[str, object] = {}
    if type_ == "otlp":
        raw = {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}
    if type_ == "pyroscope":
        raw = {"endpoint": "127.0.0.1:0"}
    if type_ == "tenantauth":
        raw = {"tokens": {"tok-lifecycle-0123456789": "team-a"}}
    if type_ == "kafka":  # the real broker: a receiver cannot start without one
        raw = {"brokers": [request.getfixturevalue("kafka_broker").bootstrap],
               "traces": {"topic": "lifecycle_spans"},
               "profiles": {"topic": "lifecycle_profiles"}}
    cfg = msgspec.convert(raw, f.config)
    signals = f.emits if kind == "connector" else f.signals
    nxt = {signals[0]: Sink()} if kind == "processor" else {s: Sink() for s in signals}
    return f.create(cfg, Context(type_, ["traces"], next=nxt, data_dir=str(tmp_path)))


class TestLifecycle:
    @pytest.mark.parametrize("kind,type_", ALL)
    async def test_start_shutdown_twice(self, kind: str, type_: str, tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:
        """start() returns, shutdown() works and is idempotent."""
        c = make(kind, type_, tmp_path, request)
        await c.start()  # type: ignore[attr-defined]
        await c.shutdown()  # type: ignore[attr-defined]
        await c.shutdown()  # type: ignore[attr-defined]

    @pytest.mark.parametrize("kind,type_", ALL)
    async def test_shutdown_without_start(self, kind: str, type_: str, tmp_path: Path,
                                          request: pytest.FixtureRequest) -> None:
        """shutdown() is safe on a component that never started."""
        c = make(kind, type_, tmp_path, request)
        await c.shutdown()  # type: ignore[attr-defined]
        assert repr(c)

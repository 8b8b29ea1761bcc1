"""The ``otlp`` receiver's intake log, end to end (pipeline/receivers/intake.py): requests
answered once logged while ClickHouse refuses every insert, the process SIGKILLed before
anything was stored, started again with ClickHouse back: every span, sample and
attribution stored exactly once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.conftest import SpanprofProcess
from tests.e2e.test_resend_after_crash import _requests, _send, _stored

pytestmark = pytest.mark.e2e


class TestIntake:
    def test_answered_while_clickhouse_refuses_then_killed(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        flags = tmp_path / "flags"
        flags.mkdir()
        monkeypatch.setenv("SPANPROF_FAILPOINTS", str(flags))
        # no sending queue: the exporter's insert is what the pipeline waits for
        p = SpanprofProcess(tmp_path / "sp", grace="1s", receiver_extra="intake: {}")
        p.start()
        (flags / "clickhouse_down").touch()  # every insert refused from now on
        traces, profiles, want = _requests()
        t0 = time.monotonic()
        _send(p, traces, profiles)  # answered: logged, not stored
        assert time.monotonic() - t0 < 5
        time.sleep(1)
        p.stop(signal.SIGKILL)
        assert list((tmp_path / "sp" / "intake" / "otlp").glob("*.log"))

        (flags / "clickhouse_down").unlink()
        p.start()
        assert "intake_replay" in p.logs()
        _send(p, traces, profiles)  # the client's resend, had it heard nothing
        assert p.stop(signal.SIGTERM) == 0
        spans, samples, cpu = _stored(p.data)
        assert (spans, samples) == (20, 20)
        assert cpu == want

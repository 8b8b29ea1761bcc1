"""The ClickHouse exporter's sending queue, end to end: requests acknowledged while
ClickHouse refuses every insert (they are logged on local disk), the process SIGKILLed,
started again with ClickHouse back: every span, sample and attribution stored exactly
once (pipeline/exporters/clickhouse/queue.py). A kill right after acknowledging, and the
client's resend, is in test_resend_after_crash.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.conftest import SpanprofProcess
from tests.e2e.test_resend_after_crash import _requests, _send, _stored

pytestmark = pytest.mark.e2e
QUEUE = "sending_queue: {enabled: true}"


class TestSendingQueue:
    def test_acknowledged_while_clickhouse_refuses_then_killed(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        flags = tmp_path / "flags"
        flags.mkdir()
        monkeypatch.setenv("SPANPROF_FAILPOINTS", str(flags))
        p = SpanprofProcess(tmp_path / "sp", grace="1s", exporter_extra=QUEUE)
        p.start()
        (flags / "clickhouse_down").touch()  # every insert refused from now on
        traces, profiles, want = _requests()
        t0 = time.monotonic()
        _send(p, traces, profiles)  # acknowledged: logged, not inserted
        assert time.monotonic() - t0 < 5
        time.sleep(3)  # past grace: the correlator's rows are logged too
        p.stop(signal.SIGKILL)
        assert list((tmp_path / "sp" / "queue" / "clickhouse").glob("*.log"))

        (flags / "clickhouse_down").unlink()
        p.start()  # the log is inserted before the pipeline takes anything new
        assert "queue_replayed" in p.logs()
        assert p.stop(signal.SIGTERM) == 0
        spans, samples, cpu = _stored(p.data)
        assert (spans, samples) == (20, 20)
        assert cpu == want

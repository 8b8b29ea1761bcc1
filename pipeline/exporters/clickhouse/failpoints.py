"""Fault injection for fault runs (``bench/faults.py``): ClickHouse "down" on demand.

The embedded engine lives inside the process, so it cannot be stopped on its own the way a
server can. When ``SPANPROF_FAILPOINTS`` names a directory, the exporter's client is
wrapped: while a file ``clickhouse_down`` exists there, every call fails the way a refused
connection does (``OperationalError``, which the writer treats as retryable). Unset, the
client is used as is: no cost, no behaviour change.
"""

from __future__ import annotations

import os
from typing import Any

from pipeline.exporters.clickhouse.backend import ClickHouseClient

ENV = "SPANPROF_FAILPOINTS"


class ClickHouseDown(OSError):
    """What the wrapped client raises while the failpoint is on: an ``OSError`` like a
    refused connection (``ECONNREFUSED``), so that it is classified as a network error."""


class FailingClient:
    """A clickhouse-connect client whose calls fail while ``<dir>/clickhouse_down`` exists."""

    def __init__(self, client: ClickHouseClient, directory: str) -> None:
        self._client = client
        self._flag = os.path.join(directory, "clickhouse_down")

    def _check(self) -> None:
        if os.path.exists(self._flag):
            raise ClickHouseDown(111, "Connection refused (failpoint clickhouse_down)")

    def insert(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return self._client.insert(*args, **kwargs)

    def query(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return self._client.query(*args, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return self._client.command(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def wrap(client: ClickHouseClient) -> ClickHouseClient:
    """The client, wrapped when fault injection is on (``SPANPROF_FAILPOINTS`` set)."""
    directory = os.environ.get(ENV)
    return FailingClient(client, directory) if directory else client

"""Crash recovery per tenant (issue #17), on the real embedded engine: two tenants' raw spans
and samples with the very same trace and span ids, stored but never attributed (the
correlator died holding them); recovery replays each tenant's with its own rows only, and
every batch it sends names that tenant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipeline.exporters.clickhouse.exporter import ClickHouseExporter, Config
from pipeline.records import (
    AttributionBatch,
    ProfileBatch,
    Sample,
    Span,
    SpanBatch,
    Stack,
    Unattributed,
)
from pipeline.registry import Context
from processors.correlate import readback, recovery

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
TID, ROOT, CHILD, EXTRA = b"\x0a" * 16, b"\x0b" * 8, b"\x0c" * 8, b"\x0d" * 8
# per tenant: CPU on the root (labelled), on the child (labelled by span id alone), and
# unlabelled, at T0 + 700 ms: after a's spans, during b's extra span
CPU = {"a": (10 * MS, 4 * MS, 3 * MS), "b": (40 * MS, 20 * MS, 7 * MS)}
MINUTE = T0 - T0 % (60 * 10**9)


def raw(tenant: str) -> tuple[SpanBatch, ProfileBatch]:
    root_cpu, child_cpu, unlabelled = CPU[tenant]
    spans = [Span(TID, ROOT, b"", f"GET /{tenant}", 2, "api", T0, T0 + 500 * MS),
             Span(TID, CHILD, ROOT, "query", 3, "api", T0 + 100 * MS, T0 + 300 * MS)]
    if tenant == "b":  # only b has a span open when the unlabelled samples were taken
        spans.append(Span(TID, EXTRA, ROOT, "extra", 1, "api", T0 + 600 * MS, T0 + 800 * MS))
    stacks = {7: Stack(7, [f"fn_{tenant}", "main"], ["a.py", "a.py"], [1, 2])}
    samples = [Sample(TID, ROOT, "api", T0 + 50 * MS, 7, "cpu", root_cpu, 1, "cpu", "ns"),
               Sample(b"", CHILD, "api", T0 + 150 * MS, 7, "cpu", child_cpu, 1, "cpu", "ns"),
               Sample(b"", b"", "api", T0 + 700 * MS, 7, "cpu", unlabelled, 1, "cpu", "ns",
                      timed=True)]
    return (SpanBatch(spans, tenant=tenant), ProfileBatch(samples, stacks, tenant=tenant))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ClickHouseExporter]:
    ex = ClickHouseExporter(Config(endpoint=f"chdb://{tmp_path}/ch", flush_interval=0.05,
                                   ttl=0),
                            Context("clickhouse", ["traces"], data_dir=str(tmp_path)))
    try:
        await ex.start()
        for tenant in CPU:
            for batch in raw(tenant):
                await ex.consume(batch)
        # b's unlabelled CPU was reconciled before the crash (as unattributed), a's not
        await ex.consume(AttributionBatch([], [Unattributed("api", MINUTE, CPU["b"][2], 0, 1,
                                                            99)], tenant="b"))
        yield ex
    finally:
        await ex.shutdown()


class TestRecoveryPerTenant:
    async def test_each_tenant_is_read_back_alone(self, store: ClickHouseExporter) -> None:
        """The traces and services touched are (tenant, ...) pairs, and loading one
        tenant's trace reads its spans, samples (the span-only one too) and stacks only."""
        traces, skipped = await readback.affected(store, 0)
        assert sorted(traces) == [("a", TID.hex()), ("b", TID.hex())] and skipped == 0
        assert [s[:2] for s in await readback.unlabelled_services(store, 0)] == \
            [("a", "api"), ("b", "api")]
        for tenant, (root_cpu, child_cpu, _) in CPU.items():
            spans, samples, stacks, stored = await readback.load(store, tenant, [TID.hex()])
            assert {s.name for s in spans} == {f"GET /{tenant}", "query"} | (
                {"extra"} if tenant == "b" else set())
            assert sorted(x.value for x in samples) == sorted([root_cpu, child_cpu])
            assert stacks[7].functions == [f"fn_{tenant}"]
            assert stored.rows == {}
        assert await readback.load(store, "c", [TID.hex()]) == ([], [], {}, readback.Stored())

    async def test_recovery_writes_each_tenants_rows_under_its_tenant_once(
            self, store: ClickHouseExporter) -> None:
        """Recovery sends batches naming their tenant, each with that tenant's CPU only
        (the same trace and span ids in both): a's unlabelled CPU is not placed in b's
        span, nor taken as reconciled by b's stored minute; b's, already stored, is not
        written again. Once written, a second recovery sends nothing."""
        sent: list[AttributionBatch] = []

        async def send(batch: AttributionBatch) -> None:
            sent.append(batch)
            await store.consume(batch)

        res = await recovery.recover(store, 0, send)
        assert res.traces == 2 and res.services == 2
        assert {b.tenant for b in sent} == {"a", "b"}
        for tenant, (root_cpu, child_cpu, unlabelled) in CPU.items():
            mine = [b for b in sent if b.tenant == tenant]
            link = {a.span_id: a.cpu_ns for b in mine for a in b.attributions
                    if a.method in ("link", "link+time")}
            assert link == {ROOT: root_cpu, CHILD: child_cpu}, tenant
            approx = sum(a.cpu_ns for b in mine for a in b.attributions
                         if a.method in ("thread", "window"))
            owed = unlabelled if tenant == "a" else 0  # b's was stored before
            assert approx + sum(u.cpu_ns for b in mine for u in b.unattributed) == owed
            assert not any(a.span_id == EXTRA for b in mine for a in b.attributions
                           if tenant == "a")
            assert {f for b in mine for a in b.attributions for f in a.self_cpu_ns} == \
                {f"fn_{tenant}"}
            _, got = await store.query(
                "SELECT span_id, sum(cpu_ns) FROM spanprof.span_attribution_totals WHERE "
                "tenant = {t:String} AND method IN ('link', 'link+time') GROUP BY span_id "
                "ORDER BY span_id", {"t": tenant})
            assert got == [(ROOT.hex(), root_cpu), (CHILD.hex(), child_cpu)], tenant
        again: list[AttributionBatch] = []

        async def keep(batch: AttributionBatch) -> None:
            again.append(batch)

        res = await recovery.recover(store, 0, keep)
        assert (res.rows, res.cpu_ns) == (0, 0) and again == []

    async def test_stored_rows_must_name_their_tenant(self, store: ClickHouseExporter) -> None:
        """A read of stored rows without a tenant filter is refused, not run."""
        with pytest.raises(ValueError, match="tenant"):
            await readback._stored(store, readback.Stored(), "trace_id = ''", {}, {})

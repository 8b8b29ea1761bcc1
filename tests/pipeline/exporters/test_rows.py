"""Attribution rows -> columns (``rows.attributions``), against a plain statement of what
the rows are: a span's row; a row per function the span has CPU, wall time, lock wait or
allocations in; a row per stack it has CPU or wall time in; each repeating its span's ids,
method, source, service, operation, minute, ``span_known`` and duration."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.exporters.clickhouse import rows
from pipeline.records import Attribution, AttributionBatch, Unattributed

FNS = st.dictionaries(st.sampled_from(["main", "parse", "λ", "", "lock"]),
                      st.integers(0, 2**63), max_size=3)
STACKS = st.dictionaries(st.integers(0, 2**64 - 1), st.integers(0, 2**63), max_size=3)
ATTRIBUTION = st.builds(
    Attribution, st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8),
    st.sampled_from(["link", "window", "link+share"]), st.sampled_from(["api", "db"]),
    st.sampled_from(["GET /", "query"]), st.sampled_from([b"", bytes(range(8))]),
    st.integers(0, 2**63 - 1), st.integers(0, 2**40), st.booleans(), st.integers(0, 2**40),
    st.integers(0, 2**40), st.integers(0, 2**31), FNS, FNS, st.integers(0, 2**64 - 1),
    st.integers(0, 2**40), STACKS, STACKS, st.integers(0, 2**40), st.integers(0, 2**40),
    FNS, FNS)


def expected(batch: AttributionBatch) -> dict[str, Counter[tuple[Any, ...]]]:
    """The rows of each table, as a multiset of tuples in ``rows.COLUMNS`` order."""
    out: dict[str, Counter[tuple[Any, ...]]] = {}
    t = batch.tenant
    for a in batch.attributions:
        tid, sid = a.trace_id.hex(), a.span_id.hex()
        minute = a.start_ns // 10**9 // 60 * 60
        known = int(a.span_known)
        out.setdefault("span_attribution", Counter())[(
            t, tid, sid, a.method, a.source, a.service, a.name, a.parent_span_id.hex(),
            a.start_ns, a.duration_ns, known, a.cpu_ns, a.wall_ns, a.sample_count,
            a.inclusive_cpu_ns, a.lock_ns, a.alloc_bytes)] += 1
        per_fn = (a.self_cpu_ns, a.self_wall_ns, a.self_lock_ns, a.self_alloc_bytes)
        for fn in set().union(*per_fn):
            cpu, wall, lock, alloc = (d.get(fn, 0) for d in per_fn)
            out.setdefault("span_functions", Counter())[(
                t, tid, sid, a.method, fn, a.source, cpu, wall, a.service, a.name, minute,
                known, a.duration_ns, lock, alloc)] += 1
        for stack in a.stack_cpu_ns.keys() | a.stack_wall_ns.keys():
            out.setdefault("span_stacks", Counter())[(
                t, tid, sid, a.method, stack, a.source, a.service, a.name, minute, known,
                a.stack_cpu_ns.get(stack, 0), a.stack_wall_ns.get(stack, 0),
                a.duration_ns)] += 1
    for u in batch.unattributed:
        out.setdefault("unattributed_cpu", Counter())[(
            t, u.service, u.minute_ns // 10**9, u.source, u.cpu_ns, u.wall_ns,
            u.sample_count)] += 1
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(ATTRIBUTION, max_size=12),
       st.lists(st.builds(Unattributed, st.sampled_from(["api"]), st.integers(0, 2**62),
                          st.integers(0, 9), st.integers(0, 9), st.integers(0, 9),
                          st.integers(0, 9)), max_size=2),
       st.sampled_from(["default", "acme"]))
def test_attribution_columns_are_the_rows(attributions: list[Attribution],
                                          unattributed: list[Unattributed],
                                          tenant: str) -> None:
    batch = AttributionBatch(attributions, unattributed, tenant=tenant)
    tables = rows.attributions(batch)
    got: dict[str, Counter[tuple[Any, ...]]] = {}
    for table, cols in tables.items():
        assert list(cols) == rows.COLUMNS[table], table  # every column, in order
        assert len({len(c) for c in cols.values()}) == 1, table  # of one length
        got[table] = Counter(zip(*cols.values(), strict=True))
    assert got == expected(batch)


@settings(max_examples=50, deadline=None)
@given(st.lists(ATTRIBUTION, max_size=25), st.integers(1, 7))
def test_slices_add_up_to_the_batch(attributions: list[Attribution], size: int) -> None:
    """The exporter builds a large batch's rows a slice at a time: the slices, extended
    one after the other, are the whole batch's columns (same rows, same order), and the
    unattributed CPU comes once."""
    import unittest.mock

    batch = AttributionBatch(attributions, [Unattributed("api", 60 * 10**9, 1, 2, 3, 4)],
                             tenant="acme")
    whole: dict[str, rows.Columns] = {}
    with unittest.mock.patch.object(rows, "SLICE", size):
        parts = list(rows.attribution_slices(batch))
    assert len(parts) == max(1, -(-len(attributions) // size))
    for part in parts:
        rows.extend(whole, part)
    assert whole == rows.attributions(batch)


def test_nested_groups_left_out_only_when_empty_in_every_row() -> None:
    """An insert leaves out the events or links columns (all of a group) only when no row
    has any: the engine then fills the same empty arrays."""
    cols: dict[str, list[object]] = {c: [[]] * 3 for c in rows.COLUMNS["otel_traces"]}
    names = rows.insert_columns("otel_traces", cols)
    assert not [c for c in names if c.startswith(("Events.", "Links."))]
    assert [c for c in rows.COLUMNS["otel_traces"] if c not in names] == [
        c for c in rows.COLUMNS["otel_traces"] if c.startswith(("Events.", "Links."))]
    cols["Events.Timestamp"] = [[], [1], []]
    names = rows.insert_columns("otel_traces", cols)
    assert [c for c in names if c.startswith("Events.")] == [
        "Events.Timestamp", "Events.Name", "Events.Attributes"]
    assert not [c for c in names if c.startswith("Links.")]
    assert rows.insert_columns("span_functions", {}) == rows.COLUMNS["span_functions"]

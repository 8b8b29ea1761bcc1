"""Where a ``files`` or ``kafka`` job's data comes from: one unit per file (``files.py``
reads it), or per partition range of a topic (``kafka_range.py`` reads it).

A file's pieces are gathered into blocks of about ``BLOCK_ITEMS`` spans or samples, each
inserted under the deduplication token ``backfill/<file id>/<signal>/<first>-<last>``
(its first and last piece's place in the file), so a file loaded again after a kill, or
in a second run, adds nothing to the raw tables. The file id hashes its path, size and
modification time; a file changed since the job was planned fails its unit rather than
load something else under the old plan.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from pipeline.backfill import files
from pipeline.backfill.file_pieces import DEFAULT_LIMITS, Bad, Limits, Origin
from pipeline.backfill.job import ANY_TENANT, Loaded, Loader, Source
from pipeline.backfill.kafka_blocks import PartitionRange, split
from pipeline.backfill.kafka_range import KafkaRange
from pipeline.backfill.reattribute import Figures, Unbalanced
from pipeline.kafka import ClientConfig
from pipeline.records import Batch, ProfileBatch, SpanBatch, concat

BLOCK_ITEMS = 20_000  # spans or samples per insert block
UNIT_OFFSETS = 100_000  # messages of a partition per unit (rounded to whole blocks)
MAX_REFUSED = 20  # refusals named per file (the rest counted)


class FileSource(Source):
    def __init__(self, paths: list[Path], tenant: str, service: str = "",
                 limits: Limits = DEFAULT_LIMITS, horizon_ns: int = 0) -> None:
        self.paths = paths
        self.tenant = tenant
        self.service = service
        self.limits = limits
        # the store's ttl: what is older, ClickHouse would drop on insert; refused instead
        self.horizon_ns = horizon_ns

    async def plan(self) -> list[Loader]:
        out = []
        for p in self.paths:
            st = os.stat(p)
            fid = hashlib.blake2b(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(),
                                  digest_size=8).hexdigest()
            out.append(Loader(id=f"file/{p}", tenant=self.tenant, size=st.st_size,
                              spec={"path": str(p), "size": st.st_size,
                                    "mtime_ns": st.st_mtime_ns, "id": fid}))
        return out

    async def load(self, unit: Loader, send: Callable[[Batch], Awaitable[None]]) -> Loaded:
        path = Path(unit.spec["path"])
        try:
            st = os.stat(path)
        except OSError as err:
            raise Unbalanced(f"{path}: cannot read it: {err.strerror or err}") from None
        if (st.st_size, st.st_mtime_ns) != (unit.spec["size"], unit.spec["mtime_ns"]):
            raise Unbalanced(f"{path}: changed since the job was planned (size or time): "
                             "start a new job")
        fid = unit.spec["id"]
        got = Loaded(Figures())
        f = got.figures
        held: dict[str, list[tuple[Origin, Batch]]] = {"traces": [], "profiles": []}
        count = {"traces": 0, "profiles": 0}
        refused = 0

        async def flush(signal: str) -> None:
            pieces = held[signal]
            if not pieces:
                return
            batch = concat([b for _, b in pieces])
            batch.tenant = unit.tenant
            batch.origin = f"backfill/{fid}/{signal}/{pieces[0][0].at}-{pieces[-1][0].at}"
            await send(batch)
            f.rows_written += len(batch)
            held[signal], count[signal] = [], 0

        items = files.read(path, self.limits, self.service)
        # read and decoded in a thread: a job submitted to a running pipeline must not
        # stall its event loop
        while (item := await asyncio.to_thread(next, items, None)) is not None:
            if isinstance(item, Bad):
                refused += 1
                if len(got.refused) < MAX_REFUSED:
                    got.refused.append(item.error)
                continue
            if item.rejected:
                refused += item.rejected
                if len(got.refused) < MAX_REFUSED:
                    got.refused.append(f"{item.origin}: {item.message}")
            b = _within(item.batch, self.horizon_ns)
            if len(b) < len(item.batch):
                old = len(item.batch) - len(b)
                refused += old
                if len(got.refused) < MAX_REFUSED:
                    got.refused.append(f"{item.origin}: {old} older than the store's ttl "
                                       "(ClickHouse would drop them; raise the clickhouse "
                                       "exporter's ttl, or 0, to backfill them)")
            if not len(b):
                continue
            _count(got, b)
            held[b.signal].append((item.origin, b))
            count[b.signal] += len(b)
            if count[b.signal] >= BLOCK_ITEMS:
                await flush(b.signal)
        await flush("traces")
        await flush("profiles")
        if refused > len(got.refused):
            got.refused.append(f"{path}: {refused - len(got.refused)} more refused")
        return got


def _within(b: SpanBatch | ProfileBatch, horizon_ns: int) -> SpanBatch | ProfileBatch:
    """``b`` less what starts before ``horizon_ns``."""
    if not horizon_ns:
        return b
    if isinstance(b, SpanBatch):
        if all(s.start_ns >= horizon_ns for s in b.spans):
            return b
        return SpanBatch([s for s in b.spans if s.start_ns >= horizon_ns])
    if all(s.time_ns >= horizon_ns for s in b.samples):
        return b
    return ProfileBatch([s for s in b.samples if s.time_ns >= horizon_ns], b.stacks)


class KafkaSource(Source):
    """Topics over offset ranges (``offsets``: partition -> [from, to)) or a time range
    (``since`` / ``until``, ns; an open end is the end offset when the job is planned),
    read without a consumer group; each block inserted under its own token
    (``kafka_blocks``), so a block read again adds nothing."""

    def __init__(self, cfg: ClientConfig, topics: list[str], *,
                 offsets: dict[int, tuple[int, int]] | None = None,
                 since: int | None = None, until: int | None = None) -> None:
        self.cfg = cfg
        self.topics = topics
        self.offsets = offsets
        self.since, self.until = since, until

    async def plan(self) -> list[Loader]:
        out = []
        for topic in self.topics:
            async with KafkaRange(self.cfg, topic) as src:
                ranges = await src.plan(offsets=self.offsets, since=self.since,
                                        until=self.until)
            for r in split(ranges, UNIT_OFFSETS):
                out.append(Loader(id=f"kafka/{r}", tenant=ANY_TENANT, messages=r.messages,
                                  spec={"topic": r.topic, "partition": r.partition,
                                        "start": r.start, "end": r.end}))
        return out

    async def load(self, unit: Loader, send: Callable[[Batch], Awaitable[None]]) -> Loaded:
        spec = unit.spec
        r = PartitionRange(spec["topic"], spec["partition"], spec["start"], spec["end"])
        got = Loaded(Figures())
        f = got.figures
        async with KafkaRange(self.cfg, r.topic) as src:
            async for block in src.read([r]):
                if block.malformed or block.rejected:
                    got.refused.append(f"{r.topic}/{r.partition} offsets {block.first}-"
                                       f"{block.last}: {block.malformed} malformed messages, "
                                       f"{block.rejected} items refused")
                for b in block.batches:
                    _count(got, b)
                    await send(b)
                    f.rows_written += len(b)
        return got


def _count(got: Loaded, b: Batch) -> None:
    """Add a batch to a unit's figures: items, CPU, and the times it covers (the range
    the job attributes next, per tenant)."""
    f = got.figures
    f.rows_read += len(b)
    if isinstance(b, SpanBatch):
        got.spans += len(b)
        for s in b.spans:
            f.touch(s.start_ns)
    elif isinstance(b, ProfileBatch):
        got.samples += len(b)
        for x in b.samples:
            f.touch(x.time_ns)
            if x.measure == "cpu":
                f.cpu_in += x.value

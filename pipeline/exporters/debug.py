"""``debug`` exporter: logs what passes through (counts, or every item at ``detailed``).

    exporters:
      debug:
        verbosity: basic   # basic | detailed
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import msgspec

from pipeline.records import Batch
from pipeline.registry import Context, Factory


class Config(msgspec.Struct, forbid_unknown_fields=True):
    verbosity: Literal["basic", "detailed"] = "basic"


class DebugExporter:
    def __init__(self, cfg: Config, ctx: Context) -> None:
        self.cfg = cfg
        self.log = ctx.log
        self.totals: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"<DebugExporter {dict(self.totals)}>"

    async def start(self) -> None:
        pass

    async def consume(self, batch: Batch) -> None:
        self.totals[batch.signal] += len(batch)
        self.log.info("debug_batch", signal=batch.signal, items=len(batch),
                      total=self.totals[batch.signal])
        if self.cfg.verbosity == "detailed":
            self.log.info("debug_items", items=msgspec.to_builtins(batch))

    async def shutdown(self) -> None:
        pass


def create(cfg: Config, ctx: Context) -> DebugExporter:
    return DebugExporter(cfg, ctx)


FACTORY = Factory(type="debug", kind="exporter", config=Config, create=create,
                  signals=("traces", "profiles", "attributions"))

"""``service.pipelines`` -> running components.

One instance per receiver, exporter and connector id (shared by every pipeline naming it);
processors get one instance per pipeline, as in the Collector. Components are started
downstream-first and shut down upstream-first (receivers, processors, connectors, then
exporters), so every stage drains into a stage that is still running.

The factories are the ones the config was loaded with (``pipeline.config.load_file``): the
caller passes both, so the graph creates exactly the types the config was checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from pipeline.component import Consumer, Context, Factories, Fanout
from pipeline.config import Config, component_type, signal_of
from pipeline.errors import ConfigError
from pipeline.tenants import Tenants


@dataclass
class Node:
    key: str  # "receiver:otlp", "processor:batch@traces", ...
    component: Any
    downstream: set[str] = field(default_factory=set)


@dataclass
class Graph:
    nodes: dict[str, Node]
    order: list[str]  # upstream first
    # the tenants' limits and counters, shared by the receivers and connectors
    tenants: Tenants = field(default_factory=Tenants)

    def component(self, kind: str, cid: str) -> Any:
        return self.nodes[f"{kind}:{cid}"].component

    def components(self, kind: str) -> dict[str, Any]:
        prefix = f"{kind}:"
        return {k[len(prefix):]: n.component for k, n in self.nodes.items()
                if k.startswith(prefix)}

    async def start(self) -> None:
        started: list[str] = []
        try:
            for key in reversed(self.order):
                await self.nodes[key].component.start()
                started.append(key)
        except BaseException:
            for key in reversed(started):
                try:
                    await self.nodes[key].component.shutdown()
                except Exception:
                    structlog.get_logger().exception("shutdown_failed", component=key)
            raise

    async def shutdown(self) -> None:
        for key in self.order:
            try:
                await self.nodes[key].component.shutdown()
            except Exception:
                structlog.get_logger().exception("shutdown_failed", component=key)


def create_extensions(cfg: Config, factories: Factories) -> dict[str, Any]:
    """The extensions ``service.extensions`` names, created (not started), by id: what
    ``build`` hands the listeners that name one (``auth: {authenticator: ID}``). Creating
    one does no I/O, so ``spanprof validate`` builds them too."""
    return {eid: factories["extension"][component_type(eid)].create(
                cfg.extensions[eid], Context(eid, []))
            for eid in cfg.service.extensions}


def build(cfg: Config, factories: Factories,
          authenticators: Mapping[str, Any] | None = None) -> Graph:
    """``authenticators``: the started extensions, by id, for receivers' ``auth:``."""
    pipelines = cfg.service.pipelines
    data_dir = cfg.service.data_dir
    tenants = Tenants(cfg.service.tenants)
    nodes: dict[str, Node] = {}
    heads: dict[str, Consumer] = {}  # pipeline id -> its first consumer

    def log(cid: str, pids: list[str]) -> Any:
        return structlog.get_logger().bind(component=cid, pipeline=",".join(pids))

    def pipelines_using(cid: str, role: str) -> list[str]:
        return [pid for pid, p in pipelines.items() if cid in getattr(p, role)]

    # pipeline order: one that feeds a connector comes before the pipelines it feeds
    feeds: dict[str, set[str]] = {pid: set() for pid in pipelines}
    for pid, p in pipelines.items():
        for cid in p.exporters:
            if cid in cfg.connectors:
                feeds[pid] |= set(pipelines_using(cid, "receivers"))
    porder = _toposort(feeds, "service.pipelines")

    def exporter(cid: str) -> Any:
        key = f"exporter:{cid}"
        if key not in nodes:
            f = factories["exporter"][component_type(cid)]
            pids = pipelines_using(cid, "exporters")
            nodes[key] = Node(key, f.create(cfg.exporters[cid],
                                            Context(cid, pids, log=log(cid, pids),
                                                    data_dir=data_dir)))
        return nodes[key].component

    def connector(cid: str) -> Any:
        key = f"connector:{cid}"
        if key not in nodes:
            f = factories["connector"][component_type(cid)]
            outs = pipelines_using(cid, "receivers")
            nxt = {}
            for sig in {signal_of(p) for p in outs}:
                nxt[sig] = _fan([heads[p] for p in outs if signal_of(p) == sig])
            ins = pipelines_using(cid, "exporters")
            pids = ins + outs
            nodes[key] = Node(key, f.create(cfg.connectors[cid],
                                            Context(cid, pids, next=nxt, log=log(cid, pids),
                                                    data_dir=data_dir,
                                                    store=store_for(ins, outs),
                                                    tenants=tenants)))
            nodes[key].downstream |= {n for p in outs for n in _pipeline_nodes[p]}
        return nodes[key].component

    def store_for(ins: list[str], outs: list[str]) -> Any:
        """The ``clickhouse`` exporter a connector's output ends in (its checkpoint and crash
        recovery read and write there); None when there is none, or when any input comes
        from Kafka: there, uncommitted messages are delivered again after a crash, and
        rows recovered from the store would then be counted twice."""
        if any(component_type(r) == "kafka" for p in ins for r in pipelines[p].receivers):
            return None
        for p in outs:
            for c in pipelines[p].exporters:
                if c not in cfg.connectors and component_type(c) == "clickhouse":
                    return nodes[f"exporter:{c}"].component
        return None

    def receiver_store(pids: list[str]) -> Any:
        """The ``clickhouse`` exporter a receiver's pipelines store into (it reads there
        the requests stored before a restart, ``pipeline/receivers/idempotency.py``)."""
        for p in pids:
            for c in pipelines[p].exporters:
                if c not in cfg.connectors and component_type(c) == "clickhouse":
                    return nodes[f"exporter:{c}"].component
        return None

    def reads_records(pid: str) -> bool:
        """Whether a component of the pipeline reads records (connectors always do)."""
        p = pipelines[pid]
        return (any(factories["processor"][component_type(c)].records for c in p.processors)
                or any(c in cfg.connectors or factories["exporter"][component_type(c)].records
                       for c in p.exporters))

    _pipeline_nodes: dict[str, set[str]] = {}
    for pid in reversed(porder):  # downstream pipelines first: connectors need their heads
        p = pipelines[pid]
        signal = signal_of(pid)
        exps = [exporter(c) for c in p.exporters if c not in cfg.connectors]
        conns = [connector(c) for c in p.exporters if c in cfg.connectors]
        targets = {f"exporter:{c}" if c not in cfg.connectors else f"connector:{c}"
                   for c in p.exporters}
        consumer: Consumer = Fanout(exps, conns) if len(exps) + len(conns) > 1 else \
            (exps or conns)[0]
        for cid in reversed(p.processors):
            f = factories["processor"][component_type(cid)]
            key = f"processor:{cid}@{pid}"
            proc = f.create(cfg.processors[cid], Context(cid, [pid], next={signal: consumer},
                                                          log=log(cid, [pid]),
                                                          data_dir=data_dir))
            nodes[key] = Node(key, proc, downstream=targets)
            targets, consumer = {key}, proc
        heads[pid] = consumer
        _pipeline_nodes[pid] = targets

    for pid in porder:
        for cid in pipelines[pid].receivers:
            if cid in cfg.connectors:
                continue
            key = f"receiver:{cid}"
            if key in nodes:
                continue
            pids = pipelines_using(cid, "receivers")
            nxt = {}
            for sig in {signal_of(p) for p in pids}:
                nxt[sig] = _fan([heads[p] for p in pids if signal_of(p) == sig])
            f = factories["receiver"][component_type(cid)]
            records = {sig: any(reads_records(p) for p in pids if signal_of(p) == sig)
                       for sig in nxt}
            nodes[key] = Node(key, f.create(cfg.receivers[cid],
                                            Context(cid, pids, next=nxt, log=log(cid, pids),
                                                    data_dir=data_dir,
                                                    store=receiver_store(pids),
                                                    records=records,
                                                    authenticators=authenticators or {},
                                                    tenants=tenants)),
                              downstream={n for p in pids for n in _pipeline_nodes[p]})
    unused = [f"{section}.{cid}: defined but not used in any pipeline"
              for section in ("receivers", "exporters", "connectors")
              for cid in getattr(cfg, section)
              if not any(k.split(":", 1)[1].split("@")[0] == cid for k in nodes)]
    for cid in unused:
        structlog.get_logger().warning("component_unused", detail=cid)
    order = _toposort({k: n.downstream for k, n in nodes.items()}, "service.pipelines")
    return Graph(nodes, order, tenants)


def _fan(consumers: list[Consumer]) -> Consumer:
    return consumers[0] if len(consumers) == 1 else Fanout(consumers)


def _toposort(edges: dict[str, set[str]], where: str) -> list[str]:
    """Upstream-first order of a DAG; a cycle is a configuration error."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ConfigError(f"{where}: pipelines form a cycle: {' -> '.join(path + [n])}")
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            visit(m, path + [n])
        state[n] = 2
        order.append(n)

    for n in sorted(edges):
        visit(n, [])
    return order[::-1]

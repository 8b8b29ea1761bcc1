"""``clickhouse`` exporter: spans, profile samples with their stacks, and per-span
attribution, into ClickHouse through clickhouse-connect.

The embedded engine (``chdb://PATH``, the default) and a server (``http(s)://host:8123``)
go through the very same client API, so what the tests prove on one holds on the other::

    exporters:
      clickhouse:
        endpoint: chdb://./data        # or http://clickhouse:8123
        username: default
        password: ${env:CLICKHOUSE_PASSWORD:-}
        database: spanprof
        ttl: 7d                        # 0 keeps data forever
        cluster: ""                    # a cluster name: Replicated + Distributed tables
        batch_rows: 5000               # insert when this many rows are waiting ...
        flush_interval: 1s             # ... or when the oldest waited this long
        max_pending_rows: 500000       # beyond: refuse with a retryable error
        retry_on_failure: {initial_interval: 500ms, max_interval: 30s, max_elapsed_time: 5m}
        unhealthy_after: 30s           # /health is 503 once inserts have failed this long
        sending_queue:                 # acknowledge once logged on local disk (queue.py)
          enabled: false
          directory: queue             # under service.data_dir, one folder per exporter id
          max_mib: 1024                # beyond: refuse with a retryable error
          memory_mib: 32               # of it also kept in memory; the rest read back from disk

Rows ClickHouse refuses for their values (a number beyond its column, a time beyond 2106 in
a ``DateTime``) are split out of their block and kept in the ``quarantine`` table; while
inserts fail for other reasons, new batches are refused at once with a retry delay
(``writer.py`` has the whole story).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import msgspec

from pipeline.config import Duration, NonNegDuration, PositiveInt
from pipeline.config.tls import ClientTls
from pipeline.errors import ConfigError, Retryable
from pipeline.exporters.clickhouse import failpoints, rows
from pipeline.exporters.clickhouse.backend import ClickHouseClient
from pipeline.exporters.clickhouse.cluster import on_cluster
from pipeline.exporters.clickhouse.migrate import bootstrap, lacks_column, plan, ttl_changes
from pipeline.exporters.clickhouse.queue import SendingQueue
from pipeline.exporters.clickhouse.queue_log import QueueError
from pipeline.exporters.clickhouse.schema import SchemaOptions, Step
from pipeline.exporters.clickhouse.writer import Writer
from pipeline.log import redact
from pipeline.records import AttributionBatch, Batch, ProfileBatch, SpanBatch
from pipeline.registry import Context, Factory

READERS = 3  # read queries at once, each on its own connection (``_reader``)


class QueueConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Acknowledge batches once they are logged on local disk and insert them behind, in
    large groups (``queue.py``): fast acknowledgements, large inserts, nothing lost in a
    crash. Not for the Kafka tier, whose log is Kafka."""

    enabled: bool = False
    directory: str = "queue"  # relative to service.data_dir; the exporter's id is appended
    max_mib: PositiveInt = 1024
    # what of it is also kept in memory (logged size; the columns take 1.5-5x that)
    memory_mib: PositiveInt = 32


class RetryConfig(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool = True
    initial_interval: Duration = Duration(0.5)
    max_interval: Duration = Duration(30.0)
    max_elapsed_time: Duration = Duration(300.0)


class Config(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str = "chdb://./data"
    username: str = "default"
    password: str = ""
    database: str = "spanprof"
    ttl: NonNegDuration = NonNegDuration(7 * 86400)  # 0 keeps data forever
    create_schema: bool = True
    cluster: str = ""
    batch_rows: PositiveInt = 5_000
    flush_interval: Duration = Duration(1.0)
    max_pending_rows: PositiveInt = 500_000
    timeout: Duration = Duration(30.0)
    retry_on_failure: RetryConfig = msgspec.field(default_factory=RetryConfig)
    # inserts failing (retryable errors) for this long make /health 503 (``failed``)
    unhealthy_after: Duration = Duration(30.0)
    sending_queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    # an https:// server's CA, a client certificate, or no verification (pipeline/config/tls.py)
    tls: ClientTls | None = None

    def validate(self) -> None:
        scheme = urlsplit(self.endpoint).scheme
        if self.tls is not None:
            if scheme != "https":
                raise ConfigError("tls: needs an https:// endpoint")
            self.tls.validate("tls")
        if scheme not in ("chdb", "http", "https"):
            raise ConfigError(f"endpoint: expected chdb://PATH, http://HOST:PORT or "
                              f"https://HOST:PORT, got {self.endpoint!r}")
        if self.cluster and not self.cluster.replace("_", "").isalnum():
            raise ConfigError(f"cluster: must be letters, digits and _, got {self.cluster!r}")
        if self.cluster and self.endpoint.startswith("chdb://"):
            raise ConfigError("cluster: needs a ClickHouse server (http(s)://), not chdb://")
        if not self.database.replace("_", "").isalnum():
            raise ConfigError(f"database: must be letters, digits and _, got {self.database!r}")
        if self.batch_rows < 1 or self.max_pending_rows < self.batch_rows:
            raise ConfigError("max_pending_rows: must be at least batch_rows (and both >= 1)")


def resolve_endpoint(endpoint: str, data_dir: str) -> str:
    """``chdb://./data`` -> ``chdb:///abs/data`` (relative to the service's data_dir)."""
    if endpoint.startswith("chdb://"):
        path = endpoint[len("chdb://"):]
        if not os.path.isabs(path):
            path = os.path.abspath(os.path.join(data_dir, path))
        return "chdb://" + path
    return endpoint


def connect(cfg: Config, data_dir: str) -> ClickHouseClient:
    """A clickhouse-connect client for the endpoint (wrapped by the fault hook when a fault
    run asks for it: ``failpoints``)."""
    import clickhouse_connect
    from clickhouse_connect.driver import options

    if "pandas" not in sys.modules:
        # clickhouse-connect imports pandas at the first insert only to ask whether the
        # data is a DataFrame (never, here): 80 MiB of RSS and 0.26 s of every start
        options.pd = options.pd_time_test = None
    client: ClickHouseClient  # the real driver, checked against the small interface here
    dsn = resolve_endpoint(cfg.endpoint, data_dir)
    if dsn.startswith("chdb://"):
        os.makedirs(dsn[len("chdb://"):], exist_ok=True)
        client = clickhouse_connect.get_client(dsn=dsn)
        return failpoints.wrap(client)
    u = urlsplit(dsn)
    client = clickhouse_connect.get_client(
        host=u.hostname, port=u.port or (8443 if u.scheme == "https" else 8123),
        secure=u.scheme == "https",
        # credentials in the URL (http://user:pass@host) win over the separate keys
        username=unquote(u.username) if u.username else cfg.username,
        password=unquote(u.password) if u.password is not None else cfg.password,
        connect_timeout=float(cfg.timeout), send_receive_timeout=float(cfg.timeout),
        **_tls_settings(cfg.tls),
        # through Distributed tables, an insert is acknowledged once the shards have it,
        # and its deduplication token goes with it
        settings={"insert_distributed_sync": 1} if cfg.cluster else None)
    return failpoints.wrap(client)


def _tls_settings(tls: ClientTls | None) -> dict[str, Any]:
    """clickhouse-connect's arguments for ``tls`` (empty: its defaults, the system CAs)."""
    if tls is None:
        return {}
    out: dict[str, Any] = {"verify": not tls.insecure_skip_verify}
    if tls.ca_file:
        out["ca_cert"] = tls.ca_file
    if tls.cert_file:
        out.update(client_cert=tls.cert_file, client_cert_key=tls.key_file)
    return out


def apply_step(client: ClickHouseClient, schema: SchemaOptions, step: Step) -> bool:
    """Apply one step of a migration, unless its ``when TABLE lacks COLUMN`` says it is
    done; whether it was applied."""
    if step.lacks is not None:
        check, params = lacks_column(schema, step.lacks)
        if not client.query(check, parameters=params).result_rows[0][0]:
            return False
    for sql in step.sql:
        client.command(sql)
    return True


class ClickHouseExporter:
    def __init__(self, cfg: Config, ctx: Context) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.schema = SchemaOptions(database=cfg.database, ttl_seconds=int(cfg.ttl),
                                    cluster=cfg.cluster)
        self.metrics: Counter[str] = Counter()
        self.client: ClickHouseClient | None = None
        # one thread for the writes (ordering inserts keeps it simple), and ``READERS`` for
        # the reads, each with its own connection (``_reader``): the admin API's answers
        # neither queue behind inserts nor behind each other. chdb is one engine per
        # process but takes any number of connections to it, each serving one call at a time
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=ctx.id)
        self.read_executor = ThreadPoolExecutor(max_workers=READERS,
                                                thread_name_prefix=f"{ctx.id}-read")
        self._local = threading.local()
        self._readers: list[ClickHouseClient] = []
        self._readers_lock = threading.Lock()
        self._reads_closed = False
        self.writer: Writer | None = None
        self.queue: SendingQueue | None = None
        self._stopped = False

    def __repr__(self) -> str:
        return f"<ClickHouseExporter {self.ctx.id} {redact(self.cfg.endpoint)} {self.writer!r}>"

    @property
    def failed(self) -> str | None:
        """Why this exporter is unhealthy (read by /health): inserts failing with retryable
        errors for ``unhealthy_after`` or longer; None again once an insert succeeds."""
        failing = self.writer.failing_for() if self.writer is not None else None
        if failing is None or failing[0] < float(self.cfg.unhealthy_after):
            return None
        seconds, error = failing
        return f"exporters.{self.ctx.id}: inserts failing for {seconds:.0f}s: {error[:160]}"

    def stalled(self) -> float | None:
        """While inserts fail: the delay before the next attempt; else None (receivers
        answer a waiting client with it, ``pipeline/receivers/idempotency.py``). With a
        sending queue no client waits for an insert."""
        if self.writer is None or self.queue is not None:
            return None
        return self.writer.retry_in()

    async def settled(self) -> None:
        """Return once the rows its sending queue held at start are in ClickHouse (at
        once without a queue): from then on the stored request ids
        (``receivers/idempotency.stored_request_ids``) include every request stored before
        the start."""
        if self.queue is not None:
            await self.queue.wait_through(self.queue.replayed_upto)

    def _metric(self, name: str, n: int) -> None:
        self.metrics[name] += n

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.client = await loop.run_in_executor(
                self.executor, connect, self.cfg, self.ctx.data_dir)
            if self.cfg.create_schema:
                await loop.run_in_executor(self.executor, self.migrate)
        except Exception as err:
            raise ConfigError(f"exporters.{self.ctx.id}.endpoint: cannot use ClickHouse at "
                              f"{redact(self.cfg.endpoint)}: {redact(str(err))[:300]}") from err
        q = self.cfg.sending_queue
        # behind a queue the writer inserts each group as it comes (the queue groups)
        self.writer = Writer(client=self.client, executor=self.executor,
                             database=self.cfg.database,
                             batch_rows=1 if q.enabled else self.cfg.batch_rows,
                             flush_interval=float(self.cfg.flush_interval),
                             max_pending_rows=self.cfg.max_pending_rows,
                             retry=self.cfg.retry_on_failure, log=self.log, metrics=self._metric,
                             component=self.ctx.id)
        self.writer.start()
        if q.enabled:
            directory = os.path.join(self.ctx.data_dir, q.directory, self.ctx.id)
            writer = self.writer
            self.queue = SendingQueue(
                directory, q.max_mib << 20, self.cfg.batch_rows, float(self.cfg.flush_interval),
                lambda t, n, st, tok: writer.submit(t, n, st, token=tok), self.log,
                self._metric, memory_bytes=q.memory_mib << 20)
            try:
                await self.queue.open(replay_timeout=min(
                    60.0, float(self.cfg.retry_on_failure.max_elapsed_time)))
            except QueueError as err:
                raise ConfigError(f"exporters.{self.ctx.id}.sending_queue.directory: "
                                  f"{err}") from err
        self.log.info("clickhouse_ready", endpoint=self.cfg.endpoint, database=self.cfg.database)

    def migrate(self) -> None:
        """Apply, in order, every migration not yet recorded in ``schema_migrations``; a
        ``when TABLE lacks COLUMN`` statement only while the table lacks the column (so that
        a migration killed part-way can be applied again whole)."""
        client = self.client
        if client is None:
            raise Retryable(f"{self.ctx.id}: not started")
        boot = bootstrap(self.schema)
        for sql in on_cluster(boot, self.schema) if self.schema.cluster else boot:
            client.command(sql)
        db = self.cfg.database
        applied = {r[0] for r in client.query(
            f"SELECT version FROM {db}.schema_migrations").result_rows}
        for version, steps in plan(self.schema):
            if version in applied:
                continue
            for step in steps:
                apply_step(client, self.schema, step)
            client.insert(f"{db}.schema_migrations", [[version]], column_names=["version"])
            self.log.info("clickhouse_migrated", version=version)
        current = {name: ddl for name, ddl in client.query(
            "SELECT name, create_table_query FROM system.tables WHERE database = %(db)s",
            parameters={"db": db}).result_rows}
        for sql in ttl_changes(self.schema, current):
            client.command(sql)
            self.log.info("clickhouse_ttl_changed", statement=sql)

    async def consume(self, batch: Batch) -> None:
        if self.writer is None:
            raise Retryable(f"{self.ctx.id}: not started")
        stacks: set[rows.StackKey] = set()
        if isinstance(batch, SpanBatch):
            tables = rows.traces(batch)
        elif isinstance(batch, ProfileBatch):
            skip = self.writer.known_stacks(batch.tenant, batch.stacks)
            tables = rows.profiles(batch, skip)
            stacks = {(batch.tenant, sid) for sid in batch.stacks if sid not in skip}
        elif isinstance(batch, AttributionBatch):
            # a flush of the correlator can report thousands of spans: their rows are
            # built a slice at a time, letting the receivers' requests in between
            tables = {}
            for part in rows.attribution_slices(batch):
                rows.extend(tables, part)
                await asyncio.sleep(0)
        else:
            raise TypeError(type(batch))
        n = sum(len(next(iter(c.values()), [])) for c in tables.values())
        # a Kafka block (pipeline.kafka.blocks) and what the correlator derived from it: their
        # own insert blocks under the block's name, which ClickHouse drops if the block is
        # delivered again, and then does not feed to the aggregates' views either
        token = batch.origin or None
        if self.queue is not None:
            await self.queue.put(tables, n, stacks, token)
        else:
            await self.writer.submit(tables, n, stacks, token=token)

    def _reader(self) -> ClickHouseClient:
        """The calling read thread's own connection (made on its first query)."""
        client: ClickHouseClient | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = connect(self.cfg, self.ctx.data_dir)
            with self._readers_lock:
                self._readers.append(client)
        return client

    async def query(self, sql: str, parameters: dict[str, Any] | None = None
                    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run a read query on one of the read connections (``READERS`` at once; what was
        inserted before it was called is seen: inserts are synchronous)."""
        if self.client is None or self._reads_closed:
            raise Retryable(f"{self.ctx.id}: not started or stopped")
        def read() -> tuple[list[str], list[tuple[Any, ...]]]:
            res = self._reader().query(sql, parameters=parameters or {})
            # the rows decoded here, in the read thread, not on the event loop (10 000 rows
            # of a flame graph: 3-4 ms of the loop's time otherwise); the driver's rows are
            # tuples, the interface only promises sequences
            return list(res.column_names), cast("list[tuple[Any, ...]]", list(res.result_rows))

        return await asyncio.get_running_loop().run_in_executor(self.read_executor, read)

    @property
    def database(self) -> str:
        return self.cfg.database

    async def insert(self, table: str, data: list[list[Any]], columns: list[str]) -> None:
        """Insert a few rows now, outside the writer's batches (the correlator's checkpoint:
        it must be durable when this returns, and it is not a pipeline batch)."""
        client = self.client
        if client is None:
            raise Retryable(f"{self.ctx.id}: not started")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, lambda: client.insert(
            f"{self.cfg.database}.{table}", data, column_names=columns))

    async def command(self, sql: str, parameters: dict[str, Any] | None = None) -> None:
        """Run a statement that returns no rows on this exporter's connection (a backfill's
        ``DELETE`` of the rows it replaces, ``pipeline.backfill``)."""
        client = self.client
        if client is None:
            raise Retryable(f"{self.ctx.id}: not started")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            self.executor, lambda: client.command(sql, parameters=parameters or {}))

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.queue is not None:
            # what ClickHouse does not take within this stays logged for the next start
            await self.queue.close(within=min(
                30.0, float(self.cfg.retry_on_failure.max_elapsed_time)))
        if self.writer is not None:
            await self.writer.close()
        # reads queued are cancelled, running ones finished, off the event loop (the admin
        # listener still answers meanwhile); a connection failing to close stops no other
        self._reads_closed = True
        await asyncio.to_thread(self.read_executor.shutdown, wait=True, cancel_futures=True)
        for reader in self._readers:
            try:
                reader.close()
            except Exception as err:  # noqa: BLE001 - closing: logged, the rest still closed
                self.log.warning("clickhouse_reader_close_failed", error=redact(str(err))[:200])
        if self.client is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.client.close)
        self.executor.shutdown(wait=True)
        self.log.info("clickhouse_stopped", **{k.replace(".", "_"): v
                                               for k, v in self.metrics.items()})


def create(cfg: Config, ctx: Context) -> ClickHouseExporter:
    return ClickHouseExporter(cfg, ctx)


FACTORY = Factory(type="clickhouse", kind="exporter", config=Config, create=create,
                  signals=("traces", "profiles", "attributions"))

"""Internal records: what crosses stage boundaries.

Receivers turn wire formats (OTLP protobuf/JSON, pprof) into these; every processor and
exporter downstream knows only these. They are ``msgspec.Struct``s: cheap to build, and
``array_like`` so that the Kafka tier can ship them compactly when it needs to.

Ids are raw bytes (16-byte trace id, 8-byte span id); ``b""`` means "absent".
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Signal = Literal["traces", "profiles", "attributions"]
SIGNALS: tuple[Signal, ...] = ("traces", "profiles", "attributions")

# the tenant of data sent where auth is off and no ``X-Scope-OrgID`` names one
# (``pipeline/auth.py``); every batch belongs to exactly one tenant
DEFAULT_TENANT = "default"

# How a sample's value is to be read.  ``cpu`` and ``wall``/``off_cpu`` are time in
# nanoseconds and are never added together: CPU explains on-CPU time, wall explains waiting.
# ``lock`` is time spent waiting for a lock (nanoseconds: Go's mutex and block delay, JFR
# monitor and park events, OTLP contention types), ``alloc`` bytes allocated (Go's
# alloc_space, JFR allocation events): both attributed to spans like CPU where the samples
# say which span they belong to or when and on which thread they were taken.
Measure = Literal["cpu", "wall", "off_cpu", "lock", "alloc", "other"]
ATTRIBUTED: tuple[Measure, ...] = ("cpu", "wall", "lock", "alloc")


class SpanEvent(msgspec.Struct, array_like=True, gc=False):
    time_ns: int
    name: str
    attributes: dict[str, str]


class SpanLink(msgspec.Struct, array_like=True, gc=False):
    trace_id: bytes
    span_id: bytes
    trace_state: str
    attributes: dict[str, str]


class Span(msgspec.Struct, array_like=True, gc=False):
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    name: str
    kind: int  # OTLP SpanKind enum value
    service: str
    start_ns: int
    end_ns: int
    status_code: int = 0  # OTLP Status.code enum value
    status_message: str = ""
    trace_state: str = ""
    scope_name: str = ""
    scope_version: str = ""
    resource_attributes: dict[str, str] = {}
    attributes: dict[str, str] = {}
    events: list[SpanEvent] = []
    links: list[SpanLink] = []

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


class Stack(msgspec.Struct, array_like=True, gc=False):
    """A call stack, leaf first, identified by a hash of its frames (stable across requests)."""

    stack_id: int
    functions: list[str]
    files: list[str]
    lines: list[int]


class Sample(msgspec.Struct, array_like=True, gc=False):
    """One profile sample, already normalised.

    ``value`` is nanoseconds for time measures (``cpu``, ``wall``, ``off_cpu``) whatever unit
    or ``samples/count`` encoding the profiler used; ``count`` is how many profiler ticks it
    stands for, so users can judge how far to trust a per-span figure.
    """

    trace_id: bytes
    span_id: bytes
    service: str
    time_ns: int
    stack_id: int
    measure: Measure
    value: int
    count: int
    sample_type: str
    unit: str
    # where the sample was taken, when the profiler says: OTLP sample attributes
    # ``thread.id``/``thread.name`` (pprof labels ``thread_id``/``thread_name``), resource
    # ``process.pid``/``host.name``; ``span_name`` is the label Pyroscope SDKs add
    thread_id: int = 0
    thread_name: str = ""
    span_name: str = ""
    pid: int = 0
    host: str = ""
    # time_ns is the instant this sample was taken (OTLP timestamps_unix_nano), not just
    # its profile's start: the correlator may then place it in a child span or by thread
    timed: bool = False


class SpanBatch(msgspec.Struct):
    spans: list[Span]

    signal: Signal = "traces"
    # the requests as received, for exporters that pass OTLP on (Kafka) without re-encoding,
    # each with the (resource, scope, item) paths the receiver refused
    sources: list[tuple[Any, list[tuple[int, int, int]]]] = []
    # from Kafka: the insert block this batch is (``pipeline.kafka.blocks``: its
    # deduplication token), and per message in it, in order, its "topic/partition/offset"
    # and how many items it holds
    origin: str = ""
    parts: list[tuple[str, int]] = []
    # per client request in it, in order: its id (a hash of the request, see
    # pipeline/receivers/idempotency.py) and how many items it holds; stored with the rows,
    # so that a restarted receiver knows which resent requests it already has
    requests: list[tuple[int, int]] = []
    # when the receiver built no records (its pipelines only pass OTLP on, as a gateway's
    # do: ``Factory.records``), ``spans`` is empty and this says how many spans ``sources``
    # hold; -1: ``spans`` are the items
    items: int = -1
    # whose data this is: from the request's token, or ``X-Scope-OrgID`` where auth is off
    # (``pipeline/auth.py``); one batch never mixes tenants (``concat``)
    tenant: str = DEFAULT_TENANT

    def __len__(self) -> int:
        return len(self.spans) if self.items < 0 else self.items


class ProfileBatch(msgspec.Struct):
    samples: list[Sample]
    stacks: dict[int, Stack]

    signal: Signal = "profiles"
    sources: list[tuple[Any, list[tuple[int, int, int]]]] = []
    origin: str = ""
    parts: list[tuple[str, int]] = []
    requests: list[tuple[int, int]] = []  # as SpanBatch.requests
    items: int = -1  # as SpanBatch.items: a gateway's batch holds its requests, no samples
    tenant: str = DEFAULT_TENANT  # as SpanBatch.tenant

    def __len__(self) -> int:
        return len(self.samples) if self.items < 0 else self.items


class Attribution(msgspec.Struct, array_like=True, gc=False):
    """What the correlator learnt about one span since it last reported it.

    Rows are *deltas*: a span's totals are the sum of all its rows (ClickHouse adds them up
    in an AggregatingMergeTree), so a sample that arrives after the span's first row was
    written simply adds a row, and nothing is ever counted twice or lost.
    """

    trace_id: bytes
    span_id: bytes
    method: str  # link | link+time (exact) | link+share | thread | window (approximate;
    # link+share and window may be placed by stack: processors/correlate/frames.py)
    service: str
    name: str
    parent_span_id: bytes
    start_ns: int
    duration_ns: int
    span_known: bool  # False: samples whose span was never seen (yet)
    cpu_ns: int
    wall_ns: int
    sample_count: int
    self_cpu_ns: dict[str, int]  # leaf function -> CPU ns
    self_wall_ns: dict[str, int]
    # identifies what the row was derived from: a deterministic hash of the Kafka message
    # (so a redelivered message rewrites the same rows, which ClickHouse deduplicates),
    # or a random id for rows that summarise in-memory state
    source: int = 0
    # self CPU plus the CPU of descendants in the same service placed through this row's
    # method (cpu_ns is the span's self CPU)
    inclusive_cpu_ns: int = 0
    # self CPU / wall per stack id (profile_stacks): the span's flame graph
    stack_cpu_ns: dict[int, int] = {}
    stack_wall_ns: dict[int, int] = {}
    # lock wait (ns) and allocated bytes joined to the span, in all and per leaf function
    lock_ns: int = 0
    alloc_bytes: int = 0
    self_lock_ns: dict[str, int] = {}
    self_alloc_bytes: dict[str, int] = {}


class Unattributed(msgspec.Struct, array_like=True, gc=False):
    """CPU that no span claims (samples without a link), per service and minute."""

    service: str
    minute_ns: int
    cpu_ns: int
    wall_ns: int
    sample_count: int
    source: int = 0


class AttributionBatch(msgspec.Struct):
    attributions: list[Attribution]
    unattributed: list[Unattributed] = []

    signal: Signal = "attributions"
    # the Kafka block these rows derive from: inserted under its token, so that a block
    # delivered again reaches the aggregates once
    origin: str = ""
    tenant: str = DEFAULT_TENANT  # as SpanBatch.tenant: the spans' and samples' tenant

    def __len__(self) -> int:
        return len(self.attributions) + len(self.unattributed)


Batch = SpanBatch | ProfileBatch | AttributionBatch


def concat(batches: list[Batch]) -> Batch:
    """Batches of one signal as one, in order: items, stacks, the requests as received
    (``sources``) and the client requests' runs (``requests``). The one concatenation of
    the pipeline (the batch processor, the Pyroscope receiver's profiles of one push, the
    Kafka receiver's blocks, which then name the block: ``origin``, ``parts``). The
    batches are of one tenant: callers group by it."""
    first = batches[0]
    if len(batches) == 1:
        return first
    tenant = first.tenant
    if any(b.tenant != tenant for b in batches):
        raise ValueError(f"concat: batches of tenants {sorted({b.tenant for b in batches})} "
                         "cannot be one batch")
    if isinstance(first, SpanBatch):
        spans = [b for b in batches if isinstance(b, SpanBatch)]
        lean = any(b.items >= 0 for b in spans)
        return SpanBatch([s for b in spans for s in b.spans],
                         sources=[x for b in spans for x in b.sources],
                         requests=_requests(batches),
                         items=sum(len(b) for b in spans) if lean else -1,
                         tenant=tenant)
    if isinstance(first, ProfileBatch):
        profiles = [b for b in batches if isinstance(b, ProfileBatch)]
        stacks: dict[int, Stack] = {}
        for b in profiles:
            stacks.update(b.stacks)
        lean = any(b.items >= 0 for b in profiles)
        return ProfileBatch([s for b in profiles for s in b.samples], stacks,
                            sources=[x for b in profiles for x in b.sources],
                            requests=_requests(batches),
                            items=sum(len(b) for b in profiles) if lean else -1,
                            tenant=tenant)
    rows = [b for b in batches if isinstance(b, AttributionBatch)]
    return AttributionBatch([a for b in rows for a in b.attributions],
                            [u for b in rows for u in b.unattributed], tenant=tenant)


def _requests(batches: list[Batch]) -> list[tuple[int, int]]:
    """The concatenated batch's request runs, in order (0: a batch that names none)."""
    if not any(getattr(b, "requests", None) for b in batches):
        return []
    out: list[tuple[int, int]] = []
    for b in batches:
        out.extend(getattr(b, "requests", None) or [(0, len(b))])
    return out


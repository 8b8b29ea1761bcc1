"""``/ingest?format=jfr`` (the Pyroscope Java agent) -> profile records.

The agent posts a multipart form: ``jfr`` (an async-profiler recording) and, when it has
any, ``labels`` (the per-context label snapshots), both usually gzipped; a body that is no
form is taken as the recording itself. Both are inflated within the receiver's
``max_decompressed_bytes`` and read by ``jfr.parse`` within the push's limits.

Each JFR sample becomes a record that keeps its own instant (``timed``) and thread, so the
correlator can place a sample labelled with a local root span in the child span running
on its thread at that instant (``link+time``), and an unlabelled one by thread or time:

========================= ========== ============== ===========
JFR measure               measure    sample_type    unit
========================= ========== ============== ===========
cpu                       cpu        cpu            nanoseconds
wall                      wall       wall           nanoseconds
lock_ns                   off_cpu    lock_duration  nanoseconds
alloc_*, lock_count, ...  other      (its name)     bytes/count
========================= ========== ============== ===========

A sample's thread is its Java thread id (what OpenTelemetry's Java agent puts in a span's
``thread.id``), else its OS thread id. Labels: ``span_id`` (and ``trace_id`` when the
recording has it; ``io.pyroscope:otel`` 1.0.2 sends none, so such samples are labelled by
span id alone and resolved to their trace by the correlator) and ``span_name``. Values,
times and counts are checked as pprof's are (``pipeline/otlp/bounds.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.errors import InvalidData, TooLarge
from pipeline.otlp.bounds import MAX_COUNT, MAX_REQUEST_VALUE, MAX_SAMPLE_VALUE, time_problem
from pipeline.otlp.stacks import Frames, StackRefused
from pipeline.pyroscope import jfr, jfrlabels, jfrwire, pprof
from pipeline.receivers.limits import gunzip_limited
from pipeline.records import Measure, ProfileBatch, Sample

# JFR measure -> (measure, sample_type, unit)
KINDS: dict[str, tuple[Measure, str, str]] = {
    "cpu": ("cpu", "cpu", "nanoseconds"),
    "wall": ("wall", "wall", "nanoseconds"),
    "lock_ns": ("lock", "lock_duration", "nanoseconds"),
    "alloc_bytes": ("alloc", "alloc_bytes", "bytes"),
}


def _kind(measure: str) -> tuple[Measure, str, str]:
    return KINDS.get(measure) or ("other", measure,
                                  "bytes" if measure.endswith("_bytes") else "count")


def _inflate(data: bytes, what: str, max_bytes: int) -> bytes:
    return gunzip_limited(data, max_bytes, what, "max_decompressed_bytes") \
        if data[:2] == b"\x1f\x8b" else data


def decode_jfr(recording: bytes, labels: bytes, service: str, sample_rate: int,
               max_bytes: int, limits: pprof.Limits) -> ProfileBatch:
    """A recording (and its labels snapshot) -> records, within the push's limits."""
    if not recording:
        raise InvalidData("jfr: the form has no 'jfr' part (or it is empty)")
    data = _inflate(recording, "jfr", max_bytes)
    limits_jfr = jfrwire.Limits(max_events=limits.max_samples,
                                max_stack_depth=limits.max_stack_depth,
                                max_pool_entries=limits.max_table_entries,
                                max_string_bytes=max_bytes,
                                max_labels=limits.max_table_entries)
    try:
        snapshot = jfrlabels.parse_labels(_inflate(labels, "labels", max_bytes), limits_jfr) \
            if labels else None
        rec = jfr.parse(data, snapshot, limits_jfr, interval_ns=1_000_000_000 // sample_rate)
    except jfrwire.JfrTooLarge as err:
        raise TooLarge(str(err)) from None
    if len(rec.samples) > limits.max_samples:
        raise TooLarge(f"jfr: {len(rec.samples)} samples, over max_samples_per_request="
                       f"{limits.max_samples}")
    budget = pprof.Budget(limits)
    stacks = budget.stacks
    by_stack: dict[int, int] = {}  # id() of a recording's (shared) stack tuple -> stack id
    samples: list[Sample] = []
    total = 0
    for n, s in enumerate(rec.samples):
        if s.value <= 0:
            continue
        measure, sample_type, unit = _kind(s.measure)
        sid = by_stack.get(id(s.stack))
        if sid is None:
            try:
                frames: list[Frames] = [stacks.location(list(s.stack), f"jfr sample {n}")]
                sid = by_stack[id(s.stack)] = stacks.stack(frames, f"jfr sample {n}")
            except StackRefused as err:
                raise TooLarge(f"jfr: {err}") from None
        problem = time_problem(s.time_ns, f"jfr sample {n} time")
        if problem:
            raise InvalidData(problem)
        ticks = max(1, s.value // (1_000_000_000 // sample_rate)) \
            if measure in ("cpu", "wall") else 1
        if s.value > MAX_SAMPLE_VALUE or ticks > MAX_COUNT:
            raise InvalidData(f"jfr: sample {n} ({s.event}) value {s.value} is over the "
                              f"per-sample limit {MAX_SAMPLE_VALUE}")
        total += s.value
        span, trace, span_name = _labels(s.labels)
        thread = s.thread
        samples.append(Sample(
            trace, span, service, s.time_ns, sid, measure, s.value, ticks, sample_type, unit,
            (thread.java_id or thread.os_id) if thread else 0, thread.name if thread else "",
            span_name, timed=True))
    if total > MAX_REQUEST_VALUE:
        raise InvalidData(f"jfr: sample values add up to {total}, over {MAX_REQUEST_VALUE}")
    return ProfileBatch(samples, {sid: stacks.stacks[sid] for sid in set(by_stack.values())})


def _labels(labels: Mapping[str, str]) -> tuple[bytes, bytes, str]:
    span = pprof.span_id_of(labels.get("span_id", ""), 0) or b""
    trace = pprof.trace_id_of(labels.get("trace_id", "")) if span else b""
    return span, trace, labels.get("span_name", "")[:1024]

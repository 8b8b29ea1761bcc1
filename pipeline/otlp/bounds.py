"""What a decoder may accept: every value that becomes a stored column fits its column.

ClickHouse refuses a whole insert block when one value does not fit its column (a
``DateTime`` after 2106-02-07, a ``UInt32`` pid of -1), and the writer retries that block
until it gives up: one hostile item acknowledged at the door would stall every item
inserted with it. So the decoders refuse such items before acknowledging them (OTLP: per
item, in ``partial_success``; pprof: the request, 400), and these constants are the one
place that says what fits. The test suite checks them against the schema and the engine
(tests/fuzz/storable.py).

Times: one accepted range for every time that lands in a column, [1970-01-01,
2106-01-01). Derived columns need it: span and sample times become ``DateTime`` columns
(``toDateTime(Timestamp)`` in materialized views, the correlator's ``minute`` columns,
TTL expressions), and ``DateTime`` is UInt32 seconds, ending 2106-02-07 06:28:15; the
month of margin keeps a minute or a day rounded up inside it.

Values: one sample's value is at most ``MAX_SAMPLE_VALUE`` (2^44 ns, about 4.9 hours of
CPU: a 60 s profile of one stack on 290 cores), and the values of one request add up to at
most ``MAX_REQUEST_VALUE`` (2^63 - 1). Every sum the correlator and the views compute
(``cpu_ns``, ``wall_ns`` per span and per minute, ``sum(value)``) adds values of requests
already bounded so, and fits ``UInt64`` and ``toInt64(...)`` (``span_attribution_totals``)
unless one span collects the maximum from billions of requests.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# [TIME_MIN_NS, TIME_MAX_NS): 1970-01-01T00:00:00Z .. 2106-01-01T00:00:00Z
TIME_MIN_NS = 0
TIME_MAX_NS = 4_291_747_200 * 1_000_000_000
TIME_RANGE = "[1970-01-01, 2106-01-01)"

UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1

MAX_SAMPLE_VALUE = 1 << 44  # per record (see the module docstring)
MAX_REQUEST_VALUE = (1 << 63) - 1  # all records of one request together
# sample records per request: OTLP timestamps make one record each, so a request's records
# are bounded here, not only its samples (max_samples_per_request)
MAX_RECORDS = 1 << 21
# the config type of every max_samples_per_request: at most MAX_RECORDS
RecordsLimit = Annotated[int, msgspec.Meta(ge=1, le=MAX_RECORDS)]
MAX_COUNT = UINT32_MAX  # profile_samples.count is UInt32

# Stacks (pipeline/otlp/stacks.py): what one request may make the decoder build.
MAX_STACK_DEPTH = 8192  # frames of one stack, inlined lines included
# frames built may be at most FRAME_FANOUT per location reference in the input (inlined
# lines: 1-4 per location in real profiles) plus FRAME_SLACK, so that one location with
# many lines, referenced again and again, cannot turn kilobytes into gigabytes
FRAME_FANOUT = 8
FRAME_SLACK = 1 << 16
# bytes of function and file names hashed into stack ids per request: the hash reads every
# frame's text, so a megabyte name referenced by every frame is CPU, not memory
MAX_FRAME_TEXT = 256 << 20


def time_problem(ns: int, what: str) -> str | None:
    """Why a time cannot be stored, or None (one chained comparison on the hot path)."""
    if TIME_MIN_NS <= ns < TIME_MAX_NS:
        return None
    return f"{what} {ns} is outside the storable time range {TIME_RANGE}"


def int_problem(v: int, hi: int, what: str, lo: int = 0) -> str | None:
    """Why an integer does not fit [lo, hi], or None."""
    if lo <= v <= hi:
        return None
    return f"{what} {v} is outside [{lo}, {hi}]"

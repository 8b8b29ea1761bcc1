"""The JFR parser (``pipeline/pyroscope/jfr*.py``) fed hostile recordings and labels
snapshots: random bytes, truncations, bit flips, extreme varints, lengths and counts,
rewritten chunk headers, and recordings built with random metadata (types that contain
themselves, arrays of anything, pools of unknown types). Each input is either read, into
samples of the documented shapes, or refused with ``JfrError``, within a deadline; never
another exception, never a hang.

Seeds: the captured uploads (tests/testdata/jfr) and recordings from ``jfrbuild``.
Counted in ``support.INPUTS`` (``jfr``, ``jfr_labels``); the mutation loop runs
``SPANPROF_FUZZ_JFR_MUTATIONS`` mutants (default 300; ``make fuzz``: 20000).
"""

from __future__ import annotations

import gzip
import os
import random
import time
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from pipeline.pyroscope import jfr, jfrsamples
from pipeline.pyroscope.jfrlabels import LabelsSnapshot, parse_labels
from pipeline.pyroscope.jfrpools import JfrThread
from pipeline.pyroscope.jfrwire import JfrError, Limits
from tests.fuzz.support import FUZZ, PROFILE, count, run_mutants
from tests.pipeline.pyroscope import jfrbuild as B

DATA = Path(__file__).resolve().parents[1] / "testdata" / "jfr"
LIMITS = Limits(max_events=50_000, max_stack_depth=2048, max_pool_entries=200_000,
                max_string_bytes=8 << 20, max_frames=400_000, max_labels=20_000)
DEADLINE_S = 5.0  # one parse; the seeds take ~10 ms
MEASURES = {m for ms in jfrsamples.MEASURES.values() for m, _ in ms}
MUTANTS = int(os.environ.get("SPANPROF_FUZZ_JFR_MUTATIONS",
                             20_000 if PROFILE == "fuzz" else 300))
EXTREME_VARINTS = [b"\xff" * 8 + b"\xff", b"\x80" * 8 + b"\x01", b"\xff\xff\xff\xff\x0f",
                   b"\x80\x80\x80\x80\x00", b"\x00", b"\x7f", b"\xff\xff\xff\xff\x07",
                   b"\x81\x80\x80\x80\x80\x80\x80\x80\x80"]


@cache
def captured() -> list[tuple[bytes, bytes]]:
    return [(gzip.decompress((DATA / f"{n}.jfr.gz").read_bytes()),
             gzip.decompress((DATA / f"{n}.labels.gz").read_bytes()))
            for n in ("itimer-2", "wall-1")]


@cache
def built() -> list[bytes]:
    spans = (0xABC, 3, 7, 1, 2)
    return [
        B.recording([B.setting("interval", "10000000"), B.sample(spans=spans),
                     B.sample(B.WALL, extra=(2, 5)), B.sample(stack=2, thread=2)]),
        B.recording([B.sample(state=2), B.event(B.UNKNOWN_EVENT, B.var(1) + B.utf8("x"))])
        + B.recording([B.sample()]),
    ]


def seeds() -> list[bytes]:
    return [captured()[0][0], *built()]


def check(data: bytes, labels: LabelsSnapshot | None = None) -> jfr.Recording | None:
    """Parses ``data``: a recording of well-formed samples, or None for a JfrError;
    anything else, or a parse over the deadline, fails the test."""
    count("jfr")
    t = time.perf_counter()
    try:
        rec = jfr.parse(data, labels, LIMITS)
    except JfrError as err:
        assert str(err).startswith("jfr: "), err
        return None
    finally:
        assert time.perf_counter() - t < DEADLINE_S, f"{len(data)} bytes took too long"
    assert len(rec.samples) <= 2 * LIMITS.max_events
    for s in rec.samples:
        assert s.measure in MEASURES and isinstance(s.value, int)
        assert isinstance(s.time_ns, int) and isinstance(s.state, str)
        assert s.thread is None or isinstance(s.thread, JfrThread)
        assert len(s.stack) <= LIMITS.max_stack_depth
        assert all(isinstance(f.function, str) and isinstance(f.file, str)
                   and isinstance(f.line, int) for f in s.stack)
        assert isinstance(s.labels, Mapping)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in s.labels.items())
        s.labels.get("span_id", "").encode()  # no lone surrogates anywhere
        (s.thread.name if s.thread else "").encode()
        "".join(f.function + f.file for f in s.stack).encode()
    return rec


def check_labels(data: bytes) -> LabelsSnapshot | None:
    count("jfr_labels")
    t = time.perf_counter()
    try:
        snap = parse_labels(data, LIMITS)
    except JfrError as err:
        assert str(err).startswith("labels: "), err
        return None
    finally:
        assert time.perf_counter() - t < DEADLINE_S
    assert all(isinstance(k, int) and isinstance(v, str) for k, v in snap.strings.items())
    for labels in snap.contexts.values():
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    return snap


class TestRecordingBytes:
    @FUZZ
    @given(st.one_of(st.binary(max_size=300),
                     st.binary(max_size=300).map(lambda b: b"FLR\0\x00\x02\x00\x00" + b)))
    def test_random(self, data: bytes) -> None:
        """Random bytes, with and without a chunk magic."""
        check(data)

    @FUZZ
    @given(st.integers(0, len(seeds()) - 1), st.floats(0, 1))
    def test_truncated(self, i: int, where: float) -> None:
        """Every recording cut anywhere, its chunk size left as it was."""
        data = seeds()[i]
        check(data[:int(len(data) * where)])

    @FUZZ
    @given(st.integers(0, len(seeds()) - 1),
           st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), min_size=1, max_size=8))
    def test_bit_flips(self, i: int, flips: list[tuple[float, int]]) -> None:
        data = bytearray(seeds()[i])
        for where, bit in flips:
            data[min(int(where * len(data)), len(data) - 1)] ^= 1 << bit
        check(bytes(data))

    @FUZZ
    @given(st.integers(0, len(seeds()) - 1),
           st.lists(st.tuples(st.floats(0, 1), st.sampled_from(EXTREME_VARINTS), st.booleans()),
                    min_size=1, max_size=4))
    def test_varints(self, i: int, edits: list[tuple[float, bytes, bool]]) -> None:
        """Extreme varints (sizes, counts, lengths, keys) written over or into the bytes."""
        data = bytearray(seeds()[i])
        for where, v, insert in edits:
            at = int(where * len(data))
            data[at:at if insert else at + len(v)] = v
        check(bytes(data))

    @FUZZ
    @given(st.integers(0, len(seeds()) - 1), st.integers(0, 7),
           st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 67, 68, 69, 2**63])))
    def test_header(self, i: int, field: int, value: int) -> None:
        """Each 8-byte field of the first chunk header set to anything (size, offsets,
        start, duration, ticks, ticks per second; the last: version and features)."""
        data = bytearray(seeds()[i])
        at = 8 * field if field else 60
        data[at:at + 8] = value.to_bytes(8, "big")
        check(bytes(data))


def _types(draw: st.DrawFn) -> list[B.C]:
    """The standard types with random changes: extra classes with random fields (of any
    type id, themselves included), fields retyped, made arrays or pool keys."""
    types = B.standard_types(span_fields=draw(st.booleans()))
    ids = st.one_of(st.sampled_from([t.id for t in types] + [300, 301, 9999]),
                    st.integers(0, 2**63))
    fields = st.builds(B.F, st.sampled_from(["frames", "method", "name", "startTime", "x",
                                             "spanId", "stackTrace", "state", "string"]),
                       ids, st.booleans(), st.booleans(),
                       st.sampled_from(["", "TICKS", "NANOSECONDS"]))
    for tid in (300, 301):
        if draw(st.booleans()):
            types.append(B.C(tid, draw(st.sampled_from(["a", "jdk.types.StackFrame",
                                                        "java.lang.Thread"])),
                             draw(st.lists(fields, max_size=4))))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(types) - 1))
        c = types[i]
        if c.fields:
            j = draw(st.integers(0, len(c.fields) - 1))
            types[i] = c._replace(fields=[*c.fields[:j], draw(fields), *c.fields[j + 1:]])
    return types


@st.composite
def built_recordings(draw: st.DrawFn) -> bytes:
    types = _types(draw) if draw(st.booleans()) else B.standard_types()
    pools = B.standard_pools(stack_depth=draw(st.integers(0, 40)))
    blobs = st.binary(max_size=24)
    for _ in range(draw(st.integers(0, 3))):  # pools of random types and entries
        tid = draw(st.sampled_from([t.id for t in types] + [9999]))
        pools.append((tid, draw(st.lists(st.tuples(st.integers(0, 2**64 - 1), blobs),
                                         max_size=3))))
    refs = st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))
    events = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            events.append(B.sample(thread=draw(refs), stack=draw(refs), state=draw(refs),
                                   ticks=draw(st.integers(0, 2**64 - 1)),
                                   spans=draw(st.tuples(*[refs] * 5))))
        elif kind == 1:
            events.append(B.sample(B.WALL, extra=(draw(refs), draw(refs))))
        elif kind == 2:
            events.append(B.setting(draw(st.sampled_from(["interval", "wall", "event"])),
                                    draw(st.sampled_from(["0", "wall", "-1", "9" * 30, "10"]))))
        else:
            events.append(B.event(draw(st.sampled_from([t.id for t in types] + [0, 1, 999])),
                                  draw(blobs)))
    header = {"tps": draw(st.sampled_from([1, 10**9, 2**64 - 1])),
              "start_ticks": draw(st.sampled_from([0, B.START_TICKS, 2**64 - 1]))}
    return B.recording(events, types=types, pools=pools, **header)


class TestBuiltRecordings:
    @FUZZ
    @given(built_recordings())
    def test_structured(self, data: bytes) -> None:
        """Well-framed recordings whose metadata, pools and events say odd things."""
        check(data)

    def test_seeds_read(self) -> None:
        """The seeds themselves are read (the mutations start from valid input)."""
        for data in seeds():
            assert check(data)


class TestLabels:
    @FUZZ
    @given(st.one_of(st.binary(max_size=200),
                     st.tuples(st.integers(0, 3), st.floats(0, 1), st.integers(0, 255)).map(
                         lambda t: _edit(captured()[t[0] % 2][1], t[1], t[2]))))
    def test_bytes(self, data: bytes) -> None:
        """Random bytes, and the captured snapshots with a byte changed or cut."""
        check_labels(data)

    @FUZZ
    @given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6),
           st.integers(0, 5))
    def test_labelled_samples(self, ids: list[int], which: int) -> None:
        """Samples whose context and span-name ids are anywhere in or out of a snapshot."""
        snap = LabelsSnapshot({i: {"k": "v"} for i in ids[::2]},
                                  {i: "name" for i in ids[1::2]})
        spans = tuple(ids[(which + k) % len(ids)] for k in range(5))
        rec = check(B.recording([B.sample(spans=spans)]), snap)
        assert rec is not None and len(rec.samples) == 1


def _edit(data: bytes, where: float, value: int) -> bytes:
    at = int(where * len(data))
    return data[:at] + bytes([value]) + data[at + 1:] if value else data[:at]


def _mutate(rnd: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        i = rnd.randint(0, len(out)) if out else 0
        op = rnd.randrange(6)
        if op == 0 and out:
            out[min(i, len(out) - 1)] ^= 1 << rnd.randrange(8)
        elif op == 1:
            v = rnd.choice(EXTREME_VARINTS)
            out[i:i + (len(v) if rnd.random() < 0.5 else 0)] = v
        elif op == 2 and out:  # a slice repeated: many events, entries, frames
            j = min(len(out), i + rnd.randint(1, 64))
            out[i:i] = out[i:j] * rnd.choice([2, 10, 1000])
        elif op == 3:
            del out[i:]
        elif op == 4:
            other = rnd.choice(corpus)
            k = rnd.randint(0, len(other))
            out[i:] = other[k:]
        else:
            del out[i:i + rnd.randint(1, 8)]
    return bytes(out[:512 << 10])


class TestMutations:
    """Byte-level mutants (``_mutate``), made from the corpus round robin; ``check`` and
    ``check_labels`` count them."""

    def test_mutants(self) -> None:
        """Byte-level mutants of every seed: read or refused, never anything else."""
        labels = parse_labels(captured()[0][1])
        run_mutants("jfr", seeds(), _mutate, lambda data: check(data, labels), MUTANTS,
                    round_robin=True, counted=False)

    def test_label_mutants(self) -> None:
        """Byte-level mutants of the captured labels snapshots: read or refused."""
        run_mutants("jfr_labels", [lab for _, lab in captured()], _mutate, check_labels,
                    MUTANTS, round_robin=True, counted=False)

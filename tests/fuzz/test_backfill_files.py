"""The backfill file reader (``pipeline/backfill/files.py``) fed hostile files: the
Collector exporter's encodings, pprof and JFR, mutated (bytes flipped, extreme length
prefixes, repeated slices, truncations, splices) before or after gzip/zstd. Every file
reads as pieces and errors only: ``read`` never raises, every piece is within
``max_message_bytes``, nothing is read past ``max_file_bytes``, every error names the file.

Counted in ``support.INPUTS`` (``backfill_files``); the mutation loop runs
``SPANPROF_FUZZ_BACKFILL_MUTATIONS`` mutants (default 300; ``make fuzz``: 20000).
"""

from __future__ import annotations

import gzip
import os
import random
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.backfill import files
from pipeline.backfill.file_content import GZIP_MAGIC, ZSTD_MAGIC
from pipeline.backfill.file_pieces import Bad, Limits, Piece
from pipeline.records import ProfileBatch, SpanBatch
from tests.backfill import collector_files as C
from tests.backfill.test_files import MSGS
from tests.fuzz.support import FUZZ, PROFILE, byte_mutator, count, run_mutants
from tests.pipeline.receivers.test_pyroscope import pprof as make_pprof

JFR = Path(__file__).resolve().parents[1] / "testdata" / "jfr"
LIMITS = Limits(max_message_bytes=16 << 10, max_file_bytes=1 << 20)
MUTANTS = int(os.environ.get("SPANPROF_FUZZ_BACKFILL_MUTATIONS",
                             20_000 if PROFILE == "fuzz" else 300))
PREFIXES = [b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x00\x00\x40\x01", b"\x00\x00\x3f\xff",
            b"\x00\x00\x00\x01", ZSTD_MAGIC, GZIP_MAGIC, files.JFR_MAGIC, b"{",
            b"\n", b"\x0a\x7b"]


@cache
def contents() -> list[bytes]:
    """Uncompressed seeds: each encoding's content, pprof, a JFR recording."""
    jfr = gzip.decompress((JFR / "itimer-2.jfr.gz").read_bytes())
    return [C.json_lines(MSGS), C.prefixed(MSGS), C.legacy_zstd(MSGS, "json"),
            C.legacy_zstd(MSGS, "proto"),
            make_pprof([([1, 2], 10_000_000, {"span_id": "0102030405060708"})]), jfr[:8192],
            jfr]


WRAPS = [lambda b: b, gzip.compress, lambda b: C.native_zstd(b, 2)]


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("backfill-fuzz") / "in.bin"


def check(path: Path, data: bytes) -> None:
    """The property: only pieces and errors, within the bounds, errors naming the file."""
    path.write_bytes(data)
    count("backfill_files")
    for it in files.read(path, LIMITS, "svc"):
        assert it.origin.path == path
        if isinstance(it, Piece):
            assert isinstance(it.batch, SpanBatch | ProfileBatch)
            assert 0 <= it.size <= LIMITS.max_message_bytes
            assert it.rejected >= 0
        else:
            assert isinstance(it, Bad), it
            assert str(path) in it.error
        if it.origin.unit == "byte":
            assert it.origin.at <= LIMITS.max_file_bytes


mutate = byte_mutator(PREFIXES, repeats=(2, 10, 300), cap=256 << 10)


class TestBackfillFiles:
    @FUZZ
    @given(st.integers(0, 6), st.integers(0, 2), st.integers(0, 1 << 32), st.booleans())
    def test_mutated(self, where: Path, seed: int, wrap: int, rs: int, inside: bool) -> None:
        """A seed mutated inside its compression (the content is hostile, the gzip/zstd
        valid) or outside it (the stream itself is damaged)."""
        rnd = random.Random(rs)
        data = contents()[seed]
        if inside:
            data = WRAPS[wrap](mutate(rnd, data, contents()))
        else:
            data = mutate(rnd, WRAPS[wrap](data), contents())
        check(where, data)

    @FUZZ
    @given(st.binary(max_size=4096))
    def test_random(self, where: Path, data: bytes) -> None:
        """Any bytes at all."""
        check(where, data)

    @FUZZ
    @given(st.integers(0, 6), st.integers(0, 2), st.floats(0, 1))
    def test_truncated(self, where: Path, seed: int, wrap: int, cut: float) -> None:
        """Every seed, under every wrapping, cut anywhere."""
        data = WRAPS[wrap](contents()[seed])
        check(where, data[: int(len(data) * cut)])

    def test_mutants(self, where: Path) -> None:
        """The volume: seeded mutants of every seed under every wrapping."""
        corpus = [w(c) for c in contents() for w in WRAPS] + list(contents())
        run_mutants("backfill_files", corpus, mutate, lambda d: check(where, d), MUTANTS,
                    counted=False)

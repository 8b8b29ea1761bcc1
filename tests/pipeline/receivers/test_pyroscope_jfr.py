"""``/ingest?format=jfr`` decoding (pipeline/pyroscope/jfringest.py) on the captured Java
agent uploads, and its refusals: what is not a recording is a 400 naming the part, what is
over the push's limits a 413."""

from __future__ import annotations

import gzip
from collections import Counter
from urllib.parse import parse_qsl

import pytest

from pipeline.errors import InvalidData, TooLarge
from pipeline.pyroscope import pprof
from pipeline.pyroscope.ingest import decode_ingest
from tests.e2e.test_java_jfr import BOUNDARY, DATA, uploads

FORM = f"multipart/form-data; boundary={BOUNDARY}"


def decode(query: str, body: bytes, ctype: str = FORM,
           limits: pprof.Limits = pprof.DEFAULT_LIMITS, max_bytes: int = 64 << 20) -> list:
    return decode_ingest(dict(parse_qsl(query)), ctype, body, max_bytes, limits).batch.samples


class TestJfrIngest:
    def test_records_keep_instant_thread_and_labels(self) -> None:
        query, body = uploads()[0]
        samples = decode(query, body)
        kinds = Counter((s.measure, s.sample_type, s.unit) for s in samples)
        assert kinds[("cpu", "cpu", "nanoseconds")] > 200
        assert kinds[("lock", "lock_duration", "nanoseconds")] > 0
        assert kinds[("alloc", "alloc_bytes", "bytes")] > 0
        cpu = [s for s in samples if s.measure == "cpu"]
        assert all(s.timed and s.time_ns > 1_700_000_000 * 10**9 for s in cpu)
        assert all(s.value == 10_000_000 and s.count == 1 for s in cpu)  # sampleRate=100
        labelled = [s for s in cpu if s.span_id]
        assert labelled and all(len(s.span_id) == 8 and len(s.trace_id) == 16
                                for s in labelled)
        assert all(s.thread_id and s.thread_name for s in cpu)
        assert {s.service for s in samples} == {"capture-app"}

    def test_the_recording_as_the_body(self) -> None:
        """No form: the body is the recording (gzipped here), without labels."""
        query, _ = uploads()[0]
        body = (DATA / "itimer-1.jfr.gz").read_bytes()
        samples = decode(query, body, "application/octet-stream")
        assert samples and not any(s.span_name for s in samples)

    @pytest.mark.parametrize(("body", "ctype", "message"), [
        (b"", "application/octet-stream", "no 'jfr' part"),
        (b"FLR\0" + b"\0" * 80, "application/octet-stream", "jfr"),
        (b"not a recording at all", "application/octet-stream", "jfr"),
        (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"labels\"\r\n\r\nx\r\n"
         f"--{BOUNDARY}--\r\n".encode(), FORM, "no 'jfr' part"),
    ])
    def test_not_a_recording_is_a_400(self, body: bytes, ctype: str, message: str) -> None:
        query, _ = uploads()[0]
        with pytest.raises(InvalidData, match=message):
            decode(query, body, ctype)

    def test_over_the_limits_is_a_413(self) -> None:
        query, body = uploads()[0]
        with pytest.raises(TooLarge):
            decode(query, body, limits=pprof.Limits(max_samples=10))
        bomb = gzip.compress(b"\0" * (2 << 20))
        with pytest.raises(TooLarge, match="max_decompressed_bytes"):
            decode(query, bomb, "application/octet-stream", max_bytes=1 << 20)

"""pipeline/backfill/files.py (with otlp_files.py, file_content.py, file_pieces.py): the
Collector's file exporter formats, pprof and JFR files, globs and directories, every bound,
truncated and malformed files."""

from __future__ import annotations

import gzip
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from pipeline.backfill import files
from pipeline.backfill.file_pieces import DEFAULT_LIMITS, Bad, Kind, Limits, Piece
from pipeline.errors import InvalidData
from pipeline.otlp.profiles import decode_profiles
from pipeline.otlp.traces import decode_traces
from pipeline.pyroscope import jfringest, pprof
from pipeline.pyroscope.messages import Profile
from tests.backfill import collector_files as C
from tests.pipeline.receivers.test_pyroscope import pprof as make_pprof

JFR = Path(__file__).resolve().parents[1] / "testdata" / "jfr"
SMALL = Limits(max_message_bytes=64 << 10, max_file_bytes=4 << 20)


def write(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def read(path: Path, limits: Limits = DEFAULT_LIMITS, service: str = "") -> list[Any]:
    return list(files.read(path, limits, service))


def spans_of(req: Any) -> Any:
    return decode_traces(req).batch.spans


def samples_of(req: Any) -> Any:
    return decode_profiles(req).batch.samples


MSGS = [C.traces(2, 1), C.profiles(2), C.traces(3, 3)]  # a file in two pipelines: mixed


def encodings() -> dict[str, bytes]:
    json_, proto = C.json_lines(MSGS), C.prefixed(MSGS)
    return {
        "json": json_,
        "proto": proto,
        "json+zstd (default)": C.legacy_zstd(MSGS, "json"),
        "proto+zstd (default)": C.legacy_zstd(MSGS, "proto"),
        "json+zstd (nativeCompression)": C.native_zstd(json_),
        "proto+zstd (nativeCompression)": C.native_zstd(proto, writes=3),
        "json.gz": gzip.compress(json_),
        "proto.gz": gzip.compress(proto),
    }


class TestRoundTrip:
    @pytest.mark.parametrize("how", list(encodings()))
    def test_collector_file(self, tmp_path: Path, how: str) -> None:
        """Each encoding the Collector's file exporter writes (and gzip around the plain
        ones) reads back as the same spans and samples, per message, in order, each piece
        named by its line or by the byte offset of its length prefix."""
        path = write(tmp_path, "out", encodings()[how])
        got = read(path)
        assert all(isinstance(it, Piece) for it in got), got
        assert [len(it.batch) for it in got] == [2, 2, 3]
        assert got[0].batch.spans == spans_of(MSGS[0])
        assert got[1].batch.samples == samples_of(MSGS[1])
        assert got[2].batch.spans == spans_of(MSGS[2])
        assert all(it.rejected == 0 and it.origin.path == path for it in got)
        if how.startswith("json") and "default" not in how:
            assert [str(it.origin) for it in got] == [f"{path}:{n}" for n in (1, 2, 3)]
        else:
            assert got[0].origin.unit == "byte" and got[0].origin.at == 0
            assert got[1].origin.at > 0 and str(got[1].origin).endswith(
                f"at byte {got[1].origin.at}")

    def test_offsets_are_prefix_offsets(self, tmp_path: Path) -> None:
        """A length-prefixed piece's offset is where its prefix starts, so a ledger can
        seek to it."""
        data = C.prefixed(MSGS)
        got = read(write(tmp_path, "p.bin", data))
        for it in got:
            n = struct.unpack(">I", data[it.origin.at:it.origin.at + 4])[0]
            assert n == it.size

    def test_partial_results_are_kept(self, tmp_path: Path) -> None:
        """A span its decoder refuses is counted in the piece with why; the others stay."""
        req = C.traces(2)
        req.resource_spans[0].scope_spans[0].spans[1].span_id = b"\x01"
        (it,) = read(write(tmp_path, "t.json", C.json_lines([req])))
        assert isinstance(it, Piece) and len(it.batch) == 1 and it.rejected == 1
        assert "span_id must be 8 bytes" in it.message

    def test_pprof(self, tmp_path: Path) -> None:
        """A pprof file, gzipped or not, with span labels: the service is the file's name,
        or the one given."""
        prof = Profile.FromString(
            make_pprof([([1, 2], 10_000_000, {"span_id": "0102030405060708"})]))
        prof.time_nanos = C.T0
        raw = prof.SerializeToString()
        want = pprof.decode_pprof(raw, "checkout").samples
        for name, data in (("checkout.pb.gz", gzip.compress(raw)), ("checkout.pprof", raw)):
            (it,) = read(write(tmp_path, name, data))
            assert isinstance(it, Piece) and it.batch.samples == want
            assert it.batch.samples[0].span_id == bytes.fromhex("0102030405060708")
            assert str(it.origin) == str(tmp_path / name)
        (it,) = read(tmp_path / "checkout.pprof", service="other")
        assert {s.service for s in it.batch.samples} == {"other"}

    def test_jfr_with_labels_beside_it(self, tmp_path: Path) -> None:
        """A JFR recording reads its labels snapshot from ``X.labels.gz`` beside
        ``X.jfr.gz``: the samples carry the span ids the agent's labels give them."""
        for ext in ("jfr.gz", "labels.gz"):
            shutil.copy(JFR / f"itimer-2.{ext}", tmp_path / f"itimer-2.{ext}")
        rec = gzip.decompress((JFR / "itimer-2.jfr.gz").read_bytes())
        labels = (JFR / "itimer-2.labels.gz").read_bytes()
        want = jfringest.decode_jfr(rec, labels, "itimer-2", 100, 64 << 20,
                                    pprof.DEFAULT_LIMITS)
        assert files.expand([str(tmp_path)]) == [tmp_path / "itimer-2.jfr.gz"]
        (it,) = read(tmp_path / "itimer-2.jfr.gz")
        assert isinstance(it, Piece) and it.batch.samples == want.samples
        assert any(s.span_id for s in it.batch.samples)


class TestDetect:
    def test_kinds(self, tmp_path: Path) -> None:
        """By content, not by name: the same bytes under any name are the same kind."""
        raw = make_pprof([([1], 1, {})])
        jfr = gzip.decompress((JFR / "wall-1.jfr.gz").read_bytes())
        cases = {
            C.json_lines([C.traces()]): Kind("otlp-json", "traces", ""),
            C.json_lines([C.profiles()]): Kind("otlp-json", "profiles", ""),
            C.prefixed([C.traces()]): Kind("otlp-proto", "traces", ""),
            C.prefixed([C.profiles()]): Kind("otlp-proto", "profiles", ""),
            C.legacy_zstd([C.traces()]): Kind("otlp-proto", None, ""),
            C.native_zstd(C.prefixed([C.profiles()]), 1): Kind("otlp-proto", "profiles", "zstd"),
            gzip.compress(C.json_lines([C.traces()])): Kind("otlp-json", "traces", "gzip"),
            raw: Kind("pprof", "profiles", ""),
            gzip.compress(raw): Kind("pprof", "profiles", "gzip"),
            jfr: Kind("jfr", "profiles", ""),
            b"": Kind("otlp-json", None, ""),
        }
        for data, kind in cases.items():
            assert files.detect(Path("x.json"), data[:files.HEAD_BYTES]) == kind, data[:40]

    def test_span_without_dictionary_is_told_by_wire(self) -> None:
        """A profiles request without a dictionary is still profiles (field 3 is I64)."""
        req = C.profiles()
        req.ClearField("dictionary")
        assert files.detect(Path("p"), C.prefixed([req])).signal == "profiles"

    def test_text_that_is_not_json(self, tmp_path: Path) -> None:
        """A README in a directory is a Bad naming it, not a crash or a pprof error."""
        with pytest.raises(InvalidData, match="text that is not OTLP/JSON"):
            files.detect(Path("README"), b"hello\n")
        (bad,) = read(write(tmp_path, "README", b"hello\n"))
        assert isinstance(bad, Bad) and str(tmp_path / "README") in bad.error


class TestExpand:
    def test_files_globs_directories(self, tmp_path: Path) -> None:
        """Files, globs (``**``) and directories (recursively, hidden names left out),
        each file once, sorted."""
        for name in ("a/1.json", "a/b/2.json", "a/.hidden/3.json", "a/.4.json", "c.pb",
                     "d.json"):
            write(tmp_path, name, b"{}\n")
        got = files.expand([str(tmp_path / "a"), str(tmp_path / "*.pb"),
                            str(tmp_path / "**" / "2.json"), str(tmp_path / "d.json")])
        assert got == sorted([tmp_path / "a/1.json", tmp_path / "a/b/2.json",
                              tmp_path / "c.pb", tmp_path / "d.json"])

    def test_missing_paths_named_together(self, tmp_path: Path) -> None:
        """Every path that matches nothing is named in one error."""
        write(tmp_path, "ok.json", b"{}\n")
        (tmp_path / "empty").mkdir()
        with pytest.raises(InvalidData) as err:
            files.expand([str(tmp_path / "ok.json"), str(tmp_path / "nope"),
                           str(tmp_path / "*.pb"), str(tmp_path / "empty")])
        for p in ("nope", "*.pb", "empty"):
            assert str(tmp_path / p) in str(err.value)
        assert "ok.json" not in str(err.value)


class TestBounds:
    def test_length_prefix_over_the_limit(self, tmp_path: Path) -> None:
        """A prefix over max_message_bytes is refused before its bytes are read, and ends
        the file: what follows cannot be framed. The pieces before it are kept."""
        data = C.prefixed([C.traces()]) + struct.pack(">I", (64 << 10) + 1) + b"x" * 10
        got = read(write(tmp_path, "p", data), SMALL)
        assert isinstance(got[0], Piece) and len(got) == 2
        bad = got[1]
        assert isinstance(bad, Bad) and bad.too_large and bad.origin.at == len(
            C.prefixed([C.traces()]))
        assert "max_message_bytes=65536" in bad.error and str(tmp_path / "p") in bad.error

    def test_json_line_over_the_limit(self, tmp_path: Path) -> None:
        """A line over the limit is refused without being parsed, and reading goes on at
        the next line (gzipped, a 50 MiB line costs no 50 MiB)."""
        huge = b'{"resourceSpans":[' + b" " * (50 << 20) + b"]}\n"
        data = gzip.compress(C.json_lines([C.traces()]) + huge + C.json_lines([C.traces()]))
        path = write(tmp_path, "big.json.gz", data)
        tracemalloc.start()
        try:
            got = read(path, Limits(max_message_bytes=1 << 20))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [type(it).__name__ for it in got] == ["Piece", "Bad", "Piece"]
        assert got[1].too_large and got[1].origin.at == 2 and got[2].origin.at == 3
        assert peak < 16 << 20, peak

    def test_gzip_bomb_stops_at_max_file_bytes(self, tmp_path: Path) -> None:
        """A file that inflates past max_file_bytes stops there with a Bad."""
        bomb = gzip.compress(b"\n" * (8 << 20))
        got = read(write(tmp_path, "bomb.gz", bomb), SMALL)
        assert len(got) == 1 and isinstance(got[0], Bad) and got[0].too_large
        assert "max_file_bytes" in got[0].error

    def test_zstd_message_bomb(self, tmp_path: Path) -> None:
        """A length-prefixed zstd frame that inflates past max_message_bytes is refused;
        the next message is read."""
        data = C.frame(C.zstd.compress(b"\0" * (8 << 20))) + C.legacy_zstd([C.traces()])
        got = read(write(tmp_path, "z", data), SMALL)
        assert isinstance(got[0], Bad) and got[0].too_large and "zstd" in got[0].error
        assert isinstance(got[1], Piece) and len(got[1].batch) == 2

    def test_profile_file_over_the_limit(self, tmp_path: Path) -> None:
        """A pprof file larger than max_message_bytes is refused whole, unparsed."""
        raw = make_pprof([([1], 1, {"k": "v" * (70 << 10)})])
        (bad,) = read(write(tmp_path, "big.pprof", raw), SMALL)
        assert isinstance(bad, Bad) and bad.too_large


class TestDamage:
    @pytest.mark.parametrize("cut", [2, 30])
    def test_truncated_proto(self, tmp_path: Path, cut: int) -> None:
        """A file cut inside a prefix or a message: the messages before it, then a Bad
        naming the offset of the cut one."""
        data = C.prefixed(MSGS)
        first = len(C.prefixed(MSGS[:1]))
        got = read(write(tmp_path, "t", data[:first + cut]))
        assert isinstance(got[0], Piece) and isinstance(got[1], Bad) and len(got) == 2
        assert got[1].origin.at == first and "truncated" in got[1].error

    def test_truncated_json_line(self, tmp_path: Path) -> None:
        """A last line cut short (the Collector stopped mid-write) is a Bad naming it."""
        data = C.json_lines(MSGS)
        got = read(write(tmp_path, "t.json", data[:-20]))
        assert [type(it).__name__ for it in got] == ["Piece", "Piece", "Bad"]
        assert str(got[2].origin) == f"{tmp_path / 't.json'}:3"

    @pytest.mark.parametrize("compress", [gzip.compress, C.native_zstd])
    def test_truncated_stream(self, tmp_path: Path, compress: Any) -> None:
        """A compressed file cut short: what was read, then a Bad, never an exception."""
        data = compress(C.json_lines(MSGS * 20))
        got = read(write(tmp_path, "t", data[: len(data) * 2 // 3]))
        assert isinstance(got[-1], Bad) and all(isinstance(it, Piece) for it in got[:-1])
        assert len(got) > 1

    def test_malformed_pieces_do_not_stop_the_file(self, tmp_path: Path) -> None:
        """A bad line, a bad message: a Bad each, and the next one is read."""
        lines = C.json_lines([C.traces()]) + b"{not json\n" + C.json_lines([C.traces()])
        got = read(write(tmp_path, "l.json", lines))
        assert [type(it).__name__ for it in got] == ["Piece", "Bad", "Piece"]
        assert "not valid JSON" in got[1].error and f"{tmp_path / 'l.json'}:2" in got[1].error
        msgs = C.prefixed([C.traces()]) + C.frame(b"\xff\xff\xff") + C.prefixed([C.traces()])
        got = read(write(tmp_path, "m", msgs))
        assert [type(it).__name__ for it in got] == ["Piece", "Bad", "Piece"]

    def test_unreadable(self, tmp_path: Path) -> None:
        """A path that vanished or is a directory is a Bad naming it."""
        for p in (tmp_path / "gone", tmp_path):
            (bad,) = read(p)
            assert isinstance(bad, Bad) and str(p) in bad.error


class TestJsonOrProto:
    def test_a_message_whose_first_length_is_a_brace(self, tmp_path: Path) -> None:
        """A protobuf message starting ``0a 7b`` (resource_spans of 123 bytes) is protobuf,
        not JSON: no leading byte is stripped before the ``{`` test."""
        for n in range(200):
            req = C.traces(1)
            req.resource_spans[0].scope_spans[0].spans[0].name = "x" * n
            wire = req.SerializeToString()
            if wire[:2] == b"\x0a\x7b":
                break
        else:
            raise AssertionError("no name length gives a 123-byte resource_spans")
        (it,) = read(write(tmp_path, "m", C.frame(wire)))
        assert isinstance(it, Piece) and it.batch.spans == spans_of(req)

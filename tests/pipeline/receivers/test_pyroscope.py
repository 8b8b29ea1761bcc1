"""The Pyroscope receiver with the request bodies captured from the real Python SDK."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import aiohttp
import pytest

from pipeline.errors import InvalidData, Retryable, TooLarge
from pipeline.pyroscope.messages import Profile, PushRequest
from pipeline.receivers.pyroscope import PUSH_PATH, Config, PyroscopeReceiver
from pipeline.registry import Context
from tests.pipeline.receivers.test_otlp_grpc import FakeConsumer

FIXTURES = Path(__file__).resolve().parents[2] / "testdata" / "pyroscope-python"
HEADERS = {"content-type": "application/proto", "content-encoding": "gzip",
           "user-agent": "pyroscope-rs/pyspy/1.4.0 reqwest"}


@pytest.fixture
async def server() -> AsyncIterator[tuple[PyroscopeReceiver, FakeConsumer, str]]:
    fake = FakeConsumer()
    r = PyroscopeReceiver(Config(endpoint="127.0.0.1:0", max_decompressed_bytes=1 << 20),
                          Context("pyroscope", ["profiles"], next={"profiles": fake}))
    await r.start()
    yield r, fake, f"http://127.0.0.1:{r.port}"
    await r.shutdown()


def truth_of(body: bytes) -> dict[bytes, int]:
    """Sum of pprof values per span_id label, read straight from the captured request."""
    out: dict[bytes, int] = defaultdict(int)
    for series in PushRequest.FromString(gzip.decompress(body)).series:
        for raw in series.samples:
            data = raw.raw_profile
            p = Profile.FromString(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
            st = p.string_table
            for s in p.sample:
                labels = {st[lb.key]: st[lb.str] for lb in s.label}
                if "span_id" in labels:
                    out[bytes.fromhex(labels["span_id"])] += s.value[0]
    return out


def pprof(samples: list[tuple[list[int], int, dict[str, str]]], locations: int = 2) -> bytes:
    p = Profile()
    strings = ["", "cpu", "nanoseconds"]

    def s(x: str) -> int:
        if x not in strings:
            strings.append(x)
        return strings.index(x)
    p.sample_type.add(type=1, unit=2)
    p.period_type.type, p.period_type.unit, p.period = 1, 2, 10_000_000
    for i in range(1, locations + 1):
        p.function.add(id=i, name=s(f"fn{i}"), filename=s("a.py"))
        p.location.add(id=i, line=[{"function_id": i, "line": i}])
    for locs, v, labels in samples:
        smp = p.sample.add(location_id=locs, value=[v])
        for k, val in labels.items():
            smp.label.add(key=s(k), str=s(val))
    p.string_table.extend(strings)
    return p.SerializeToString()


def push_body(raw: bytes, service: str = "svc") -> bytes:
    req = PushRequest()
    series = req.series.add()
    series.labels.add(name="service_name", value=service)
    series.samples.add(raw_profile=raw)
    return gzip.compress(req.SerializeToString())


class TestPyroscopeReceiver:
    @pytest.mark.parametrize("name", ["req1.bin", "req2.bin", "req3.bin"])
    async def test_captured_sdk_requests(self, server: Any, name: str) -> None:
        """Each body the real SDK sent is accepted (200), and the CPU per span equals the
        sum of the pprof values labelled with that span_id; service from the series."""
        r, fake, url = server
        body = (FIXTURES / name).read_bytes()
        async with aiohttp.ClientSession() as http:
            async with http.post(url + PUSH_PATH, data=body, headers=HEADERS) as resp:
                assert resp.status == 200, await resp.text()
        got: dict[bytes, int] = defaultdict(int)
        for batch in fake.batches:
            for smp in batch.samples:  # type: ignore[union-attr]
                assert smp.service == "checkout" and smp.measure == "cpu"
                if smp.span_id:
                    # req2 holds a sample the SDK labelled with span_id alone
                    assert len(smp.trace_id) in (0, 16)
                    got[smp.span_id] += smp.value
        assert got == truth_of(body) and got

    async def test_span_only_and_datadog_labels(self, server: Any) -> None:
        """span_id without trace_id is a span-only link; profile_id and Datadog's decimal
        'span id' mean the same; samples without span labels are unlinked."""
        r, fake, url = server
        raw = pprof([([1, 2], 10, {"span_id": "00000000000000aa"}),
                     ([1], 20, {"profile_id": "00000000000000bb"}),
                     ([2], 30, {"span id": "204"}),
                     ([2], 40, {})])
        async with aiohttp.ClientSession() as http:
            async with http.post(url + PUSH_PATH, data=push_body(raw), headers=HEADERS) as resp:
                assert resp.status == 200
        got = [(s.trace_id, s.span_id.hex(), s.value) for s in fake.batches[0].samples]
        assert got == [(b"", "00000000000000aa", 10), (b"", "00000000000000bb", 20),
                       (b"", "00000000000000cc", 30), (b"", "", 40)]
        stack = fake.batches[0].stacks[fake.batches[0].samples[0].stack_id]
        assert stack.functions == ["fn1", "fn2"]

    async def test_thread_and_span_name_labels_kept(self, server: Any) -> None:
        """thread_id (string or numeric label), thread_name and span_name reach the sample."""
        r, fake, url = server
        p = Profile.FromString(pprof([([1], 10, {"span_id": "00000000000000aa",
                                                  "span_name": "GET /cart",
                                                  "thread_id": "140211", "thread_name": "w-1"}),
                                      ([2], 20, {})]))
        key = len(p.string_table)
        p.string_table.append("thread_id")
        p.sample[1].label.add(key=key, num=77)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + PUSH_PATH, data=push_body(p.SerializeToString()),
                                 headers=HEADERS) as resp:
                assert resp.status == 200
        got = [(s.thread_id, s.thread_name, s.span_name) for s in fake.batches[0].samples]
        assert got == [(140211, "w-1", "GET /cart"), (77, "", "")]

    @pytest.mark.parametrize("case,status,text", [
        ("bomb", 413, "decompresses to more than"),
        ("truncated", 400, "not a valid profile"),
        ("dangling", 400, "references location 9"),
        ("garbage", 400, "not a push.v1.PushRequest"),
    ])
    async def test_bad_bodies_get_4xx_and_serving_goes_on(self, server: Any, case: str,
                                                          status: int, text: str) -> None:
        """A gzip bomb, a truncated pprof, a pprof with dangling location ids and garbage
        each get a 4xx with a message; the next good request is accepted."""
        r, fake, url = server
        good = pprof([([1], 10, {"span_id": "00000000000000aa"})])
        body = {
            "bomb": gzip.compress(b"\0" * (8 << 20)),
            "truncated": push_body(good[: len(good) // 2]),
            "dangling": push_body(pprof([([9], 10, {})])),
            "garbage": gzip.compress(b"\xff\xfe\xfd not protobuf"),
        }[case]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + PUSH_PATH, data=body, headers=HEADERS) as resp:
                assert resp.status == status
                assert text in (await resp.json())["message"]
            async with http.post(url + PUSH_PATH, data=push_body(good), headers=HEADERS) as resp:
                assert resp.status == 200
        assert [len(b) for b in fake.batches] == [1]

    async def test_legacy_ingest_raw_and_multipart(self, server: Any) -> None:
        """/ingest takes a raw pprof body or the multipart form; the service comes from the
        app name without its profile-type suffix."""
        r, fake, url = server
        raw = pprof([([1], 10, {"span_id": "00000000000000aa"})])
        q = "?name=shop.cpu{env=prod}&format=pprof&from=1&until=2&sampleRate=100"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/ingest" + q, data=raw) as resp:
                assert resp.status == 200
            form = aiohttp.FormData()
            form.add_field("profile", raw, filename="profile.pprof")
            # another time range: the same profile for the same range is a resend, stored once
            async with http.post(url + "/ingest" + q.replace("from=1", "from=2"),
                                 data=form) as resp:
                assert resp.status == 200
            async with http.post(url + "/ingest?name=x&format=jfr", data=b"a;b 1") as resp:
                assert resp.status == 400  # not a recording
                assert "jfr" in await resp.text()
        assert [b.samples[0].service for b in fake.batches] == ["shop", "shop"]

    async def test_legacy_multipart_sample_type_config(self, server: Any) -> None:
        """The Java agents' form: sample_type_config says itimer values count samples of
        the profile's period, so they are CPU ticks; bad JSON there is a 400."""
        r, fake, url = server
        p = Profile.FromString(pprof([([1], 3, {"span_id": "00000000000000aa"})]))
        p.string_table.extend(["itimer", "count"])
        p.sample_type[0].type, p.sample_type[0].unit = len(p.string_table) - 2, \
            len(p.string_table) - 1
        q = "?name=shop.itimer{env=prod}&format=pprof&spyName=javaspy"
        async with aiohttp.ClientSession() as http:
            for config, status in ((b"{not json", 400),
                                   (b'{"itimer": {"units": "samples", "sampled": true}}', 200)):
                form = aiohttp.FormData()
                form.add_field("profile", p.SerializeToString(), filename="profile.pprof")
                form.add_field("sample_type_config", config, filename="sample_type_config.json")
                async with http.post(url + "/ingest" + q, data=form) as resp:
                    assert resp.status == status, await resp.text()
        (smp,) = fake.batches[0].samples
        assert (smp.service, smp.measure, smp.value, smp.count) == ("shop", "cpu", 30_000_000, 3)

    @pytest.mark.parametrize("ctype,body", [
        ("multipart/form-data", b"--X\r\n\r\nx\r\n--X--\r\n"),  # no boundary=
        ("multipart/form-data; boundary=X", b"not a multipart body at all"),
        ("multipart/form-data; boundary=X",
         b'--X\r\nContent-Disposition: form-data; name="profile"\r\n\r\nabc'),  # cut
        ("multipart/form-data; boundary=X",
         b'--X\r\nContent-Disposition: form-data; name="profile"\r\n'
         b"Content-Transfer-Encoding: bogus\r\n\r\nabc\r\n--X--\r\n"),
        ("multipart/mixed; boundary=X",
         b"--X\r\nContent-Type: multipart/mixed\r\n\r\n--Y\r\n\r\n--X--\r\n"),
    ])
    async def test_malformed_multipart_is_400_not_500(self, server: Any, ctype: str,
                                                       body: bytes) -> None:
        """aiohttp's multipart reader raised ValueError/RuntimeError on these (500s); the
        form is now parsed from the bounded body and any fault is the client's."""
        r, fake, url = server
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/ingest?name=x&format=pprof", data=body,
                                 headers={"Content-Type": ctype}) as resp:
                assert resp.status == 400, await resp.text()
        assert fake.batches == []

    async def test_multipart_bounded_as_a_whole_and_gzip_of_the_whole_form(
            self, server: Any) -> None:
        """Every part counts towards max_request_bytes (a form with a huge unnamed part is
        413), and a form gzipped as a whole is inflated like any other body."""
        r, fake, url = server
        raw = pprof([([1], 10, {"span_id": "00000000000000aa"})])
        form = aiohttp.FormData()
        form.add_field("junk", b"\0" * (r.cfg.max_request_bytes + 1), filename="junk")
        form.add_field("profile", raw, filename="profile.pprof")
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/ingest?name=x&format=pprof", data=form) as resp:
                assert resp.status == 413
            boundary = "b0undary"
            body = (f'--{boundary}\r\nContent-Disposition: form-data; name="profile"; '
                    f'filename="p.pprof"\r\n\r\n').encode() + raw + \
                f"\r\n--{boundary}--\r\n".encode()
            async with http.post(url + "/ingest?name=shop&format=pprof",
                                 data=gzip.compress(body),
                                 headers={"Content-Type": f"multipart/form-data; "
                                                          f"boundary={boundary}",
                                          "Content-Encoding": "gzip"}) as resp:
                assert resp.status == 200, await resp.text()
        assert [b.samples[0].value for b in fake.batches] == [10]

    async def test_a_form_sent_again_is_stored_once(self, server: Any) -> None:
        """An SDK resending the same upload (a new multipart boundary each time) gets 200
        and the samples are delivered once; another profile for the same app is not a
        resend."""
        r, fake, url = server
        q = "?name=shop.cpu&format=pprof&from=1&until=2"
        async with aiohttp.ClientSession() as http:
            for value in (10, 10, 11):
                form = aiohttp.FormData()
                form.add_field("profile", pprof([([1], value, {})]), filename="p.pprof")
                async with http.post(url + "/ingest" + q, data=form) as resp:
                    assert resp.status == 200
        assert [b.samples[0].value for b in fake.batches] == [10, 11]
        assert r.metrics["duplicate_requests"] == 1

    async def test_backpressure_is_503_with_retry_after(self, server: Any) -> None:
        """A full pipeline answers 503 with Retry-After; nothing is reported as accepted."""
        r, fake, url = server
        fake.fail = Retryable("full", retry_after=7)
        raw = pprof([([1], 10, {})])
        async with aiohttp.ClientSession() as http:
            async with http.post(url + PUSH_PATH, data=push_body(raw), headers=HEADERS) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "7"
        assert r.metrics["accepted_samples"] == 0


def _push_of(raws: list[bytes], service: str = "svc") -> bytes:
    req = PushRequest()
    series = req.series.add()
    series.labels.add(name="service_name", value=service)
    for raw in raws:
        series.samples.add(raw_profile=raw)
    return req.SerializeToString()


class TestPushBounds:
    """Issue #13: a push is bounded before it is decoded, and unstorable values are 400s."""

    def test_samples_counted_across_the_push_before_building(self) -> None:
        """Many small profiles whose samples add up over the limit: 413 before any record
        is built (the 331 KB push that became 2.68 GB)."""
        from pipeline.receivers.pyroscope import decode_push

        raw = gzip.compress(pprof([([1, 2], 5, {})] * 2000))
        cfg = Config(max_samples_per_request=10_000)
        with pytest.raises(TooLarge, match="max_samples_per_request"):
            decode_push(_push_of([raw] * 6), cfg)
        assert sum(len(b) for b in decode_push(_push_of([raw] * 5), cfg)) == 10_000

    def test_deep_repeated_stacks_refused_with_bounded_memory(self) -> None:
        """Samples of distinct stacks that repeat one inlined-heavy location thousands of
        times: refused (413) by the frame budget, memory a small multiple of the input."""
        import tracemalloc

        from pipeline.receivers.pyroscope import decode_push

        p = Profile.FromString(pprof([([1], 5, {})], locations=1))
        for _ in range(500):
            p.location[0].line.add(function_id=1, line=3)
        for n in range(3000):
            p.sample.add(location_id=[1] * (1 + n % 16), value=[5])
        body = _push_of([gzip.compress(p.SerializeToString())])
        tracemalloc.start()
        with pytest.raises(TooLarge, match="frames"):
            decode_push(body, Config())
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 100 * p.ByteSize() + (16 << 20), (peak, p.ByteSize())

    @pytest.mark.parametrize("key, value, field", [
        ("time_nanos", 7_258_118_400 * 10**9, "time_nanos"),
        ("time_nanos", -1, "time_nanos"),
        ("value", 2**63 - 1, "value"),
    ])
    def test_unstorable_values_are_400_naming_the_field(self, key: str, value: int,
                                                        field: str) -> None:
        from pipeline.receivers.pyroscope import decode_push

        p = Profile.FromString(pprof([([1], 5, {})]))
        if key == "value":
            p.sample[0].value[0] = value
        else:
            p.time_nanos = value
        with pytest.raises(InvalidData, match=field) as err:
            decode_push(_push_of([p.SerializeToString()]), Config())
        assert not isinstance(err.value, TooLarge)

    def test_non_ascii_digit_labels_are_not_a_500(self) -> None:
        """"²".isdigit() is True and int("²") fails: such labels are not numbers."""
        from pipeline.pyroscope.pprof import decode_pprof

        raw = pprof([([1], 5, {"thread_id": "²", "span_id": "²"})])
        s = decode_pprof(raw, "svc").samples[0]
        assert (s.thread_id, s.span_id) == (0, b"")

    def test_too_many_labels_and_tables(self) -> None:
        from pipeline.receivers.pyroscope import decode_push

        raw = pprof([([1], 5, {f"k{i}": "v" for i in range(20)})])
        with pytest.raises(TooLarge, match="max_labels=8"):
            decode_push(_push_of([raw]), Config(max_labels=8))
        with pytest.raises(TooLarge, match="max_table_entries=3"):
            decode_push(_push_of([raw]), Config(max_table_entries=3))
        with pytest.raises(TooLarge, match="max_profiles_per_request=2"):
            decode_push(_push_of([raw] * 3), Config(max_profiles_per_request=2))

    def test_decompressed_bytes_bounded_across_the_push(self) -> None:
        """max_decompressed_bytes holds for the whole push, not per raw profile."""
        from pipeline.receivers.pyroscope import decode_push

        raw = gzip.compress(pprof([([1], 5, {"x": "y" * 50_000})]))
        with pytest.raises(TooLarge, match="max_decompressed_bytes"):
            decode_push(_push_of([raw] * 4), Config(max_decompressed_bytes=150_000))

    def test_legacy_name_and_sample_type_config(self) -> None:
        from pipeline.receivers.pyroscope import parse_name, parse_sample_type_config

        assert parse_name("app.cpu{env=prod}") == ("app", {"env": "prod"}, "cpu")
        assert parse_name("app{service_name=shop}") == ("shop", {"service_name": "shop"}, "")
        with pytest.raises(InvalidData, match="UTF-8"):
            parse_name("\udcff.cpu")
        for bad in (b'{"\\ud800": {}}', b"[" * 10_000 + b"]" * 10_000, b"[1]"):
            with pytest.raises(InvalidData, match="sample_type_config"):
                parse_sample_type_config(bad)

    def test_config_bounds(self) -> None:
        """max_samples_per_request is at most 2^21: values are bounded per sample so that a
        push's sum fits Int64 (pipeline/otlp/bounds.py)."""
        import msgspec

        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"max_samples_per_request": 2**22}, Config)
        assert msgspec.convert({}, Config).max_stack_depth == 8192


GO_FIXTURES = Path(__file__).resolve().parents[2] / "clients" / "go" / "testdata"


def go_form(raw: bytes, config: bytes = b"", prev: bytes = b"") -> tuple[bytes, str]:
    """A form as pyroscope-go writes it (Go's mime/multipart file parts), and its type."""
    boundary = "0e9551177e9a85d4"
    parts = [("profile", "profile.pprof", raw), ("prev_profile", "profile.pprof", prev),
             ("sample_type_config", "sample_type_config.json", config)]
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{fn}"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n"
        for name, fn, data in parts if data) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def profile_of_form(body: bytes, content_type: str) -> Any:
    from pipeline.receivers.pyroscope import parse_multipart

    raw = parse_multipart(body, content_type)["profile"]
    return Profile.FromString(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def heap(samples: list[tuple[list[str], list[int], dict[str, str]]],
         reverse_ids: bool = False) -> Any:
    """A Go-heap-like pprof: alloc_space/bytes (cumulative by default), inuse_space/bytes;
    ``reverse_ids`` numbers the same locations the other way round."""
    p = Profile()
    strings = ["", "alloc_space", "bytes", "inuse_space", "space"]

    def s(x: str) -> int:
        if x not in strings:
            strings.append(x)
        return strings.index(x)
    p.sample_type.add(type=1, unit=2)
    p.sample_type.add(type=3, unit=2)
    p.period_type.type, p.period_type.unit, p.period = 4, 2, 524288
    names = sorted({n for frames, _, _ in samples for n in frames})
    ids = {n: (len(names) - i if reverse_ids else i + 1) for i, n in enumerate(names)}
    for n in names:
        p.function.add(id=ids[n], name=s(n), filename=s("m.go"))
        p.location.add(id=ids[n], line=[{"function_id": ids[n], "line": 1}])
    for frames, values, labels in samples:
        smp = p.sample.add(location_id=[ids[n] for n in frames], value=values)
        for k, v in labels.items():
            smp.label.add(key=s(k), str=s(v))
    p.string_table.extend(strings)
    return p


def ingest(query: dict[str, str], body: bytes, content_type: str = "",
           max_bytes: int = 1 << 20, **limits: int) -> list[Any]:
    from pipeline.pyroscope.ingest import decode_ingest
    from pipeline.pyroscope.pprof import Limits

    return list(decode_ingest(query, content_type, body, max_bytes,
                              Limits(**limits)).batch.samples)


class TestIngestWithoutFormat:
    """Issue #14: pyroscope-go v1.5.0 posts a multipart /ingest with no ``format``; the
    body's format is decided as Pyroscope's server decides it, then checked."""

    @pytest.mark.parametrize("name", ["cpu", "heap", "goroutine", "mutex"])
    async def test_captured_go_sdk_uploads(self, server: Any, name: str) -> None:
        """Each upload the real Go SDK sent (tests/clients/go/testdata) is a 200; CPU per
        span equals the pprof's cpu/nanoseconds values per span_id label, and every sample
        takes the start of the upload's range (``from``, in ns)."""
        r, fake, url = server
        req = json.loads((GO_FIXTURES / "requests.json").read_text())[name]
        body = (GO_FIXTURES / f"{name}.bin").read_bytes()
        assert "format=" not in req["query"] and "prev_profile" not in body.decode("latin-1")
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/ingest?" + req["query"], data=body,
                                 headers={"Content-Type": req["content-type"]}) as resp:
                assert resp.status == 200, await resp.text()
        samples = [s for b in fake.batches for s in b.samples]
        frm = int(dict(parse_qsl(req["query"]))["from"])
        assert all(s.service == "goapp" and s.time_ns == frm and not s.timed for s in samples)
        p = profile_of_form(body, req["content-type"])
        st = p.string_table
        if name == "cpu":
            want: dict[bytes, int] = defaultdict(int)
            for smp in p.sample:
                labels = {st[lb.key]: st[lb.str] for lb in smp.label}
                want[bytes.fromhex(labels["span_id"])] += smp.value[1]  # cpu/nanoseconds
            got: dict[bytes, int] = defaultdict(int)
            for s in samples:
                assert s.measure == "cpu" and len(s.trace_id) == 16 and s.span_name == "crunch"
                got[s.span_id] += s.value
            assert got == want and got
        else:  # heap: bytes allocated "alloc", the rest raw "other"; goroutines: raw
            # "other"; mutex: no contention, no samples. Go labels no heap sample with a span
            assert {s.measure for s in samples} <= {"other", "alloc"}
            assert {s.sample_type for s in samples if s.measure == "alloc"} <= {"alloc_space"}
            assert name != "heap" or not any(s.span_id for s in samples)
            assert len(samples) == {"heap": sum(1 for smp in p.sample for v in smp.value if v > 0),
                                    "goroutine": len(p.sample), "mutex": 0}[name]

    @pytest.mark.parametrize("frm", ["1700000000", "1700000000000", "1700000000000000",
                                     "1700000000000000000"])
    def test_from_in_s_ms_us_or_ns(self, frm: str) -> None:
        """``from`` is read by its number of digits, as Pyroscope reads it; ``until``
        before ``from`` (the Go SDK's last upload) is no error."""
        body, ctype = go_form(gzip.compress(pprof([([1], 10, {"span_id": "00000000000000aa"})])))
        (s,) = ingest({"name": "svc", "from": frm, "until": "1"}, body, ctype)
        assert s.time_ns == 1_700_000_000 * 10**9 and s.span_id.hex() == "00000000000000aa"

    @pytest.mark.parametrize("how", ["raw", "gzip"])
    def test_raw_pprof_body_detected(self, how: str) -> None:
        raw = pprof([([1, 2], 10, {"span_id": "00000000000000aa"})])
        (s,) = ingest({"name": "svc"}, gzip.compress(raw) if how == "gzip" else raw)
        assert (s.measure, s.value, s.span_id.hex()) == ("cpu", 10, "00000000000000aa")

    @pytest.mark.parametrize("how", ["raw", "gzip", "crlf"])
    def test_folded_text_detected(self, how: str) -> None:
        """``a;b;c 12`` lines: root first, ticks at sampleRate (default 100 Hz); the same
        stack twice is one record; no span labels, so no links."""
        text = b"main;work 30\nmain;idle 2\nmain;work 5\n"
        body = {"raw": text, "gzip": gzip.compress(text),
                "crlf": text.replace(b"\n", b"\r\n")}[how]
        got = ingest({"name": "shop.cpu{env=prod}", "from": "1700000000"}, body)
        by_stack = {s.stack_id: s for s in got}
        assert sorted((s.value, s.count, s.measure) for s in got) == [
            (20_000_000, 2, "cpu"), (350_000_000, 35, "cpu")]
        assert all(s.service == "shop" and not s.span_id and s.time_ns == 1_700_000_000 * 10**9
                   for s in by_stack.values())

    @pytest.mark.parametrize("query,measure,value,sample_type", [
        ({"sampleRate": "1000"}, "cpu", 3_000_000, "samples"),
        ({"sampleRate": "0"}, "cpu", 30_000_000, "samples"),  # the SDK's 0: the default
        ({"name": "shop.wall"}, "wall", 30_000_000, "samples"),
        ({"name": "shop.alloc_objects", "units": "objects"}, "other", 3, "alloc_objects"),
        ({"name": "shop.alloc_objects"}, "other", 3, "alloc_objects"),  # units=samples
    ])
    def test_folded_units(self, query: dict[str, str], measure: str, value: int,
                          sample_type: str) -> None:
        (s,) = ingest({"name": "shop", **query}, b"main;work 3")
        assert (s.measure, s.value, s.sample_type) == (measure, value, sample_type)

    def test_lines_format_and_explicit_folded(self) -> None:
        got = ingest({"name": "svc", "format": "lines"}, b"a;b\na;b\na;c\n")
        assert sorted(s.count for s in got) == [1, 2]
        assert [s.count for s in ingest({"name": "svc", "format": "folded"}, b"a 7")] == [7]

    @pytest.mark.parametrize("body,ctype,text", [
        (b"\x00\x01\xff\xfe not protobuf", "",
         "body: not pprof (gzip/protobuf): pprof: not a valid profile"),
        (b"\x00\x01\xff\xfe not protobuf", "", "; not folded text: byte 0x00 at offset 0 is "
                                               "not text"),
        (b"hello world", "", "body: not pprof (gzip/protobuf): it is text; not folded text: "
                             "line 1: 'hello world' does not end in a sample count "
                             "(expected 'a;b;c 12')"),
        (b"a;;b 1", "", "line 1: an empty frame"),
        # mtime=0: the test id holds the bytes, which must be the same in every xdist worker
        (gzip.compress(b"\xff\xfe not pprof", mtime=0), "",
         "not folded text: not UTF-8 at offset 0"),
        (b"\x1f\x8b broken", "", "body: not valid gzip"),
        (b"x 1", "multipart/form-data; boundary=X", "multipart form: cannot parse it"),
    ])
    async def test_undetectable_bodies_are_400_naming_why(self, server: Any, body: bytes,
                                                          ctype: str, text: str) -> None:
        """A body that is neither: 400 saying why for both, nothing delivered."""
        r, fake, url = server
        headers = {"Content-Type": ctype} if ctype else {}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/ingest?name=svc", data=body, headers=headers) as resp:
                assert resp.status == 400
                assert text in await resp.text()
        assert fake.batches == []

    @pytest.mark.parametrize("query,text", [
        ({"format": "trie"}, "format=trie: not supported; spanprof takes pprof, jfr, folded"),
        ({"format": "bogus"}, "format='bogus': unknown"),
        ({"from": "now-1h"}, "from='now-1h': not a Unix time (digits: s, ms, us or ns)"),
        ({"from": "9" * 40}, "from='9999"),
        ({"from": "99999999999"}, "from 99999999999000000000 is outside the storable"),
    ])
    def test_bad_query_values_name_the_parameter(self, query: dict[str, str],
                                                 text: str) -> None:
        with pytest.raises(InvalidData) as err:
            ingest({"name": "svc", **query}, b"a;b 1")
        assert text in str(err.value) and not isinstance(err.value, TooLarge)

    def test_bounds_hold_on_every_path(self) -> None:
        """max_decompressed_bytes, max_samples_per_request and max_stack_depth hold for a
        detected body, a form's parts and folded text alike (413s naming the key)."""
        bomb = gzip.compress(b"\0" * (2 << 20))
        two = pprof([([1], 10, {}), ([2], 5, {})])
        cases = [
            ({}, bomb, ""),  # detected: inflated within the bound, then refused
            ({}, *go_form(bomb)),
            ({}, *go_form(gzip.compress(heap([(["a"], [1, 1], {})]).SerializeToString()),
                          prev=bomb)),
            ({"format": "folded"}, gzip.compress(b"a 1\n" * 300_000), ""),
        ]
        for query, body, ctype in cases:
            with pytest.raises(TooLarge, match="max_decompressed_bytes"):
                ingest({"name": "svc", **query}, body, ctype)
        with pytest.raises(TooLarge, match="max_samples_per_request=2"):
            ingest({"name": "svc"}, b"a 1\nb 1\nc 1", max_samples=2)
        with pytest.raises(TooLarge, match="max_samples_per_request=1"):
            ingest({"name": "svc"}, *go_form(two), max_samples=1)
        with pytest.raises(TooLarge, match="stack depth limit 4"):
            ingest({"name": "svc"}, b"a;b;c;d;e 1", max_stack_depth=4)


class TestPrevProfile:
    """Old Go SDKs sent cumulative heap/mutex/block profiles with the previous upload's
    profile as ``prev_profile``; the cumulative sample types become deltas."""

    def test_cumulative_types_become_deltas_per_stack_and_labels(self) -> None:
        """alloc_space (cumulative by default) loses the previous value of the same stack
        and labels, whatever the location ids; inuse_space (a gauge) is kept as it is; a
        stack with nothing new is not a record; never below zero."""
        prev = heap([(["alloc", "main"], [100, 7], {}),
                     (["alloc", "main"], [30, 1], {"span_id": "00000000000000aa"}),
                     (["grow", "main"], [90, 9], {})], reverse_ids=True)
        cur = heap([(["alloc", "main"], [150, 70], {}),
                    (["alloc", "main"], [30, 2], {"span_id": "00000000000000aa"}),
                    (["grow", "main"], [80, 9], {}),  # went back: nothing new
                    (["new", "main"], [40, 4], {})])
        body, ctype = go_form(gzip.compress(cur.SerializeToString()),
                              prev=prev.SerializeToString())
        got = sorted((s.sample_type, s.value, s.span_id.hex())
                     for s in ingest({"name": "svc"}, body, ctype))
        assert got == [("alloc_space", 40, ""), ("alloc_space", 50, ""),
                       ("inuse_space", 2, "00000000000000aa"), ("inuse_space", 4, ""),
                       ("inuse_space", 9, ""), ("inuse_space", 70, "")]

    def test_sample_type_config_says_which_are_cumulative(self) -> None:
        """With a sample_type_config, its ``cumulative`` flags decide (it replaced
        Pyroscope's defaults); without prev_profile nothing is subtracted."""
        prev = heap([(["a"], [100, 5], {})]).SerializeToString()
        cur = heap([(["a"], [150, 7], {})]).SerializeToString()
        for config, want in ((b'{"alloc_space": {"units": "bytes"}}', [150, 7]),
                             (b'{"inuse_space": {"cumulative": true}}', [150, 2]),
                             (b"", [50, 7])):
            body, ctype = go_form(cur, config, prev)
            got = {s.sample_type: s.value for s in ingest({"name": "svc"}, body, ctype)}
            assert [got.get("alloc_space"), got.get("inuse_space")] == want, config
        body, ctype = go_form(cur)
        assert sorted(s.value for s in ingest({"name": "svc"}, body, ctype)) == [7, 150]

    def test_bad_prev_profile_is_400_naming_it(self) -> None:
        cur = heap([(["a"], [150, 7], {})]).SerializeToString()
        body, ctype = go_form(cur, prev=b"\xff\xfe garbage")
        with pytest.raises(InvalidData, match="prev_profile: pprof: not a valid profile"):
            ingest({"name": "svc"}, body, ctype)
        dangling = heap([(["a"], [1, 1], {})])
        dangling.sample[0].location_id[0] = 99
        body, ctype = go_form(cur, prev=dangling.SerializeToString())
        with pytest.raises(InvalidData, match="prev_profile: sample.0. references location 99"):
            ingest({"name": "svc"}, body, ctype)

"""The Pyroscope receiver with the request bodies captured from the real Python SDK."""

from __future__ import annotations

import gzip
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

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
            async with http.post(url + "/ingest?name=x&format=folded", data=b"a;b 1") as resp:
                assert resp.status == 400
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

        assert parse_name("app.cpu{env=prod}") == ("app", {"env": "prod"})
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

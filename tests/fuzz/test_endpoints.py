"""Hostile HTTP requests on the wire against the real aiohttp apps: OTLP/HTTP and Pyroscope
receivers (with a downstream that accepts everything) and the admin API (on a real
embedded ClickHouse). Property: every request is answered, below 500, and the servers
keep serving.

Requests are written as raw bytes on a socket, so that request lines, headers and bodies
no HTTP client would produce (lone surrogates, NUL, bad chunking, gzip garbage) are sent
as they are. How many examples run is the hypothesis profile's (tests/fuzz/support.py:
bounded by default, long with the ``fuzz`` profile); requests are counted as
``wire:<server>`` in the fuzz summary.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.admin.server import AdminServer
from pipeline.exporters.clickhouse.exporter import ClickHouseExporter
from pipeline.exporters.clickhouse.exporter import Config as ClickHouseConfig
from pipeline.graph import Graph, Node
from pipeline.receivers.http import ServerLimits
from pipeline.receivers.otlp import Config, OtlpReceiver, Protocols
from pipeline.receivers.otlp_http import HttpConfig
from pipeline.receivers.pyroscope import Config as PyroscopeConfig
from pipeline.receivers.pyroscope import PyroscopeReceiver
from pipeline.registry import Context
from tests.fuzz import strategies as S
from tests.fuzz.support import FUZZ, count
from tests.pipeline.receivers.test_otlp_grpc import span_request

# a request head that never ends (a lone "\n" is one) is closed after 1 s, not the default 10
QUICK = ServerLimits(read_header_timeout=1.0)


class Accept:
    """A downstream that takes every batch."""

    async def consume(self, batch: Any) -> None:
        pass


class Servers:
    """The three apps, started on free ports in an event loop of their own thread (the
    hypothesis tests are synchronous and talk to them over sockets)."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.ports: dict[str, int] = {}

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.otlp = OtlpReceiver(
            Config(protocols=Protocols(http=HttpConfig(
                endpoint="127.0.0.1:0", max_request_bytes=1 << 20,
                max_decompressed_bytes=4 << 20, read_header_timeout=1.0))),
            Context("otlp", ["traces", "profiles"],
                    next={"traces": Accept(), "profiles": Accept()}))  # type: ignore[dict-item]
        self.pyroscope = PyroscopeReceiver(
            PyroscopeConfig(endpoint="127.0.0.1:0", max_request_bytes=1 << 20,
                            max_decompressed_bytes=4 << 20),
            Context("pyroscope", ["profiles"], next={"profiles": Accept()}))  # type: ignore[dict-item]
        self.pyroscope.limits = QUICK
        self.clickhouse = ClickHouseExporter(
            ClickHouseConfig(endpoint=f"chdb://{self.data}", flush_interval=0.05, ttl=0),
            Context("clickhouse", ["traces", "profiles"], data_dir=str(self.data)))
        await self.clickhouse.start()
        graph = Graph(nodes={"exporter:clickhouse": Node("exporter:clickhouse",
                                                         self.clickhouse)},
                      order=["exporter:clickhouse"])
        self.admin = AdminServer("127.0.0.1:0", graph, limits=QUICK)
        await self.otlp.start()
        await self.pyroscope.start()
        await self.admin.start()
        assert self.otlp.http is not None
        self.ports = {"otlp": int(self.otlp.http.port or 0),
                      "pyroscope": int(self.pyroscope.port or 0),
                      "admin": int(self.admin.port or 0)}

    def stop(self) -> None:
        async def _stop() -> None:
            await self.admin.shutdown()
            await self.pyroscope.shutdown()
            await self.otlp.shutdown()
            await self.clickhouse.shutdown()
        try:
            self.run(_stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("fuzz") / "ch")
    s.start()
    yield s
    s.stop()


def exchange(port: int, raw: bytes, timeout: float = 30.0) -> bytes:
    """Send ``raw`` and read until the server closes (requests say Connection: close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(raw)  # no half-close: aiohttp closes on EOF, before answering
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (and closed) before the whole request was sent
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out


def status_of(answer: bytes) -> int:
    line = answer.split(b"\r\n", 1)[0].split()
    assert len(line) >= 2 and line[0].startswith(b"HTTP/1."), f"no HTTP answer: {answer[:200]!r}"
    return int(line[1])


def request(method: str, target: str, headers: list[tuple[str, str]], body: bytes,
            chunked: bool = False) -> bytes:
    head = [f"{method} {target} HTTP/1.1", "Host: fuzz", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers]
    if chunked:
        head.append("Transfer-Encoding: chunked")
        body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 4096]), body[i:i + 4096])
                        for i in range(0, len(body), 4096)) + b"0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(body)}")
    return "\r\n".join(head).encode("utf-8", "surrogatepass") + b"\r\n\r\n" + body


def check(servers: Servers, name: str, raw: bytes) -> None:
    count(f"wire:{name}")
    status = status_of(exchange(servers.ports[name], raw))
    assert status < 500, f"{name} answered {status} to {raw[:300]!r}"


# ---- strategies ------------------------------------------------------------------------

HOSTILE_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\x00", "\ud800", "a\udfffb", "²", "\u202e", "\x7f", "\r", "%00",
                     "%ED%A0%80", "%FF", "ü" * 300, "-1", "0", "1e999", "9" * 400, "nan",
                     "1900-01-01T00:00:00..", "1900-01-01T00:00:00..2000-01-01",
                     "2200-01-01..2300-01-01", "99999999d", "1h..2h", "0s..0s", "..",
                     "1h..", "0001-01-01", "9999-12-31T23:59:59", "1h" * 100]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
)


def _json_doc(depth: int, key: str) -> bytes:
    return json.dumps({"resourceSpans": [{key: [[[]] * 2] * depth}]},
                      ensure_ascii=True).encode()


JSON_BODIES = st.one_of(
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 100_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.sampled_from([
        b'{"\\ud800": 1}', b'{"resourceSpans": [{"\\udfff": "\\ud800"}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "\\ud800", '
        b'"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174"}]}]}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": 1}]}]}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": 1e400}]}]}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": 99999999999999999999}]}]}]}',
        b'{"resourceSpans": 1}', b"null", b"[]", b'"\\ud800"', b"\xff\xfe{\x00}\x00",
        b"\xed\xa0\x80", b'{"a": NaN}', b'{"a": Infinity}', b"1" * 5000,
        b'{"resourceProfiles": [{"scopeProfiles": [{"profiles": [{"sample": [{}]}]}]}]}',
    ]),
    st.integers(1, 3000).map(lambda d: _json_doc(d, "scopeSpans")),
    st.binary(max_size=2000),
)

GZIP_BODIES = st.one_of(
    st.binary(max_size=2000).map(gzip.compress),
    st.binary(max_size=200).map(lambda b: b"\x1f\x8b" + b),
    JSON_BODIES.map(gzip.compress),
    st.just(gzip.compress(b"\0" * (8 << 20))),  # over max_decompressed_bytes
)

PROTOBUF_BODIES = st.one_of(
    st.binary(max_size=4000),
    st.binary(max_size=400).map(lambda b: span_request([b"\x01" * 8]).SerializeToString() + b),
    st.integers(0, 300).map(lambda n: span_request([b"\x01" * 8]).SerializeToString()[:n]),
)

@st.composite
def multipart_body(draw: Any) -> bytes:
    """A form with boundary ``xyz`` as /ingest takes it, with hostile part headers (nested
    multipart, unknown transfer encodings) and, sometimes, cut short."""
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["profile", "sample_type_config", "junk", "\u00b2", ""]))
        extra = draw(st.sampled_from([
            "", "Content-Transfer-Encoding: base64\r\n", "Content-Transfer-Encoding: bogus\r\n",
            "Content-Transfer-Encoding: quoted-printable\r\n",
            "Content-Type: multipart/mixed\r\n", "Content-Type: multipart/mixed; boundary=q\r\n",
            "Content-Encoding: br\r\n", "Content-Encoding: gzip\r\n"]))
        payload = draw(st.one_of(st.binary(max_size=300), JSON_BODIES, GZIP_BODIES))
        out += (f'--xyz\r\nContent-Disposition: form-data; name="{name}"; filename="f"\r\n'
                f"{extra}\r\n").encode("utf-8", "surrogatepass") + payload + b"\r\n"
    out += draw(st.sampled_from([b"--xyz--\r\n", b"", b"--xyz", b"--xy"]))
    return out[:draw(st.integers(0, len(out)))] if draw(st.booleans()) else out


CONTENT_TYPES = st.sampled_from([
    "application/json", "application/x-protobuf", "application/protobuf", "text/plain",
    "application/json; charset=utf-16", "application/proto", "multipart/form-data",
    "multipart/form-data; boundary=xyz", "", "application/json\x00", "*/*;;;=",
    "application/x-protobuf; charset=\ud800"])
ENCODINGS = st.sampled_from(["", "gzip", "x-gzip", "deflate", "br", "gzip, gzip",
                             "identity", "zstd", "\x00"])


@st.composite
def receiver_request(draw: Any, paths: list[str]) -> bytes:
    path = draw(st.one_of(st.sampled_from(paths),
                          st.sampled_from(paths).map(lambda p: p + "/../x"),
                          st.text(max_size=30).map(
                              lambda t: "/" + quote(t, safe="/%", errors="surrogatepass"))))
    query = draw(st.one_of(
        st.just(""),
        st.lists(st.tuples(st.sampled_from(["name", "format", "from", "until",
                                             "sampleRate", "spyName", "x"]),
                           st.one_of(st.sampled_from(["pprof", "folded", "lines", "jfr", "",
                                                      "1700000000000000000"]),
                                     HOSTILE_TEXT)), max_size=4).map(
            lambda kv: "?" + "&".join(f"{k}={quote(v, safe='%', errors='surrogatepass')}"
                                      for k, v in kv))))
    body = draw(st.one_of(JSON_BODIES, GZIP_BODIES, PROTOBUF_BODIES, multipart_body(),
                          S.folded_texts(), S.ingest_forms()))
    headers = [("Content-Type", draw(CONTENT_TYPES))]
    if enc := draw(ENCODINGS):
        headers.append(("Content-Encoding", enc))
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "OPTIONS"]))
    return request(method, path + query, headers, body, chunked=draw(st.booleans()))


ADMIN_PATHS = ["/api/v1/spans", "/api/v1/functions", "/api/v1/diff", "/api/v1/stacks",
               "/api/v1/why", "/health", "/metrics", "/ui/", "/ui/app.js", "/ui/../x"]
QUERY_PATHS = ["/api/v1/functions", "/api/v1/diff", "/api/v1/stacks", "/api/v1/why",
               "/api/v1/operations", "/api/v1/search", "/api/v1/histogram",
               "/api/v1/function_spans", "/api/v1/flamegraph"]  # the ranged ones
RANGES = st.one_of(
    st.sampled_from(["1900-01-01T00:00:00..", "1900-01-01T00:00:00..2000-01-01", "1h",
                     "1969-12-31T23:59:59..1h", "2106-02-08..2200-01-01", "2h..1h",
                     "1h..2h", "99999999d", "1e300s", "0s..0s", "..", "1h..", "..1h",
                     "0001-01-01..9999-12-31", "2024-01-01T00:00:00+14:00..1s",
                     "1h..1h..1h", "1" * 400, "-1h", "nan", "inf"]),
    st.integers(-(2**40), 2**40).map(lambda n: f"{n}s..{n // 2}s"),
    st.datetimes().map(lambda d: d.isoformat() + ".."),
    HOSTILE_TEXT)
LIMITS = st.one_of(st.integers(-(2**70), 2**70).map(str),
                   st.sampled_from(["", " 5 ", "1_0", "0x10", "١٢", "5.0", "1e3"]), HOSTILE_TEXT)
IDS = st.one_of(st.binary(min_size=0, max_size=20).map(bytes.hex),
                st.sampled_from(["5B8EFFF798038103D269B633813FC60C", "eee19b7ec3c1b17g",
                                 "ＥＥＥ19b7ec3c1b174", "İ" * 16]), HOSTILE_TEXT)
NAMES = st.one_of(st.sampled_from(["svc", "GET /", "\x00", "a\x00b", "\ud800", "\x1b[31m",
                                   "x" * 5000]), HOSTILE_TEXT)
ADMIN_PARAMS = {"since": RANGES, "before": RANGES, "after": RANGES, "limit": LIMITS,
                "service": NAMES, "operation": NAMES, "trace_id": IDS, "span_id": IDS,
                "method": st.sampled_from(["exact", "all", "link,thread", ",", "nope", "\x00"]),
                "order": st.sampled_from(["cpu", "inclusive", "duration", "off_cpu", "x"]),
                "range": RANGES, "stacks": st.sampled_from(["1", "x"]),
                "slowest": st.one_of(st.sampled_from(["1%", "50%", "50.1%", "0", "-1%", "nan%",
                                                      "inf", "1e-300", "%", "0.5"]),
                                     HOSTILE_TEXT),
                "slower_than": st.one_of(RANGES, st.sampled_from(["1s", "0s", "1e30s"])),
                # the web UI's (issue #18)
                "min_duration": LIMITS, "max_duration": st.sampled_from(["2s", "0", "-1s"]),
                "min_cpu": st.sampled_from(["10ms", "nan", "1e400s"]), "buckets": LIMITS,
                "function": NAMES, "children": st.sampled_from(["1", "0", "x"]),
                "measure": st.sampled_from(["cpu", "wall", "x"]), "base": RANGES,
                "max_nodes": LIMITS}


@st.composite
def admin_request(draw: Any) -> bytes:
    path = draw(st.one_of(
        st.sampled_from(QUERY_PATHS),
        st.sampled_from(ADMIN_PATHS),
        IDS.map(lambda t: "/api/v1/traces/" + quote(t, safe="%", errors="surrogatepass"))))
    params = [(k, draw(v)) for k, v in ADMIN_PARAMS.items() if draw(st.booleans())]
    if draw(st.integers(0, 3)):  # most requests name a service: past "required"
        params.insert(0, ("service", "svc"))
    query = "&".join(f"{k}={quote(v, safe='%', errors='surrogatepass')}" for k, v in params)
    method = draw(st.sampled_from(["GET", "GET", "GET", "POST", "HEAD"]))
    return request(method, f"{path}?{query}", [], b"")


WIRE = settings(FUZZ, deadline=None)  # a query on the embedded engine can take a while


class TestHostileRequests:
    @WIRE
    @given(raw=receiver_request(["/v1/traces", "/v1development/profiles"]))
    def test_otlp_http_never_500(self, servers: Servers, raw: bytes) -> None:
        """OTLP/HTTP: every request is answered, below 500."""
        check(servers, "otlp", raw)

    @WIRE
    @given(raw=receiver_request(["/push.v1.PusherService/Push", "/ingest"]))
    def test_pyroscope_never_500(self, servers: Servers, raw: bytes) -> None:
        """Pyroscope (Connect push and legacy ingest): answered below 500."""
        check(servers, "pyroscope", raw)

    @WIRE
    @given(raw=admin_request())
    def test_admin_never_500(self, servers: Servers, raw: bytes) -> None:
        """The admin API: a bad parameter is a 400 naming it, never a 500."""
        check(servers, "admin", raw)

    @WIRE
    @given(line=st.binary(min_size=1, max_size=300),
           name=st.sampled_from(["otlp", "pyroscope", "admin"]))
    def test_garbage_request_lines_and_headers(self, servers: Servers, line: bytes,
                                               name: str) -> None:
        """Bytes that are not HTTP at all: a 400 (or nothing, when they never end a
        request head and the client closes), never a 500."""
        count(f"wire:{name}")
        answer = exchange(servers.ports[name], line + b"\r\n\r\n")
        if answer:
            assert status_of(answer) < 500, f"{name}: {answer[:200]!r} to {line!r}"

    def test_still_serving_afterwards(self, servers: Servers) -> None:
        """After all of the above, each server answers a good request normally."""
        body = span_request([b"\x01" * 8]).SerializeToString()
        ok = exchange(servers.ports["otlp"], request(
            "POST", "/v1/traces", [("Content-Type", "application/x-protobuf")], body))
        assert status_of(ok) == 200
        health = exchange(servers.ports["admin"], request("GET", "/health", [], b""))
        assert status_of(health) == 200
        for body, status in ((b"x 1", 200), (b"x", 400)):  # folded text, then not
            pyro = exchange(servers.ports["pyroscope"], request(
                "POST", "/ingest?name=app.cpu", [], body))
            assert status_of(pyro) == status

"""Pyroscope's query API (admin/querier.py), fed hostile input: its label selector and
profile type parsers on random and near-valid text, its request decoder on random and
mutated protobuf and JSON bodies, and the whole endpoint on the wire against a real
embedded ClickHouse holding a few samples, with requests whose every field is hostile
(selectors, regular expressions RE2 refuses, ids, ranges, steps, node counts).
Property: a value or ``Invalid`` / a Connect error from the parsers, never another
exception; on the wire an answer below 500 (a Connect error naming the field), and the
server keeps answering.

Counted in ``support.INPUTS`` (``querier:*``, ``wire:querier``); ``make fuzz`` runs the
long profile.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.admin import querier, querier_selector
from pipeline.admin.querier_messages import M
from pipeline.records import ProfileBatch, Sample, Stack
from tests.fuzz.support import FUZZ, count
from tests.fuzz.test_endpoints import Servers, exchange, request, status_of

NOW_MS = int(time.time() * 1000)
CPU = "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
RPCS = ["ProfileTypes", "LabelNames", "LabelValues", "Series", "SelectMergeStacktraces",
        "SelectMergeSpanProfile", "SelectSeries", "SelectHeatmap", "Diff", "Nope"]

NAMES = st.one_of(st.sampled_from([*querier_selector.LABELS, "pod", "", "a-b", "__x__"]),
                  st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True))
VALUES = st.one_of(
    st.sampled_from(["", "shop", "a|b", ".*", "(", "(?=a)", "(?i)a", "a{1000}", "a{99}{99}",
                     "(a{100}){100}", "\\p{Greek}", "[[:alpha:]]", "\\C", "a**", "x{2,1}",
                     "\\", "\\1", "[z-a]", "(?P<n>a)", "\\Q.\\E", "a++", "\\Z", "\ud800",
                     "\x00", "é" * 600, "\\u00e9", "\\x41", '\\"']),
    st.text(max_size=30))
OPS = st.sampled_from(["=", "!=", "=~", "!~", "==", "~", ""])
QUOTES = st.sampled_from(['"', "'", "`", ""])


@st.composite
def selectors(draw: Any) -> str:
    """Near-valid selectors: matchers of known and unknown labels, every operator and
    hostile values, in any quotes, sometimes with a name before the braces; or any text."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.one_of(st.text(max_size=60), st.sampled_from(
            ["{" * 5000, "}", "{,}", "{a=}", CPU + "{}", "other:a:b:a:b", "x{}y",
             '{service_name="a"', "{" + 'service_name="a",' * 40 + "}"])))
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        q = draw(QUOTES)
        parts.append(f"{draw(NAMES)}{draw(OPS)}{q}{draw(VALUES)}{q}")
    sep = draw(st.sampled_from([",", ", ", " ", ",,"]))
    prefix = draw(st.sampled_from(["", "", CPU, "process_cpu", "other:x:y:x:y", "1x"]))
    return prefix + "{" + sep.join(parts) + draw(st.sampled_from(["}", ",}", "", "}}"]))


PROFILE_TYPES = st.one_of(
    st.sampled_from([CPU, "wall:wall:nanoseconds:wall:nanoseconds", "other:alloc:bytes:alloc:"
                     "bytes", "memory:alloc_space:bytes:space:bytes", "", ":::::", "a" * 700,
                     "other:\x00:b:\x00:b", "other:é:b:é:b"]),
    st.text(max_size=40))
INTS = st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), NOW_MS, NOW_MS - 3_600_000,
                                  NOW_MS + 10**12, (2**32) * 1000, 100_001, 8192]),
                 st.integers(-(2**63), 2**63 - 1))
IDS = st.lists(st.one_of(st.binary(min_size=8, max_size=8).map(bytes.hex),
                         st.binary(min_size=16, max_size=16).map(bytes.hex),
                         st.sampled_from(["", "zz" * 8, "AB" * 8, "0" * 17])), max_size=4)


def _utf8(s: str) -> str:
    """What a protobuf string field holds (lone surrogates go over the wire as JSON
    escapes instead: see wire_requests)."""
    return s.encode("utf-8", "replace").decode()


@st.composite
def messages(draw: Any) -> tuple[str, Any]:
    """A request message of a random RPC, every field hostile."""
    rpc = draw(st.sampled_from(RPCS[:7]))
    sel_ = draw(selectors().map(_utf8))
    rng = {"start": draw(INTS), "end": draw(INTS)}
    if rpc == "ProfileTypes":
        msg = M["ProfileTypesRequest"](**rng)
    elif rpc in ("LabelNames", "Series"):
        msg = M[f"{rpc}Request"](matchers=draw(st.lists(selectors().map(_utf8), max_size=3)),
                                 **rng)
        if rpc == "Series":
            msg.label_names.extend(draw(st.lists(NAMES, max_size=4)))
    elif rpc == "LabelValues":
        msg = M["LabelValuesRequest"](name=draw(NAMES), matchers=[sel_], **rng)
    elif rpc == "SelectSeries":
        msg = M["SelectSeriesRequest"](
            profile_typeID=_utf8(draw(PROFILE_TYPES)), label_selector=sel_,
            group_by=draw(st.lists(NAMES, max_size=3)), limit=draw(INTS),
            step=draw(st.one_of(st.floats(), st.sampled_from([60.0, 0.001, 1e300]))),
            aggregation=draw(st.integers(0, 3)), exemplar_type=draw(st.integers(0, 5)), **rng)
    else:
        msg = M[f"{rpc}Request"](profile_typeID=_utf8(draw(PROFILE_TYPES)), label_selector=sel_,
                                 span_selector=draw(IDS), max_nodes=draw(INTS),
                                 format=draw(st.integers(0, 6)), **rng)
        if rpc == "SelectMergeStacktraces":
            msg.trace_id_selector.extend(draw(IDS))
            if draw(st.booleans()):
                msg.stack_trace_selector.call_site.add(name="main")
    return rpc, msg


class TestParsers:
    @FUZZ
    @given(text=st.one_of(selectors(), st.text(max_size=200)))
    def test_selector(self, text: str) -> None:
        """A selector is matchers (each of a known label, its regex checked) whose SQL
        builds, or ``Invalid`` naming the field."""
        count("querier:selector")
        try:
            got = querier_selector.parse_selector(text)
        except querier_selector.Invalid as err:
            assert str(err).startswith("label_selector: ")
            return
        assert len(got) <= querier_selector.MAX_MATCHERS + 1
        assert all(m.name in querier_selector.LABELS for m in got)
        querier_selector.where(got, {}, "m")

    @FUZZ
    @given(text=PROFILE_TYPES)
    def test_profile_type(self, text: str) -> None:
        count("querier:profile_type")
        try:
            t = querier_selector.parse_type(text)
        except querier_selector.Invalid as err:
            assert str(err).startswith("profile_typeID: ")
            return
        assert t.id == text

    @FUZZ
    @given(rpc_msg=messages(), codec=st.sampled_from(["proto", "json"]),
           cut=st.integers(0, 400), junk=st.binary(max_size=40))
    def test_request_decoder(self, rpc_msg: tuple[str, Any], codec: str, cut: int,
                             junk: bytes) -> None:
        """A body, whole, cut or with bytes spliced in, decodes to its message or is a
        Connect ``invalid_argument``."""
        count("querier:decode")
        rpc, msg = rpc_msg
        body = msg.SerializeToString() if codec == "proto" else \
            json_format.MessageToJson(msg).encode()
        for data in (body, body[:cut] + junk + body[cut:], body[:cut]):
            try:
                querier._decode(type(msg)(), data, codec)
            except querier.ConnectError as err:
                assert err.code == "invalid_argument"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The apps of test_endpoints, with a few samples stored: queries read real rows."""
    s = Servers(tmp_path_factory.mktemp("fuzz-querier") / "ch")
    s.start()
    t = (NOW_MS - 600_000) * 1_000_000
    samples = [Sample(b"\x01" * 16, b"\x02" * 8, svc, t, 1, "cpu", 10**7, 1, "cpu",
                      "nanoseconds", thread_name="main", host="h") for svc in ("shop", "db")]
    s.run(s.clickhouse.consume(ProfileBatch(
        samples, {1: Stack(1, ["leaf", "main"], [], [])})))
    yield s
    s.stop()


@st.composite
def wire_requests(draw: Any) -> bytes:
    rpc, msg = draw(messages())
    if draw(st.integers(0, 3)):  # mostly within the samples' range: queries reach rows
        msg.start, msg.end = NOW_MS - 3_600_000, NOW_MS
    path = "/querier.v1.QuerierService/" + draw(st.one_of(st.just(rpc), st.sampled_from(RPCS)))
    codec = draw(st.sampled_from(["application/proto", "application/json",
                                  "application/json; charset=utf-8", "text/plain", ""]))
    body = json_format.MessageToJson(msg).encode() if "json" in codec else \
        msg.SerializeToString()
    body = draw(st.one_of(st.just(body), st.binary(max_size=200), st.just(b"[" * 100_000),
                          st.sampled_from([json.dumps(d).encode() for d in (
                              {"start": "x"}, {"labelSelector": '{service_name="\ud800"}'},
                              {"matchers": ["{}"] * 40}, {"name": "\x00"}, [],
                              {"step": "NaN"}, {"maxNodes": "1e99"})])))
    headers = [("Content-Type", codec)]
    if draw(st.booleans()):
        headers.append(("Content-Encoding", "gzip"))
        body = draw(st.sampled_from([gzip.compress(body), body, gzip.compress(body)[:10]]))
    if draw(st.integers(0, 5)) == 0:
        headers.append(("Connect-Protocol-Version", draw(st.sampled_from(["1", "2", ""]))))
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET"]))
    return request(method, path, headers, body, chunked=draw(st.booleans()))


WIRE = settings(FUZZ, deadline=None)  # a query on the embedded engine can take a while


class TestWire:
    @WIRE
    @given(raw=wire_requests())
    def test_never_500(self, servers: Servers, raw: bytes) -> None:
        """Every request is answered below 500; a Connect error is JSON with a code."""
        count("wire:querier")
        answer = exchange(servers.ports["admin"], raw)
        status = status_of(answer)
        assert status < 500 or status == 501, f"{status} to {raw[:400]!r}:\n{answer[-400:]!r}"
        head, _, body = answer.partition(b"\r\n\r\n")
        if status != 200 and b"application/json" in head and b"/querier.v1." in raw[:100]:
            if b"Transfer-Encoding: chunked" not in head:
                assert "code" in json.loads(body), body[:200]

    def test_still_answering_afterwards(self, servers: Servers) -> None:
        body = M["SelectMergeStacktracesRequest"](
            profile_typeID=CPU, label_selector='{service_name=~"sh.p"}',
            start=NOW_MS - 3_600_000, end=NOW_MS).SerializeToString()
        answer = exchange(servers.ports["admin"], request(
            "POST", "/querier.v1.QuerierService/SelectMergeStacktraces",
            [("Content-Type", "application/proto")], body))
        assert status_of(answer) == 200
        got = M["SelectMergeStacktracesResponse"].FromString(answer.partition(b"\r\n\r\n")[2])
        assert got.flamegraph.total == 10**7 and list(got.flamegraph.names) == [
            "total", "main", "leaf"]

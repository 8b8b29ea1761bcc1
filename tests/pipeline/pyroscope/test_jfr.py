"""The JFR parser on what the Pyroscope Java agent really sent (tests/testdata/jfr, made by
tests/clients/java/capture.py), on recordings written by ``jfrbuild``, and its limits."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from collections import Counter
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import InvalidData, TooLarge
from pipeline.pyroscope import jfr
from pipeline.pyroscope.jfrlabels import LabelsSnapshot, parse_labels
from pipeline.pyroscope.jfrpools import Frame, JfrThread
from pipeline.pyroscope.jfrsamples import JfrSample
from pipeline.pyroscope.jfrwire import JfrError, JfrTooLarge, Limits
from tests.pipeline.pyroscope import jfrbuild as B

DATA = Path(__file__).resolve().parents[2] / "testdata" / "jfr"
ITIMER, WALL = ("itimer-1", "itimer-2"), ("wall-1", "wall-2")
HOT = "spanprof.capture.App.spin"


@cache
def raw(name: str) -> tuple[bytes, bytes]:
    """(recording, labels) of one captured upload, inflated."""
    return (gzip.decompress((DATA / f"{name}.jfr.gz").read_bytes()),
            gzip.decompress((DATA / f"{name}.labels.gz").read_bytes()))


@cache
def captured(name: str) -> jfr.Recording:
    rec, labels = raw(name)
    return jfr.parse(rec, parse_labels(labels))


@cache
def spans(scenario: str) -> dict[str, dict[str, Any]]:
    """The root spans the app made during the captured uploads, by span id."""
    return {s["span_id"]: s for s in json.loads((DATA / "spans.json").read_text())[scenario]}


def by(rec: jfr.Recording, measure: str) -> list[JfrSample]:
    return [s for s in rec.samples if s.measure == measure]


class TestCaptured:
    """Uploads of io.pyroscope:agent 2.9.2 (async-profiler 4.5.0.0, Grafana's fork) with
    the OpenTelemetry Java agent 2.33.1 and io.pyroscope:otel 1.0.2."""

    # event counts as the JDK's own `jfr summary` reports them for these files
    COUNTS = {
        "itimer-1": {"jdk.ExecutionSample": 286, "jdk.ObjectAllocationInNewTLAB": 210,
                     "jdk.JavaMonitorEnter": 27, "jdk.ThreadPark": 20, "jdk.ActiveSetting": 28,
                     "jdk.NativeLibrary": 25, "jdk.InitialSystemProperty": 17},
        "itimer-2": {"jdk.ExecutionSample": 272, "jdk.ObjectAllocationInNewTLAB": 210,
                     "jdk.JavaMonitorEnter": 17, "jdk.ThreadPark": 16},
        "wall-1": {"profiler.WallClockSample": 1606, "jdk.ActiveSetting": 25},
        "wall-2": {"profiler.WallClockSample": 1532},
    }

    @pytest.mark.parametrize("name", sorted(COUNTS))
    def test_event_counts(self, name: str) -> None:
        """Every event is found and named from the metadata: the counts the JDK's jfr
        tool gives."""
        counts = captured(name).event_counts
        for event, n in self.COUNTS[name].items():
            assert counts[event] == n, event

    @pytest.mark.parametrize("name", ITIMER + WALL)
    def test_samples_per_event(self, name: str) -> None:
        """One sample per measure of each mapped event; no CPU sample skipped (itimer
        samples running threads only)."""
        rec = captured(name)
        got = Counter((s.event, s.measure) for s in rec.samples)
        c = rec.event_counts
        if name in ITIMER:
            assert got == {
                ("jdk.ExecutionSample", "cpu"): c["jdk.ExecutionSample"],
                ("jdk.ObjectAllocationInNewTLAB", "alloc_objects"):
                    c["jdk.ObjectAllocationInNewTLAB"],
                ("jdk.ObjectAllocationInNewTLAB", "alloc_bytes"):
                    c["jdk.ObjectAllocationInNewTLAB"],
                ("jdk.JavaMonitorEnter", "lock_count"): c["jdk.JavaMonitorEnter"],
                ("jdk.JavaMonitorEnter", "lock_ns"): c["jdk.JavaMonitorEnter"],
                ("jdk.ThreadPark", "lock_count"): c["jdk.ThreadPark"],
                ("jdk.ThreadPark", "lock_ns"): c["jdk.ThreadPark"]}
            assert rec.settings["event"] == "itimer"
        else:
            assert got == {("profiler.WallClockSample", "wall"): c["profiler.WallClockSample"]}
            assert rec.settings["event"] == "wall"
        assert rec.skipped == 0

    @pytest.mark.parametrize("name", ITIMER)
    def test_cpu_stacks(self, name: str) -> None:
        """Most CPU samples have the app's busy method on top, called from the worker; each
        is worth the 10 ms interval the recording's settings give."""
        cpu = by(captured(name), "cpu")
        on_top = [s for s in cpu if s.stack and s.stack[0].function == HOT]
        assert len(on_top) > 0.8 * len(cpu)
        assert {s.thread.name for s in on_top if s.thread} == {"cpu-worker"}
        for s in on_top:
            assert s.stack[0].line > 0 and s.stack[0].file == ""
            assert "spanprof.capture.App.cpuWorker" in [f.function for f in s.stack]
        assert {s.value for s in cpu} == {10_000_000}

    @pytest.mark.parametrize("name", ITIMER + WALL)
    def test_threads_and_times(self, name: str) -> None:
        """Thread ids are the OS's and Java's; every time is within the recording."""
        rec = captured(name)
        assert 2.5e9 < rec.end_ns - rec.start_ns < 3.5e9
        for s in rec.samples:
            assert rec.start_ns <= s.time_ns <= rec.end_ns
            assert s.thread is not None and s.thread.os_id > 0 and s.thread.name
        app = {s.thread for s in rec.samples if s.thread and s.thread.name in (
            "cpu-worker", "allocator", "lock-a", "lock-b", "sleeper")}
        assert all(t.java_id > 0 for t in app)
        assert len({t.os_id for t in app}) == len({t.name for t in app})

    @pytest.mark.parametrize("name", ITIMER + WALL)
    def test_span_labels(self, name: str) -> None:
        """A sample labelled with a span id was taken on the span's thread while the span
        ran, and carries its name and trace id; samples of the worker inside its spans are
        all labelled."""
        rec, known = captured(name), spans(name.split("-")[0])
        labelled = [s for s in rec.samples if "span_id" in s.labels]
        assert len(labelled) > 0.5 * len(rec.samples) if name in ITIMER else 0.3
        for s in labelled:
            span = known[s.labels["span_id"]]
            assert s.labels["span_name"] == span["name"]
            assert s.labels["trace_id"] == span["trace_id"]
            assert s.thread is not None and s.thread.name == span["thread"]
            assert span["start"] - 20e6 <= s.time_ns <= span["end"] + 20e6
        checkout = [sp for sp in known.values() if sp["name"] == "checkout"]
        inside = [s for s in rec.samples if s.thread and s.thread.name == "cpu-worker"
                  and any(sp["start"] + 5e6 < s.time_ns < sp["end"] - 5e6 for sp in checkout)]
        assert len(inside) > 100
        assert all(s.labels.get("span_name") == "checkout" for s in inside)

    @pytest.mark.parametrize("name", ITIMER + WALL)
    def test_context_labels(self, name: str) -> None:
        """Samples taken under the app's Pyroscope label context carry its label."""
        ctx = [s for s in captured(name).samples if "order_type" in s.labels]
        assert ctx and all(s.labels["order_type"] == "express" for s in ctx)
        assert all(s.thread and s.thread.name == "cpu-worker" for s in ctx)
        assert all("span_id" not in s.labels for s in ctx)  # outside the root spans

    @pytest.mark.parametrize("name", ITIMER + WALL)
    def test_labels_snapshot(self, name: str) -> None:
        """The snapshot's strings hold the span names; its contexts the label context."""
        snap = parse_labels(raw(name)[1])
        assert {"checkout", "batch", "contend", "sleepy"} <= set(snap.strings.values())
        assert snap.contexts and all(c == {"order_type": "express"}
                                     for c in snap.contexts.values())

    @pytest.mark.parametrize("name", ITIMER)
    def test_alloc_and_lock(self, name: str) -> None:
        """Allocation samples weigh about the 1 MiB sampling interval, in the app's churn;
        lock waits (monitors and parks) are in the contending spans, their durations as
        the JDK reads them."""
        rec = captured(name)
        assert rec.settings["alloc"] == "1048576" and rec.settings["lock"] == "1000000"
        alloc = [s for s in by(rec, "alloc_bytes") if s.thread and s.thread.name == "allocator"]
        assert len(alloc) > 100 and all(s.value > 0 for s in alloc)
        assert 0.3 < sum(s.value for s in alloc) / len(alloc) / 2**20 < 3
        churn = [s for s in alloc if s.stack[0].function == "spanprof.capture.App.churn"]
        assert len(churn) > 0.9 * len(alloc)
        assert all(s.labels.get("span_name") == "batch" for s in churn)
        assert {s.value for s in by(rec, "alloc_objects")} == {1}
        waits = [s for s in by(rec, "lock_ns") if s.thread and s.thread.name.startswith("lock")]
        assert waits and all(0 < s.value < 1_000_000_000 for s in waits)
        monitor = [s for s in waits if s.event == "jdk.JavaMonitorEnter"]
        assert monitor and all(s.labels.get("span_name") == "contend" for s in monitor)
        assert sum(s.value for s in waits) > 20_000_000
        assert all(any(f.function == "spanprof.capture.App.holdMonitor" for f in s.stack)
                   for s in monitor)
        park = [s for s in waits if s.event == "jdk.ThreadPark"]
        assert park and all(s.stack[0].function == "jdk.internal.misc.Unsafe.park"
                            for s in park)

    @pytest.mark.parametrize("name", WALL)
    def test_wall(self, name: str) -> None:
        """Wall samples are worth interval x samples; the sleeper is seen sleeping."""
        rec = captured(name)
        wall = by(rec, "wall")
        assert all(s.value % 10_000_000 == 0 and s.value > 0 for s in wall)
        sleeper = [s for s in wall if s.thread and s.thread.name == "sleeper"
                   and "span_id" in s.labels]
        assert sleeper and all(s.state == "STATE_SLEEPING" for s in sleeper)
        assert all(s.labels["span_name"] == "sleepy" for s in sleeper)
        assert all("java.lang.Thread.sleep" in [f.function for f in s.stack] for s in sleeper)
        assert all(s.stack[0].file == "libc.so.6" for s in sleeper)  # native frames first
        native = [f for s in wall for f in s.stack if f.file.endswith(".so")]
        assert native and all(f.line == 0 for f in native)

    def test_shared_objects(self) -> None:
        """Samples of one stack trace share its tuple; of one context, its labels."""
        rec = captured("itimer-1")
        assert len({id(s.stack) for s in rec.samples}) < len(rec.samples) / 2
        assert len({id(s.labels) for s in rec.samples}) < len(rec.samples) / 4

    @pytest.mark.skipif(shutil.which("jfr") is None, reason="needs the JDK's jfr tool")
    @pytest.mark.parametrize("name", ["itimer-1", "wall-1"])
    def test_as_the_jdk_reads_it(self, name: str, tmp_path: Path) -> None:
        """Every sample event as the JDK's ``jfr print --json`` reads it: time, thread,
        every frame (method, line), span id, lock duration."""
        path = tmp_path / "rec.jfr"
        path.write_bytes(raw(name)[0])
        types = sorted({s.event for s in captured(name).samples})
        out = subprocess.run(["jfr", "print", "--json", "--stack-depth", "4096", "--events",
                              ",".join(types), str(path)], capture_output=True, check=True)
        theirs: Counter[tuple[Any, ...]] = Counter()
        for e in json.loads(out.stdout)["recording"]["events"]:
            v = e["values"]
            thread = v.get("sampledThread") or v.get("eventThread")
            frames = tuple((f["method"]["type"]["name"].replace("/", "."), f["method"]["name"],
                            f["lineNumber"]) for f in v["stackTrace"]["frames"])
            theirs[(e["type"], _iso_ns(v["startTime"]) // 1000, thread["osThreadId"],
                    thread.get("javaThreadId") or 0, frames, v.get("spanId", 0))] += 1
        ours: Counter[tuple[Any, ...]] = Counter()
        for s in captured(name).samples:
            if s.measure not in ("cpu", "wall", "alloc_bytes", "lock_ns"):
                continue
            frames = tuple(("", "", f.line) if f.file else
                           (*f.function.rsplit(".", 1), f.line)  # type: ignore[misc]
                           for f in s.stack)
            span = int(s.labels.get("span_id", "0"), 16)
            ours[(s.event, s.time_ns // 1000, s.thread.os_id if s.thread else 0,
                  s.thread.java_id if s.thread else 0, frames,
                  span - (1 << 64) if span >= 1 << 63 else span)] += 1
        native = {k for k in theirs if any(not f[0] or f[0].endswith(".so") or "::" in f[1]
                                           for f in k[4])}
        # native frames: the JDK prints library and symbol, this parser symbol and library
        theirs_java = Counter({k: n for k, n in theirs.items() if k not in native})
        ours_java = Counter({k: n for k, n in ours.items() if not any(f[0] == "" for f in k[4])})
        assert sum(theirs.values()) == sum(ours.values())
        assert ours_java == theirs_java


def _iso_ns(text: str) -> int:
    """``2026-12-05T08:46:44.805988653Z`` -> Unix ns."""
    head, _, frac = text.rstrip("Z").partition(".")
    secs = int(datetime.fromisoformat(head + "+00:00").timestamp())
    return secs * 10**9 + int((frac + "000000000")[:9])


class TestBuilt:
    """Recordings written by jfrbuild: each part of the format on its own."""

    def test_minimal(self) -> None:
        """A sample: time from ticks, thread, stack leaf first (a Java and a native
        frame), state, interval from the settings, span labels from the snapshot."""
        snap = LabelsSnapshot({7: {"k": "v"}}, {3: "checkout"})
        data = B.recording([B.setting("interval", "20000000"),
                            B.sample(spans=(0xABCDEF, 3, 7, 0x0102, 0x0304)),
                            B.sample(stack=2, thread=2, ticks=B.START_TICKS + 5)])
        rec = jfr.parse(data, snap)
        a, b = rec.samples
        assert a == JfrSample(
            "jdk.ExecutionSample", "cpu", 20_000_000, B.START_NS + 1000,
            JfrThread(1234, 25, "worker"),
            (Frame("app.Main.spin", "", 42), Frame("app.Main.run", "", 10),
             Frame("app.Main.run", "", 11)),
            {"k": "v", "span_id": "0000000000abcdef", "span_name": "checkout",
             "trace_id": "0000000000000102" "0000000000000304"}, "STATE_RUNNABLE")
        assert b.stack == (Frame("os::malloc", "libjvm.so", 0),)
        assert b.thread == JfrThread(1235, 0, "GC Thread#0") and b.labels == {}
        assert b.time_ns == B.START_NS + 5
        assert rec.start_ns == B.START_NS and rec.end_ns == B.START_NS + 3 * 10**9

    def test_interval_default(self) -> None:
        """Without an interval setting, the caller's interval (the request's rate)."""
        rec = jfr.parse(B.recording([B.sample()]), interval_ns=5_000_000)
        assert rec.samples[0].value == 5_000_000

    def test_sleeping_is_not_cpu(self) -> None:
        """A CPU sample of a sleeping thread is skipped and counted."""
        rec = jfr.parse(B.recording([B.sample(state=2), B.sample()]))
        assert len(rec.samples) == 1 and rec.skipped == 1

    def test_wall_mode_execution_samples(self) -> None:
        """Older async-profilers record wall samples as ExecutionSample, event=wall."""
        rec = jfr.parse(B.recording([B.setting("event", "wall"), B.sample(state=2)]))
        assert [(s.measure, s.state) for s in rec.samples] == [("wall", "STATE_SLEEPING")]

    def test_wall_clock_samples(self) -> None:
        rec = jfr.parse(B.recording([B.setting("interval", "1000000"),
                                     B.sample(B.WALL, extra=(3, 20))]))
        assert [(s.measure, s.value) for s in rec.samples] == [("wall", 3_000_000)]

    def test_alloc_and_lock_values(self) -> None:
        """Alloc bytes from tlabSize; lock duration in ticks -> ns (1 tick = 2 ns here)."""
        spans = b"".join(B.var(0) for _ in range(5))
        alloc = B.event(B.ALLOC_IN_TLAB, B.var(B.START_TICKS) + B.var(1) + B.var(1)
                        + B.var(1) + B.var(48) + B.var(524288) + spans)
        lock = B.event(B.MONITOR_ENTER, B.var(B.START_TICKS + 10) + B.var(1500) + B.var(1)
                       + B.var(1) + B.var(1) + B.var(0) + B.var(0xFFFF) + spans)
        rec = jfr.parse(B.recording([alloc, lock], tps=500_000_000))
        assert [(s.measure, s.value) for s in rec.samples] == [
            ("alloc_objects", 1), ("alloc_bytes", 524288), ("lock_count", 1),
            ("lock_ns", 3000)]
        assert rec.samples[2].time_ns == B.START_NS + 20

    def test_string_encodings(self) -> None:
        """Null, empty, pool reference, UTF-8, Latin-1 and UTF-16 char arrays (a lone
        surrogate is replaced, not kept)."""
        names = [B.utf8(None), B.utf8(""), B.pool_ref(1), B.utf8("ünï"), B.latin1("é"),
                 B.chars([0x65E5, 0x672C, 0xD800])]
        pools = B.standard_pools()
        pools[2] = (B.THREAD, [(i + 1, n + B.var(10 + i) + B.utf8(None) + B.var(0))
                               for i, n in enumerate(names)])
        rec = jfr.parse(B.recording([B.sample(thread=i + 1) for i in range(6)], pools=pools))
        assert [s.thread.name for s in rec.samples if s.thread] == [
            "", "", "pooled string", "ünï", "é", "日本\ufffd"]

    def test_padded_sizes_and_two_chunks(self) -> None:
        """Sizes written as 5-byte varints; a recording of two chunks, each with its own
        metadata and pools."""
        one = B.recording([B.event(B.EXECUTION_SAMPLE, B.sample()[2:], pad=True)])
        two = B.recording([B.sample(), B.sample()], start_ns=B.START_NS + 10**9)
        rec = jfr.parse(one + two)
        assert len(rec.samples) == 3 and rec.event_counts["jdk.ExecutionSample"] == 3
        assert rec.end_ns == B.START_NS + 10**9 + 3 * 10**9

    def test_unknown_and_reshaped(self) -> None:
        """Events of types it does not map are counted and skipped; a field declared with
        another type than expected is ignored, not misread."""
        types = B.standard_types(span_fields=False)
        types = [c if c.name != "jdk.ExecutionSample" else c._replace(fields=[
            *c.fields[:2], B.F("stackTrace", B.LONG), c.fields[3]]) for c in types]
        other = B.event(B.UNKNOWN_EVENT, B.var(1) + B.utf8("x"))
        rec = jfr.parse(B.recording([other, B.sample(), B.event(999, b"")], types=types))
        assert rec.samples[0].stack == () and rec.samples[0].labels == {}
        assert rec.event_counts["vendor.SomethingElse"] == 1
        assert rec.event_counts["(type 999, not in the metadata)"] == 1

    def test_errors_are_one_type(self) -> None:
        """JfrError is the pipeline's InvalidData (a 400) and a ValueError; over a limit,
        JfrTooLarge is also TooLarge (a 413)."""
        assert issubclass(JfrError, InvalidData) and issubclass(JfrError, ValueError)
        assert issubclass(JfrTooLarge, JfrError) and issubclass(JfrTooLarge, TooLarge)


class TestRefused:
    """What is wrong is named, with its byte offset."""

    @pytest.mark.parametrize(("data", "message"), [
        (b"", "0 bytes, fewer than a chunk header"),
        (gzip.compress(b"x" * 100, mtime=0), "gzip-compressed: inflate it first"),
        (b"FLX\0" + bytes(64), "no chunk magic FLR\\0 at byte 0"),
        (B.recording(version=1), "chunk version 1.x at byte 0"),
        (B.recording(features=0), "fixed-size integers"),
        (B.recording(tps=0), "0 ticks per second"),
        (B.chunk([B.sample()]), "has no metadata event"),
        (B.recording()[:-3], "says it has"),
    ])
    def test_broken(self, data: bytes, message: str) -> None:
        with pytest.raises(JfrError, match=message.replace("\\", "\\\\")):
            jfr.parse(data)

    def test_truncated_chunk_body(self) -> None:
        data = bytearray(B.recording([B.sample()]))
        data[8:16] = (len(data) - 2).to_bytes(8, "big")
        with pytest.raises(JfrError, match=r"the event at byte \d+ has size \d+"):
            jfr.parse(bytes(data[:-2]))

    def test_event_past_its_size(self) -> None:
        """An event shorter than its fields: refused at its offset."""
        short = B.event(B.EXECUTION_SAMPLE, B.var(B.START_TICKS))
        data = B.recording([short])
        at = data.index(short)
        with pytest.raises(JfrError, match=f"the event at byte {at + 2} runs past its size"):
            jfr.parse(data)

    def test_missing_references(self) -> None:
        with pytest.raises(JfrError, match="refers to stack trace 9, in no pool"):
            jfr.parse(B.recording([B.sample(stack=9)]))
        with pytest.raises(JfrError, match="refers to thread 9, in no pool"):
            jfr.parse(B.recording([B.sample(thread=9)]))

    def test_self_containing_type(self) -> None:
        """A type written inline inside itself would never end."""
        types = [*B.standard_types(), B.C(300, "loop", [B.F("again", 300)])]
        pools = [*B.standard_pools(), (300, [(1, b"\x00")])]
        with pytest.raises(JfrError, match="contains itself"):
            jfr.parse(B.recording(types=types, pools=pools))

    def test_values_of_no_bytes(self) -> None:
        """A field of a type with no fields takes no bytes: a pool of such values would
        cost work without input, so the metadata is refused."""
        wide = [B.F(f"e{i}", 300) for i in range(1000)] + [B.F("n", B.LONG)]
        types = [*B.standard_types(), B.C(300, "empty"), B.C(301, "wide", wide)]
        pools = [*B.standard_pools(), (301, [(k, B.var(5)) for k in range(1, 100)])]
        with pytest.raises(JfrError, match="'e0' of type 'wide' is of a type with no fields"):
            jfr.parse(B.recording(types=types, pools=pools))

    def test_huge_counts(self) -> None:
        """Counts larger than the bytes left are refused before anything is allocated."""
        pools = [(B.STACK_TRACE, [(1, b"\x00" + B.var(2**62))])]
        with pytest.raises(JfrError, match="an array of 4611686018427387904 values"):
            jfr.parse(B.recording(pools=pools))
        data = B.chunk([B.metadata(B.standard_types()),
                        B.event(1, B.var(0) * 3 + b"\x01" + B.var(1) + B.var(B.THREAD)
                                + B.var(10**12))])
        with pytest.raises(JfrError, match="a pool of 1000000000000 entries"):
            jfr.parse(data)

    def test_bad_string(self) -> None:
        pools = B.standard_pools()
        pools[2] = (B.THREAD, [(1, b"\x07")])
        with pytest.raises(JfrError, match="unknown string encoding 7"):
            jfr.parse(B.recording(pools=pools))


class TestLimits:
    """Each limit is checked, named in the message, before what it bounds is built."""

    @pytest.mark.parametrize(("limits", "key"), [
        (Limits(max_events=3), "max_events=3"),
        (Limits(max_stack_depth=2), "max_stack_depth=2"),
        (Limits(max_frames=5), "max_frames=5"),
        (Limits(max_pool_entries=10), "max_pool_entries=10"),
        (Limits(max_string_bytes=100), "max_string_bytes=100"),
        (Limits(max_chunks=1), "max_chunks=1"),
        (Limits(max_metadata_elements=50), "max_metadata_elements=50"),
    ])
    def test_over(self, limits: Limits, key: str) -> None:
        data = B.recording([B.sample() for _ in range(3)]) * 2
        with pytest.raises(JfrTooLarge, match=key):
            jfr.parse(data, limits=limits)
        jfr.parse(data)

    def test_labels_limit(self) -> None:
        with pytest.raises(JfrTooLarge, match="max_labels=3"):
            parse_labels(raw("itimer-1")[1], Limits(max_labels=3))


def _pb(field: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return B.var(field << 3) + _pbv(payload)
    return B.var(field << 3 | 2) + _pbv(len(payload)) + payload


def _pbv(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


class TestLabels:
    def test_snapshot(self) -> None:
        """Maps of contexts and strings; unknown fields skipped; negative ids as int64."""
        ctx = _pb(1, _pb(1, 5) + _pb(2, 6))
        data = (_pb(1, _pb(1, 12) + _pb(2, ctx)) + _pb(2, _pb(1, 5) + _pb(2, b"k"))
                + _pb(2, _pb(1, 6) + _pb(2, b"v")) + _pb(2, _pb(1, -1) + _pb(2, b"neg"))
                + _pb(9, 77) + _pb(10, b"skipped"))
        snap = parse_labels(data)
        assert snap.contexts == {12: {"k": "v"}} and snap.strings[-1] == "neg"

    def test_empty(self) -> None:
        assert parse_labels(b"") == LabelsSnapshot({}, {})

    @pytest.mark.parametrize(("data", "message"), [
        (_pb(1, _pb(1, 12) + _pb(2, _pb(1, _pb(1, 5) + _pb(2, 6)))), "no string 5"),
        (_pb(1, b"x" * 5)[:-1], "a field of 5 bytes at byte 0, 4 left"),
        (b"\x0b", "wire type 3"),
        (b"\x08" + b"\xff" * 11, "more than 10 bytes"),
        (_pb(2, _pb(1, b"str")), "map entry field 1 has wire type 2"),
        (gzip.compress(b"x", mtime=0), "gzip-compressed"),
    ])
    def test_refused(self, data: bytes, message: str) -> None:
        with pytest.raises(JfrError, match=message):
            parse_labels(data)

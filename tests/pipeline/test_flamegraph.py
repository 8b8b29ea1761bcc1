"""The flame graph: tree building, Grafana's nested set, and the SVG's geometry read back."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import pytest

from pipeline.flamegraph import (
    MARGIN,
    MIN_TEXT_WIDTH,
    ROW_HEIGHT,
    TITLE_HEIGHT,
    Frame,
    build,
    nested_set,
    parse_svg_frames,
    render_svg,
)

ROOT = Path(__file__).resolve().parents[2]
NS = "{http://www.w3.org/2000/svg}"
MS = 1_000_000  # ns

# main spends 70% in hot (its own 60 ms plus 10 ms in leaf), 20% in cold, 10% in itself.
STACKS: list[tuple[list[str], int]] = [
    (["main", "hot"], 60 * MS),
    (["main", "hot", "leaf"], 10 * MS),
    (["main", "cold"], 20 * MS),
    (["main"], 10 * MS),
]


def frames_of(svg: str) -> dict[str, ET.Element]:
    """The <g class="frame"> elements by data-name (names are unique in the examples)."""
    root = ET.fromstring(svg)
    return {g.attrib["data-name"]: g for g in root.iter(f"{NS}g")
            if g.get("class") == "frame"}


class TestBuild:
    def test_merges_identical_paths_and_totals(self) -> None:
        """Equal paths add up; the root is "all" holding the total; self is leaf time."""
        root = build([(["a", "b"], 3), (["a", "b"], 4), (["a", "c"], 5), (["d"], 1)])
        assert root.name == "all"
        assert root.value == 13
        assert root.self_value == 0
        assert sorted(root.children) == ["a", "d"]
        a = root.children["a"]
        assert (a.value, a.self_value) == (12, 0)
        assert (a.children["b"].value, a.children["b"].self_value) == (7, 7)
        assert (a.children["c"].value, a.children["c"].self_value) == (5, 5)
        assert root.children["d"] == Frame("d", 1, 1, {})

    def test_same_name_under_different_parents_is_two_frames(self) -> None:
        """A frame is a path, not a function: f under a and f under b stay apart."""
        root = build([(["a", "f"], 2), (["b", "f"], 3)])
        assert root.children["a"].children["f"].value == 2
        assert root.children["b"].children["f"].value == 3

    def test_skips_zero_and_negative_values(self) -> None:
        """Values <= 0 add nothing and create no frames."""
        root = build([(["a"], 5), (["a", "ghost"], 0), (["neg"], -7), (["a", "b"], -1)])
        assert root.value == 5
        assert list(root.children) == ["a"]
        assert root.children["a"].children == {}
        assert root.children["a"].self_value == 5

    def test_empty_stack_is_root_self_time(self) -> None:
        """An empty stack still counts, as time in the root itself."""
        root = build([([], 4), (["a"], 1)])
        assert (root.value, root.self_value) == (5, 4)

    def test_rejects_a_folded_string(self) -> None:
        """A str is a Sequence[str]; taking "a;b" as frames "a", ";", "b" would be silent."""
        with pytest.raises(TypeError, match="split folded stacks"):
            build([("a;b", 1)])

    def test_repr_is_shallow(self) -> None:
        """The repr shows this frame's state and a child count, not the whole tree."""
        root = build(STACKS)
        assert repr(root) == "Frame(name='all', value=100000000, self_value=0, children=1)"


class TestNestedSet:
    def test_rows_order_levels_and_self(self) -> None:
        """Depth first, children by name, levels from 0 at the root, exclusive self values."""
        rows = nested_set(build(STACKS))
        assert rows == [
            (0, 100 * MS, 0, "all"),
            (1, 100 * MS, 10 * MS, "main"),
            (2, 20 * MS, 20 * MS, "cold"),
            (2, 70 * MS, 60 * MS, "hot"),
            (3, 10 * MS, 10 * MS, "leaf"),
        ]

    def test_children_sorted_whatever_the_insertion_order(self) -> None:
        """Rows follow name order, not the order frames were first seen."""
        rows = nested_set(build([(["b"], 1), (["c"], 2), (["a"], 3)]))
        assert [label for *_, label in rows] == ["all", "a", "b", "c"]

    def test_value_is_self_plus_children(self) -> None:
        """In every row, value = self + the values of the rows one level below it."""
        rows = nested_set(build(STACKS + [(["x", "y", "z"], 9), (["x", "w"], 2)]))
        for i, (_, value, self_, _) in enumerate(rows):
            assert value == self_ + children_value(rows, i)


def children_value(rows: Sequence[tuple[int, int, int, str]], i: int) -> int:
    """In nested-set rows (level, value, self, label), the sum of row ``i``'s children's
    values (the rows one level below it, before the next row at its level or above)."""
    level, total = rows[i][0], 0
    for lv, v, *_ in rows[i + 1:]:
        if lv <= level:
            break
        if lv == level + 1:
            total += v
    return total


class TestRenderSvg:
    def test_parses_as_svg_with_title(self) -> None:
        """The output is well-formed XML, an <svg> root, with the title as text at the top."""
        svg = render_svg(build(STACKS), "CPU of checkout")
        root = ET.fromstring(svg)
        assert root.tag == f"{NS}svg"
        titles = [t for t in root.iter(f"{NS}text") if t.get("class") == "title"]
        assert [t.text for t in titles] == ["CPU of checkout"]
        assert float(titles[0].attrib["y"]) < MARGIN + TITLE_HEIGHT
        assert len(frames_of(svg)) == 5

    def test_each_frame_has_title_rect_and_data(self) -> None:
        """<title> holds name, ms and share; data-value the inclusive value."""
        g = frames_of(render_svg(build(STACKS), "t"))["hot"]
        assert g.attrib["data-value"] == str(70 * MS)
        title = g.find(f"{NS}title")
        assert title is not None
        assert title.text == "hot (70.000 ms, 70.00%)"
        rect = g.find(f"{NS}rect")
        assert rect is not None
        assert {"x", "y", "width", "height"} <= set(rect.attrib)

    def test_hot_function_is_widest_under_root_with_its_share(self) -> None:
        """Under main (the only child of the root), hot is widest; width / drawable width
        equals its share of the total, within 1 px."""
        width = 1200
        svg = render_svg(build(STACKS), "t", width=width)
        frames = parse_svg_frames(svg)
        root_w = next(w for n, lv, _x, w in frames if lv == 0)
        assert root_w == pytest.approx(width - 2 * MARGIN, abs=1)
        level2 = [(w, n) for n, lv, _x, w in frames if lv == 2]
        w_hot, name = max(level2)
        assert name == "hot"
        assert abs(w_hot - 0.70 * (width - 2 * MARGIN)) <= 1
        assert abs(w_hot / root_w - 0.70) * root_w <= 1

    def test_children_left_to_right_by_name_from_parent_x(self) -> None:
        """cold starts at main's x, hot right after it; leaf at hot's x; rows by level."""
        svg = render_svg(build(STACKS), "t")
        f = {n: (lv, x, w) for n, lv, x, w in parse_svg_frames(svg)}
        assert f["main"][1] == pytest.approx(f["all"][1])
        assert f["cold"][1] == pytest.approx(f["main"][1])
        assert f["hot"][1] == pytest.approx(f["cold"][1] + f["cold"][2], abs=0.01)
        assert f["leaf"][1] == pytest.approx(f["hot"][1])
        rects = {n: g.find(f"{NS}rect") for n, g in frames_of(svg).items()}
        for n, (lv, _x, _w) in f.items():
            r = rects[n]
            assert r is not None
            assert float(r.attrib["y"]) == MARGIN + TITLE_HEIGHT + lv * ROW_HEIGHT

    def test_xml_characters_escaped_and_round_trip(self) -> None:
        """& < > " ' in names are escaped (the SVG parses) and come back unchanged."""
        nasty = "std::vector<int>::operator[]&\"x\"'y'"
        other = "<script>alert('x')</script>"
        svg = render_svg(build([(["main", nasty], 5), (["main", other], 5)]), "a<b & 'c'")
        assert "<script>" not in svg
        assert "<int>" not in svg
        names = {n for n, _lv, _x, _w in parse_svg_frames(svg)}
        assert names == {"all", "main", nasty, other}
        g = frames_of(svg)[nasty]
        title = g.find(f"{NS}title")
        assert title is not None and title.text is not None
        assert title.text.startswith(nasty + " (")

    def test_control_characters_do_not_break_the_document(self) -> None:
        """A name with a character XML cannot carry still yields a readable SVG."""
        svg = render_svg(build([(["bad\x00name\x1b"], 1)]), "t")
        names = [n for n, _lv, _x, _w in parse_svg_frames(svg)]
        assert names == ["all", "bad\ufffdname\ufffd"]

    def test_labels_fit_or_are_omitted(self) -> None:
        """A label never runs past its rect; rects under ~20 px have none."""
        long = "a_very_long_function_name_" * 8
        # 400 px drawable for 800: the long name gets 381 px, "tiny" 4 px and "q" 15 px
        # (room for its one character, but under the ~20 px below which labels are noise).
        svg = render_svg(build([([long], 762), (["tiny"], 8), (["q"], 30)]), "t", width=420)
        g = frames_of(svg)
        text = g[long].find(f"{NS}text")
        rect = g[long].find(f"{NS}rect")
        assert text is not None and text.text is not None and rect is not None
        assert text.text.endswith("..") and len(text.text) < len(long)
        assert len(text.text) * 12 * 0.6 <= float(rect.attrib["width"])
        tiny_rect = g["tiny"].find(f"{NS}rect")
        assert tiny_rect is not None
        assert float(tiny_rect.attrib["width"]) < MIN_TEXT_WIDTH
        assert g["tiny"].find(f"{NS}text") is None
        q_rect = g["q"].find(f"{NS}rect")
        assert q_rect is not None
        assert float(q_rect.attrib["width"]) == pytest.approx(15)
        assert g["q"].find(f"{NS}text") is None

    def test_invisible_frames_are_dropped(self) -> None:
        """A frame narrower than 0.1 px is not drawn, nor anything below it."""
        svg = render_svg(build([(["big"], 10**9), (["speck", "under"], 1)]), "t")
        assert [n for n, *_ in parse_svg_frames(svg)] == ["all", "big"]

    def test_deep_stack_renders_every_level(self) -> None:
        """Deeper than the recursion limit: every level is drawn, one frame per level."""
        depth = sys.getrecursionlimit() + 500
        stack = [f"f{i}" for i in range(depth)]
        root = build([(stack, 1000)])
        assert len(nested_set(root)) == depth + 1
        frames = parse_svg_frames(render_svg(root, "deep"))
        assert [lv for _n, lv, _x, _w in frames] == list(range(depth + 1))
        assert [n for n, *_ in frames[1:]] == stack

    def test_deterministic_whatever_the_input_order(self) -> None:
        """Same stacks -> byte-identical SVG, even shuffled; colours are warm and stable."""
        stacks = STACKS + [([f"m{i}", f"n{i % 3}"], i + 1) for i in range(30)]
        first = render_svg(build(stacks), "t")
        shuffled = list(stacks)
        random.Random(7).shuffle(shuffled)
        assert render_svg(build(stacks), "t") == first
        assert render_svg(build(shuffled), "t") == first
        for rect in ET.fromstring(first).iter(f"{NS}rect"):
            fill = rect.attrib["fill"]
            if fill.startswith("rgb("):
                r, g, b = (int(c) for c in fill[4:-1].split(","))
                assert r >= 205 and b <= 55 and r > b

    def test_empty_tree_draws_no_frames(self) -> None:
        """Nothing measured: a valid SVG saying so, with no frames and no division by 0."""
        svg = render_svg(build([(["a"], 0)]), "t")
        assert parse_svg_frames(svg) == []
        assert "no samples" in svg

    def test_other_units_shown_as_is(self) -> None:
        """A non-time unit is not converted to ms."""
        g = frames_of(render_svg(build([(["a"], 3)]), "t", unit="samples"))["a"]
        title = g.find(f"{NS}title")
        assert title is not None
        assert title.text == "a (3 samples, 100.00%)"

    def test_same_svg_in_another_process(self) -> None:
        """Colours do not come from hash(): another process, another hash seed, same bytes."""
        code = ("import sys; from pipeline.flamegraph import build, render_svg; "
                "sys.stdout.write(render_svg(build([(['main', 'hot'], 7), (['x'], 3)]), 't'))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": "12345"},
                             cwd=ROOT).stdout
        assert out == render_svg(build([(["main", "hot"], 7), (["x"], 3)]), "t")

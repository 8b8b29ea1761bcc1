"""Flame graphs without dependencies: merge stacks into a tree, export it, draw it.

Three consumers, three outputs from one tree (``build``):

* ``nested_set`` - rows of (level, value, self, label) in depth-first order, the "nested set"
  data frame Grafana's flame graph panel reads, so a query can return a flame graph as a table.
* ``render_svg`` - a standalone SVG a browser opens directly (hover shows name, time, share),
  for ``spanprof explain`` and for attaching to bug reports.
* ``parse_svg_frames`` - reads an SVG back into (name, level, x, width), so tests and tools
  check the geometry that was drawn rather than trusting the code that drew it.

Everything is iterative (explicit stacks, no recursion): real stacks can be deeper than
Python's recursion limit (deep recursion in the profiled program is exactly when someone
looks at a flame graph), and the output must not depend on it.

Output is deterministic: children are always visited sorted by name and colours come from a
CRC of the name, so the same stacks give byte-identical SVG whatever order they arrived in.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROOT_NAME = "all"

# Geometry, in px. The frame rect is one px shorter than its row so levels stay distinct.
MARGIN = 10
ROW_HEIGHT = 16
TITLE_HEIGHT = 24  # room for the title line above level 0
FONT_SIZE = 12
CHAR_WIDTH = FONT_SIZE * 0.6  # monospace advance; lets labels be truncated without a font
TEXT_PAD = 3
MIN_TEXT_WIDTH = 20.0  # below this a label would be one or two characters: noise
MIN_FRAME_WIDTH = 0.1  # below this a frame is invisible; dropping it keeps the SVG small

# Multipliers from a value in ``unit`` to milliseconds, for the hover titles.
_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}

# Characters XML 1.0 cannot carry even escaped (C0 controls other than tab/LF/CR, lone
# surrogates, U+FFFE/U+FFFF). A name holding one would make the whole document unreadable,
# so it is replaced by U+FFFD in the SVG; every other name round-trips exactly.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

_SVG_NS = "http://www.w3.org/2000/svg"


@dataclass(repr=False)
class Frame:
    """One node of the call tree: a function reached by one particular path from the root.

    ``value`` is inclusive (this frame and everything it called), ``self_value`` exclusive
    (time with this frame on top of the stack), both in the unit of the input stacks.
    ``children`` is keyed by the child's name. The same function reached by two different
    paths is two frames, as in every flame graph.
    """

    name: str
    value: int = 0
    self_value: int = 0
    children: dict[str, Frame] = field(default_factory=dict)

    def __repr__(self) -> str:
        # Shallow on purpose: the dataclass default recurses over the whole tree, which is
        # unreadable for a real profile and fails for a deep one.
        return (f"Frame(name={self.name!r}, value={self.value}, "
                f"self_value={self.self_value}, children={len(self.children)})")


def build(stacks: Iterable[tuple[Sequence[str], int]]) -> Frame:
    """Merge stacks into a tree rooted at a frame named ``"all"`` whose value is the total.

    Each stack is (frames root first - caller first, leaf last -, value). Identical paths
    merge; values <= 0 are skipped (a zero sample carries nothing, a negative one is a bug
    upstream that must not make other frames look smaller). An empty stack counts as time
    in the root itself.
    """
    root = Frame(ROOT_NAME)
    for frames, value in stacks:
        if isinstance(frames, str):
            # A str is a Sequence[str]: "a;b;c" would silently become frames "a", ";", ...
            raise TypeError(f"stack must be a sequence of frame names, got str {frames!r}; "
                            "split folded stacks on ';' first")
        if value <= 0:
            continue
        node = root
        node.value += value
        for name in frames:
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = Frame(name)
            child.value += value
            node = child
        node.self_value += value
    return root


def nested_set(root: Frame) -> list[tuple[int, int, int, str]]:
    """The tree as (level, value, self, label) rows, depth first, children sorted by name.

    This is the "nested set" layout of Grafana's flame graph panel: a frame's children are
    the rows right after it with level + 1, up to the next row at its own level or above.
    Level 0 is ``root``.
    """
    rows: list[tuple[int, int, int, str]] = []
    todo: list[tuple[int, Frame]] = [(0, root)]
    while todo:
        level, frame = todo.pop()
        rows.append((level, frame.value, frame.self_value, frame.name))
        # Reversed so the smallest name is popped (emitted) first.
        for name in sorted(frame.children, reverse=True):
            todo.append((level + 1, frame.children[name]))
    return rows


def render_svg(root: Frame, title: str, unit: str = "ns", width: int = 1200,
               base: Frame | None = None) -> str:
    """A standalone SVG icicle graph: the root at the TOP, callees stacked below callers.

    Each frame is a ``<g class="frame" data-name=... data-value=... data-level=...>`` holding
    a ``<title>`` (hover: name, value in ms, share of the total), a ``<rect>`` whose width is
    ``value / total * (width - 2 * MARGIN)`` and a ``<text>`` label truncated to fit
    (omitted under ``MIN_TEXT_WIDTH`` px). Children are laid out left to right sorted by
    name from their parent's x; frames under ``MIN_FRAME_WIDTH`` px are dropped with their
    subtree. ``unit`` is the unit of the values: ns, us, ms or s are shown converted to
    ms; any other (e.g. "samples") is shown as is. A tree with no value draws no frames.

    With ``base``, a differential graph: widths are ``root``'s, and each frame's colour
    says how its value compares with the same path in ``base`` (red: more than there,
    blue: less, the deeper the larger the difference against the frame's own value);
    ``data-delta`` and the hover title carry the difference.
    """
    total = root.value
    avail = float(width - 2 * MARGIN)
    scale = avail / total if total > 0 else 0.0
    top = MARGIN + TITLE_HEIGHT

    body: list[str] = []
    depth = 0
    todo: list[tuple[int, float, Frame, Frame | None]] = [(0, float(MARGIN), root, base)]
    while todo:
        level, x, frame, other = todo.pop()
        w = frame.value * scale
        if w < MIN_FRAME_WIDTH:
            continue
        depth = max(depth, level + 1)
        delta = None if base is None else frame.value - (other.value if other else 0)
        body.append(_frame_svg(frame, level, x, top + level * ROW_HEIGHT, w, total, unit,
                               delta))
        placed: list[tuple[int, float, Frame, Frame | None]] = []
        cx = x
        for name in sorted(frame.children):
            child = frame.children[name]
            placed.append((level + 1, cx, child,
                           other.children.get(name) if other is not None else None))
            cx += child.value * scale
        todo.extend(reversed(placed))  # pop in name order: document order is depth first

    if total <= 0:
        body.append(f'<text x="{MARGIN}" y="{top + FONT_SIZE}">no samples</text>')
    height = top + max(depth, 1) * ROW_HEIGHT + MARGIN
    head = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<svg xmlns="{_SVG_NS}" version="1.1" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="{FONT_SIZE}">\n'
        "<style>.frame:hover rect { stroke: #000; stroke-width: 0.5; }</style>\n"
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>\n'
        f'<text class="title" x="{width / 2:.1f}" y="{MARGIN + FONT_SIZE + 2}" '
        f'text-anchor="middle" font-size="{FONT_SIZE + 4}">{_esc(title)}</text>\n'
    )
    return head + "\n".join(body) + ("\n" if body else "") + "</svg>\n"


def parse_svg_frames(svg: str) -> list[tuple[str, int, float, float]]:
    """(name, level, x, width) of every frame in an SVG from ``render_svg``, in document
    (depth-first) order. Names come back unescaped, read from ``data-name``."""
    out: list[tuple[str, int, float, float]] = []
    for g in ET.fromstring(svg).iter(f"{{{_SVG_NS}}}g"):
        if g.get("class") != "frame":
            continue
        rect = g.find(f"{{{_SVG_NS}}}rect")
        if rect is None:
            raise ValueError(f"frame {g.get('data-name')!r} has no <rect>")
        out.append((g.get("data-name", ""), int(g.get("data-level", "0")),
                    float(rect.get("x", "0")), float(rect.get("width", "0"))))
    return out


def _frame_svg(frame: Frame, level: int, x: float, y: int, w: float, total: int,
               unit: str, delta: int | None = None) -> str:
    name = _esc(frame.name)
    share = 100.0 * frame.value / total
    amount, fill, extra, attr = _amount(frame.value, unit), _color(frame.name), "", ""
    if delta is not None:
        fill = _diff_color(delta, frame.value)
        extra = f", {'+' if delta >= 0 else '-'}{_amount(abs(delta), unit)} vs base"
        attr = f' data-delta="{delta}"'
    parts = [
        f'<g class="frame" data-name="{name}" data-value="{frame.value}" '
        f'data-level="{level}"{attr}>',
        f"<title>{name} ({amount}, {share:.2f}%{extra})</title>",
        f'<rect x="{x:.3f}" y="{y}" width="{w:.3f}" height="{ROW_HEIGHT - 1}" '
        f'fill="{fill}"/>',
    ]
    label = _label(frame.name, w)
    if label:
        parts.append(f'<text x="{x + TEXT_PAD:.3f}" y="{y + ROW_HEIGHT - 4}">'
                     f"{_esc(label)}</text>")
    parts.append("</g>")
    return "".join(parts)


def _amount(value: int, unit: str) -> str:
    return f"{value * _TO_MS[unit]:.3f} ms" if unit in _TO_MS else f"{value} {_esc(unit)}"


def _diff_color(delta: int, value: int) -> str:
    """Red for more than the base, blue for less, white for the same; saturated when the
    difference is the frame's whole value."""
    k = min(1.0, abs(delta) / value) if value > 0 else 1.0
    fade = int(255 * (1 - 0.8 * k))
    return f"rgb(255,{fade},{fade})" if delta > 0 else \
        f"rgb({fade},{fade},255)" if delta < 0 else "rgb(235,235,235)"


def _label(name: str, w: float) -> str:
    """The name cut to what fits in ``w`` px ("" if too narrow); cut before escaping, so an
    entity is never split."""
    if w < MIN_TEXT_WIDTH:
        return ""
    fits = int((w - 2 * TEXT_PAD) / CHAR_WIDTH)
    if len(name) <= fits:
        return name
    return name[: fits - 2] + ".." if fits >= 3 else ""


def _color(name: str) -> str:
    """A warm (red-orange-yellow) colour from a CRC of the name: stable across runs and
    processes, unlike ``hash()``, so one function keeps its colour from graph to graph."""
    h = zlib.crc32(name.encode("utf-8", "surrogatepass"))
    v1, v2, v3 = (h & 0xFF) / 255, ((h >> 8) & 0xFF) / 255, ((h >> 16) & 0xFF) / 255
    # The ranges of Brendan Gregg's "hot" palette (flamegraph.pl).
    return f"rgb({205 + int(50 * v3)},{int(230 * v1)},{int(55 * v2)})"


def _esc(s: str) -> str:
    """Escape for XML text and double- or single-quoted attributes (& < > " ')."""
    return html.escape(_NOT_XML.sub("\ufffd", s), quote=True)

"""The web UI in a real browser (issue #18): headless Chromium, driven by Playwright,
against ``spanprof run`` fed with tests/ui/data.py over OTLP/gRPC.

The click path a person takes: the trace search lists the slow call first; the keyboard
moves through the list and opens it; the trace's waterfall shows its spans with their CPU,
off-CPU, samples and method; a span's flame graph shows the hot function (hover, search,
zoom); the function's spans link back to the trace. Then the operation's flame graph and
its difference to an earlier range, the why view from a histogram's tail, deep links, and
both colour schemes. Every view is
screenshot to test-artifacts/ui/ (the README's come from here:
``SPANPROF_UPDATE_SCREENSHOTS=1``)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.conftest import SpanprofProcess
from tests.ui.conftest import screenshot
from tests.ui.data import CART_CALLS, CART_HOT, CART_SLOW, HOT, TYPICAL

pytestmark = pytest.mark.e2e
Pipeline = tuple[SpanprofProcess, dict[str, Any]]


def open_view(page: Any, sp: SpanprofProcess, fragment: str) -> None:
    page.goto(f"{sp.admin}/ui/{fragment}")
    ready(page)


def ready(page: Any) -> None:
    """The view's data is on screen (app.js sets data-ready once a view has drawn it), the
    view of the URL now shown (data-route): not the last one's, before the hashchange
    that replaces it has been dispatched."""
    deadline = time.monotonic() + 30
    while not page.evaluate(  # (wait_for_function evaluates a string: the CSP refuses it)
            "() => document.body.dataset.ready === '1' "
            "&& document.body.dataset.route === location.hash"):
        assert time.monotonic() < deadline, f"{page.url}: not drawn in 30 s"
        page.wait_for_timeout(20)
    assert page.query_selector(".error") is None, page.inner_text(".error")


class TestClickPath:
    def test_slow_trace_to_span_to_flame_graph_to_function_and_back(
            self, pipeline: Pipeline, page: Any) -> None:
        """Search -> (keyboard) slow trace -> span ``price`` -> its flame graph, with the
        hot function's frame (hover: time and share; search; click: zoom and the link to
        its spans) -> the function's spans, the slow one first -> back to the trace."""
        sp, facts = pipeline
        slow = facts["slow_trace"]
        open_view(page, sp, "#/search?service=checkout&operation=place_order&range=1h")
        rows = page.locator("tr.call")
        assert rows.count() == TYPICAL + 1
        first = rows.nth(0)
        assert slow[:12] in first.inner_text() and "2.40 s" in first.inner_text()
        assert "exact" in first.inner_text() and "child" in first.inner_text()
        head = page.inner_text(".hist-head")
        assert f"{TYPICAL + 1} calls" in head and "p99 2.40 s" in head
        assert page.locator("svg.hist .bar").count() >= 5
        screenshot(page, "search", docs=True)

        # keyboard: into the list, down, up, Enter opens the focused call's trace
        first.focus()
        page.keyboard.press("ArrowDown")
        assert page.evaluate("document.activeElement.dataset.trace") != slow
        page.keyboard.press("k")
        assert page.evaluate("document.activeElement.dataset.trace") == slow
        page.keyboard.press("Enter")
        ready(page)
        assert f"#/trace/{slow}" in page.url

        # the waterfall: every span, its method, CPU and off-CPU inside its bar
        names = page.locator(".wf-body .wf-row .span-name").all_inner_texts()
        assert names == ["place_order", "reserve_stock", "price", "serialize"]
        price = page.locator(".wf-body .wf-row", has_text="price")
        assert "900 ms" in price.inner_text() and "655 ms" in price.inner_text()
        assert price.locator(".method[data-method='link+time']").inner_text() == "child"
        assert "90" in price.inner_text()  # samples
        cpu_share = price.locator(".wf-bar .seg.cpu").evaluate(
            "e => e.getBoundingClientRect().width / e.parentElement.getBoundingClientRect().width")
        assert abs(cpu_share - 900 / 1555) < 0.02
        ser = page.locator(".wf-body .wf-row", has_text="serialize")
        assert ser.locator(".method[data-method='thread']").inner_text().startswith("thread ~")
        root = page.locator(".wf-body .wf-row").nth(0)
        assert root.locator(".method[data-method='link']").inner_text() == "exact"
        page.locator(".wf-body .wf-row").nth(0).focus()
        page.keyboard.press("ArrowDown")
        page.keyboard.press("ArrowDown")  # focus shows the span's details
        detail = page.inner_text(".span-detail")
        assert "threading.Lock.acquire" in detail
        # the contention profile of the same wait: its lock wait and the function
        assert "lock wait 500 ms" in " ".join(detail.split()) and \
            "Where it waited for a lock" in detail
        screenshot(page, "trace", docs=True)

        # the span's flame graph: the hot function's frame, its time and share on hover
        price.locator(".span-name").click()
        ready(page)
        assert re.search(rf"#/span/{slow}/[0-9a-f]{{16}}", page.url)
        frame = page.locator(f"g.frame[name='{HOT}']")
        assert frame.count() == 1
        frame.hover()
        details = page.inner_text(".fg-details")
        assert HOT in details and "900 ms" in details and "100.0% of all" in details
        assert "Lock.acquire" in page.inner_text(".columns")  # the wall-clock breakdown
        page.fill(".fg-search", "discount")
        expect(page.locator(".fg-found")).to_contain_text("1 frames match")
        assert "q=discount" in page.url  # the state is in the URL
        screenshot(page, "span", docs=True)
        page.locator(".toggle", has_text="wall clock").click()
        ready(page)
        assert page.locator("g.frame[name='threading.Lock.acquire']").count() == 1

        page.go_back()
        ready(page)
        page.locator(f"g.frame[name='{HOT}']").click()
        link = page.locator(".fg-selected a.fn-link")
        assert link.inner_text() == f"spans that burnt {HOT} →"
        assert "zoom=handler%3Bprice%3Bcompute_discount" in page.url
        link.click()
        ready(page)

        # the reverse question: which spans burnt it, the slow one first; back to its trace
        spans = page.locator("table.fn-spans tr.call")
        assert spans.count() == TYPICAL + 1
        top = spans.nth(0)
        assert "price" in top.inner_text() and "900 ms" in top.inner_text()
        assert page.locator("table.fn-traces tr.call").nth(0).inner_text().startswith(slow)
        screenshot(page, "function", docs=True)
        top.locator("a.trace-link").click()
        ready(page)
        assert f"#/trace/{slow}" in page.url
        chosen = page.locator(".wf-row.chosen .span-name")
        assert chosen.inner_text() == "price"


class TestOperationView:
    def test_flame_graph_and_difference(self, pipeline: Pipeline, page: Any) -> None:
        """The service's flame graph over the last hour has the hot function; against the
        range an hour and a half ago, it is red (more per call), the functions table
        names it first with its change."""
        sp, _ = pipeline
        open_view(page, sp, "#/operation?service=checkout&range=1h")
        assert page.locator(f"g.frame[name='{HOT}']").count() == 1
        assert page.locator("table.fns tbody tr").nth(0).inner_text().startswith(HOT)
        screenshot(page, "operation")
        open_view(page, sp, "#/operation?service=checkout&range=1h&base=2h..1h")
        fill = page.locator(f"g.frame[name='{HOT}'] rect").get_attribute("fill") or ""
        r, g, b = (int(x) for x in re.findall(r"\d+", fill))
        assert r > 200 and g < 150 and b < 150, fill  # red: more per call than the base
        first = page.locator("table.fns tbody tr").nth(0).inner_text()
        assert first.startswith(HOT) and "+" in first
        assert "per call" in page.inner_text(".figures")
        screenshot(page, "operation-diff", docs=True)


class TestWhyView:
    def test_from_the_histogram_to_why(self, pipeline: Pipeline, page: Any) -> None:
        """On update_cart's histogram, Shift+click on the first bar of the slow calls
        selects them and every slower one (the 2% over a second); "why are they slow?"
        compares them with the others: burning, the hot function first with the share of
        the extra time it explains (Enter opens its function view), cart.size setting the
        tail apart, and the hot function's frame red in the differential flame graph."""
        sp, _ = pipeline
        open_view(page, sp, "#/search?service=cart&operation=update_cart&range=1h")
        i = page.evaluate("[...document.querySelectorAll('svg.hist .bar')]"
                          ".findIndex((b) => +b.dataset.fromNs >= 1e9)")
        assert i > 0
        page.locator("svg.hist .bar").nth(i).click(modifiers=["Shift"])
        ready(page)
        assert "min_duration=" in page.url and "max_duration" not in page.url
        assert page.locator("tr.call").count() == CART_SLOW
        page.click("#why")
        ready(page)
        assert "#/why?" in page.url and "slower_than=" in page.url
        verdict = page.inner_text(".verdict")
        assert verdict.startswith("BURNING") or verdict.lower().startswith("burning"), verdict
        assert f"{CART_CALLS} calls" in verdict and f"{CART_SLOW} calls" in verdict, verdict
        groups = page.inner_text("table.groups")
        assert f"tail ({CART_SLOW})" in groups and f"typical ({CART_CALLS - CART_SLOW})" in groups
        assert page.locator("table.groups .few").count() == 0  # five calls: enough
        first = page.locator("table.why-fns tbody tr").nth(0)
        assert first.get_attribute("data-name") == CART_HOT
        assert re.search(r"\+9\d\d ms", first.inner_text()), first.inner_text()
        assert re.search(r"(8\d|9\d)\.\d%", first.inner_text()), first.inner_text()  # explains
        attr = page.locator("table.attrs tbody tr").nth(0)
        assert attr.get_attribute("data-key") == "cart.size" and "1.00" in attr.inner_text()
        fill = page.locator(f"section.flame g.frame[name='{CART_HOT}'] rect").get_attribute(
            "fill") or ""
        r, g, b = (int(x) for x in re.findall(r"\d+", fill))
        assert r > 200 and g < 150 and b < 150, fill  # red: more per call than typical
        screenshot(page, "why", docs=True)
        first.focus()
        page.keyboard.press("Enter")
        ready(page)
        assert "#/function?" in page.url and f"name={CART_HOT}" in page.url

    def test_one_slow_call_is_too_few(self, pipeline: Pipeline, page: Any) -> None:
        """place_order's slowest 1% is its one slow call: it waits (2.4 s of which 0.94 s
        on CPU, children included), and every figure of the tail says "too few calls"."""
        sp, _ = pipeline
        open_view(page, sp, "#/search?service=checkout&operation=place_order&range=1h")
        page.click("#slowest")
        ready(page)
        page.click("#why")
        ready(page)
        verdict = page.inner_text(".verdict")
        assert f"{TYPICAL + 1} calls" in verdict and "waiting" in verdict, verdict
        groups = page.inner_text("table.groups")
        assert "tail (1)" in groups and f"typical ({TYPICAL})" in groups
        assert "2.40 s" in groups  # the tail's duration per call
        assert page.locator("table.groups .few").count() == 4
        assert "too few calls" in page.inner_text("table.groups .few >> nth=0")
        assert page.locator(".note").count() >= 1  # a CPU profile cannot say on what
        assert page.locator("section.flame g.frame").count() >= 1
        screenshot(page, "why-few")

    def test_deep_link_and_form(self, pipeline: Pipeline, page: Any) -> None:
        """The why view opens from its URL alone; its form changes the tail."""
        sp, _ = pipeline
        open_view(page, sp, "#/why?service=cart&operation=update_cart&slowest=2%25")
        assert f"tail ({CART_SLOW})" in page.inner_text("table.groups")
        page.select_option("#f-rule", "slower_than")
        page.fill("#f-value", "140ms")
        page.click("form.filters button[type=submit]")
        ready(page)
        assert "slower_than=140ms" in page.url
        assert "slower than 140 ms" in page.inner_text(".verdict")
        page.emulate_media(color_scheme="dark")
        bg = page.evaluate("getComputedStyle(document.documentElement).backgroundColor")
        assert sum(int(x) for x in re.findall(r"\d+", bg)[:3]) / 3 < 60, bg
        screenshot(page, "why-dark")


class TestLinksAndSchemes:
    def test_deep_links_keep_the_state(self, pipeline: Pipeline, page: Any) -> None:
        """A span view's URL with a search and a zoom opens as it was left; a histogram
        bar selects its calls; the search's sort is a link."""
        sp, facts = pipeline
        slow = facts["slow_trace"]
        price = slow[:8] + "00000003"
        open_view(page, sp, f"#/span/{slow}/{price}?q=discount&zoom=handler")
        assert page.input_value(".fg-search") == "discount"
        assert "1 frames match" in page.inner_text(".fg-found")
        assert page.locator("g.frame.fade").count() >= 1  # the root, faded: zoomed in
        open_view(page, sp, "#/search?service=checkout&operation=place_order&order=off_cpu")
        assert page.locator("th[aria-sort='descending']").inner_text().startswith("Off-CPU")
        page.click("#slowest")
        ready(page)
        assert page.locator("tr.call").count() == 1  # the slowest 1% of 41 calls
        assert "min_duration=" in page.url
        page.locator("svg.hist .bar").nth(0).focus()
        page.keyboard.press("Enter")
        ready(page)
        assert "max_duration=" in page.url and page.locator("tr.call").count() >= 1

    @pytest.mark.parametrize("scheme", ["dark", "light"])
    def test_colour_schemes(self, pipeline: Pipeline, browser: Any, scheme: str) -> None:
        """The system's scheme is followed (prefers-color-scheme); text stays readable
        on the background; the theme button overrides it."""
        sp, facts = pipeline
        pg = browser.new_page()
        pg.emulate_media(color_scheme=scheme)
        try:
            open_view(pg, sp, f"#/trace/{facts['slow_trace']}")
            bg, fg = pg.evaluate("""() => {
                const s = getComputedStyle(document.documentElement);
                return [s.backgroundColor, s.color]; }""")
            lum = [sum(int(x) for x in re.findall(r"\d+", c)[:3]) / 3 for c in (bg, fg)]
            assert (lum[0] < 60) == (scheme == "dark"), bg
            assert abs(lum[0] - lum[1]) > 150, (bg, fg)  # contrast
            if scheme == "dark":
                screenshot(pg, "trace-dark", docs=True)
            pg.click("#theme")  # auto -> light -> dark
            pg.click("#theme")
            assert pg.evaluate("document.documentElement.dataset.theme") == "dark"
            assert pg.evaluate("localStorage.getItem('spanprof.theme')") == "dark"
        finally:
            pg.evaluate("localStorage.removeItem('spanprof.theme')")
            pg.close()


# A flame graph of 1 s: `hot` (99.5%) and `mid` (0.5%: a few pixels wide) with 50 callees
# of 100 µs each (too narrow to draw but once zoomed into `mid`), each over a leaf; and
# `rare` (0.1%, not drawn at first) over `rare.a` over `rare.deep`
NARROW_TREE = """() => {
  const mid = { n: "mid", v: 5e6, c: [] };
  for (let i = 50; i >= 1; i--) {  // not in name order: the graph sorts them
    const k = String(i).padStart(2, "0");
    mid.c.push({ n: `m.c${k}`, v: 1e5, c: [{ n: `leaf${k}`, v: 1e5 }] });
  }
  return { n: "all", v: 1e9, c: [{ n: "hot", v: 994e6 }, mid, { n: "rare", v: 1e6,
    c: [{ n: "rare.a", v: 6e5, c: [{ n: "rare.deep", v: 6e5 }] }, { n: "rare.b", v: 4e5 }] }] };
}"""


def draw_tree(page: Any, opts: str = "{}") -> None:
    """Draw NARROW_TREE with flame.js in the page, in place of the view."""
    page.evaluate(f"""async () => {{
      const {{ flameGraph }} = await import("./flame.js");
      const el = document.createElement("section");
      el.className = "flame";
      document.getElementById("main").replaceChildren(el);
      await flameGraph(el, ({NARROW_TREE})(), {opts});
    }}""")


class TestLargeFlameGraph:
    def test_narrow_frames_drawn_when_zoomed_into(self, pipeline: Pipeline, page: Any) -> None:
        """Frames too narrow to draw are left out of the first draw, and drawn, each in its
        place, once the frame above them is zoomed into (click, or a link's zoom); the
        search counts and sums the whole tree; hover says a frame's share of all."""
        sp, _ = pipeline
        open_view(page, sp, "#/search")
        draw_tree(page)
        assert page.locator("g.frame[name='mid']").count() == 1
        assert page.locator("g.frame[name^='m.c']").count() == 0  # 0.14 px each
        assert page.locator("g.frame[name='rare']").count() == 0  # 1.4 px
        page.fill(".fg-search", "m.c")
        expect(page.locator(".fg-found")).to_have_text("50 frames match: 5.00 ms (0.5%)")
        page.locator("g.frame[name='mid']").click()
        expect(page.locator("g.frame[name^='m.c']")).to_have_count(50)
        expect(page.locator("g.frame[name^='leaf']")).to_have_count(50)
        page.wait_for_timeout(400)  # the zoom's transition
        width = float(page.get_attribute("section.flame svg", "width") or 0)
        frames = page.evaluate("""() => [...document.querySelectorAll("g.frame[name^='m.c']")]
          .map((g) => [g.getAttribute("name"), g.transform.baseVal.consolidate().matrix.e,
                       +g.getAttribute("width")]).sort((a, b) => a[1] - b[1])""")
        assert [f[0] for f in frames] == [f"m.c{i:02d}" for i in range(1, 51)]  # by name
        for i, (_, x, w) in enumerate(frames):
            assert abs(w - width / 50) < 0.01 and abs(x - i * width / 50) < 0.01, frames[i]
        assert page.locator("g.frame[name='m.c07'] rect").get_attribute("fill") == "#E600E6"
        page.locator("g.frame[name='leaf07']").hover()
        hover = "leaf07: 100 µs CPU, 0.010% of all, 100.0% of m.c07"
        assert page.inner_text(".fg-details") == hover
        assert page.locator("g.frame[name='leaf07'] title").text_content() == hover
        page.keyboard.press("Escape")
        expect(page.locator("g.frame[name^='m.c']")).to_have_count(0)

        draw_tree(page, '{ zoom: "rare;rare.a" }')
        assert page.locator("g.frame[name='rare.deep']").count() == 1
        assert page.locator("g.frame[name='rare.b']").count() == 0  # beside the zoomed frame
        assert page.locator("g.frame.fade[name='rare']").count() == 1
        assert "rare.a 600 µs CPU, 0.060% of all, 60.0% of rare" in page.inner_text(".fg-selected")

"""The browser tests' fixtures: one ``spanprof run`` fed with tests/ui/data.py for the
module, and Debian's Chromium (``/usr/bin/chromium``, `make test` installs it) driven by
Playwright; screenshots go to ``test-artifacts/ui/`` (and, with
``SPANPROF_UPDATE_SCREENSHOTS=1``, the README's to ``docs/ui/``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _STARTED, ROOT, SpanprofProcess, wait_until

ARTIFACTS = ROOT / "test-artifacts" / "ui"
DOCS = ROOT / "docs" / "ui"
# Playwright cannot download its own browsers here; Debian's Chromium, told not to open
# connections of its own (updates, sync, safe browsing: a closed network refuses them)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    path = os.environ.get("SPANPROF_CHROMIUM") or shutil.which("chromium") or \
        "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("Chromium not found: apt-get install -y chromium (make test does)",
                    pytrace=False)
    return path


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SpanprofProcess,
                                                                         dict[str, Any]]]:
    """A running pipeline with the UI's data, attributed and in the aggregates."""
    from tests.ui.data import CART_CALLS, CART_HOT, TYPICAL, feed

    sp = SpanprofProcess(tmp_path_factory.mktemp("ui"))
    sp.start()
    _STARTED.remove(sp)  # this module's, not one test's (stopped below)
    try:
        facts = feed(sp.grpc_target)
        tid = facts["slow_trace"]

        def settled() -> bool:
            got = sp.get("/api/v1/search?service=checkout&operation=place_order")
            fn = sp.get("/api/v1/function_spans?function=compute_discount")
            tr = sp.get(f"/api/v1/traces/{tid}?method=all")
            cart = sp.get(f"/api/v1/function_spans?function={CART_HOT}")
            return got["matched"] == TYPICAL + 1 and got["calls"][0]["trace_id"] == tid and \
                got["calls"][0]["inclusive_cpu_ns"] > 900_000_000 and \
                fn["span_count"] == TYPICAL + 1 and \
                any("thread" in s["method"] for s in tr["spans"]) and \
                cart["span_count"] == CART_CALLS
        wait_until(settled, timeout=60, interval=0.5)
        yield sp, facts
    finally:
        if sp.proc is not None and sp.proc.poll() is None:
            sp.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900}, color_scheme="light")
        ctx.set_default_timeout(15_000)
        yield ctx
        ctx.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab; an error in the page's scripts fails the test."""
    pg = browser.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield pg
    pg.close()
    assert not errors, errors


def screenshot(page: Any, name: str, docs: bool = False) -> Path:
    """Into test-artifacts/ui/; the README's (``docs``) also into docs/ui/ when
    SPANPROF_UPDATE_SCREENSHOTS=1."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    if docs and os.environ.get("SPANPROF_UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS / f"{name}.png")
    return path

"""The documentation site in a real browser: Debian's ``chromium``, headless, driven by
Playwright (``executable_path``: no browser download), the site built into ``build/site``
and served on 127.0.0.1.

Screenshots of the home page, a guide, a reference page, the benchmarks page and a
search land in ``build/screenshots/``. The pages load without a script error or a failed
request, every image loads, the benchmark plots fill the content column and open full
size when clicked, and a search returns results (it cannot from ``file://``: Chromium
refuses the search's web worker there, so the site must be served).

Skips when Playwright or Chromium is missing, unless ``MSGPATTERNS_REQUIRE_SERVICES=1``
(CI, where ``.ci/run`` installs ``chromium``).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from docs_site import REPO, build
from msgpatterns.testing import services

SITE = REPO / "build" / "site"
SHOTS = REPO / "build" / "screenshots"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
PAGES = {
    "home": "",
    "guide": "idempotency/",
    "reference": "reference/consumer/",
    "benchmarks": "benchmarks/",
    # Once rendered as literal text from a broken code span on: the Celery section.
    "integrations-celery": "integrations/#celery",
    # Docstrings written with reST roles: links.
    "reference-aio": "reference/aio/",
}


def _missing(reason: str) -> None:
    if services.services_required():
        pytest.fail(f"MSGPATTERNS_REQUIRE_SERVICES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _chromium() -> str:
    path = shutil.which(os.environ.get("MSGPATTERNS_CHROMIUM") or "chromium")
    if not path:
        _missing("no chromium executable (apt-get install chromium)")
    return str(path)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site, freshly built into build/site, served on 127.0.0.1 (a free port)."""
    build(SITE)
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium with a new, empty profile."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (dev extra)")
    executable = _chromium()
    profile = tmp_path_factory.mktemp("chromium-profile")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900}, timeout=120_000,
        )
        try:
            yield context
        finally:
            context.close()


class _Watched:
    """A page with its script errors and failed requests recorded."""

    def __init__(self, context: Any) -> None:
        self.page = context.new_page()
        self.page.set_default_timeout(60_000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(f"script error: {error}"))
        self.page.on("requestfailed",
                     lambda request: self.errors.append(f"failed: {request.url}"))
        self.page.on("response", lambda response: response.status >= 400 and
                     self.errors.append(f"HTTP {response.status}: {response.url}"))

    def open(self, url: str) -> Any:
        response = self.page.goto(url, wait_until="load")
        assert response is not None and response.ok, url
        return self.page


def _broken_images(page: Any) -> list[str]:
    return list(page.evaluate(
        "() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0)"
        ".map(i => i.src)"))


@pytest.mark.parametrize("name", list(PAGES))
def test_page_renders_with_its_images(browser: Any, served: str, name: str) -> None:
    watched = _Watched(browser)
    page = watched.open(served + PAGES[name])
    page.locator("article h1").first.wait_for()
    page.screenshot(path=str(SHOTS / f"{name}.png"))
    assert _broken_images(page) == []
    assert watched.errors == []
    watched.page.close()


def test_benchmark_plots_fill_the_column_and_open_full_size(browser: Any, served: str) -> None:
    watched = _Watched(browser)
    page = watched.open(served + PAGES["benchmarks"])
    plots = page.locator("article a > img[src$='.svg']")
    assert plots.count() >= 5
    column = page.locator("article").first.bounding_box()
    assert column is not None
    heights = []
    for i in range(plots.count()):
        box = plots.nth(i).bounding_box()
        assert box is not None
        assert box["width"] >= 0.9 * (column["width"] - 50), (i, box, column)
        heights.append(box["height"])
    tallest = plots.nth(heights.index(max(heights)))
    tallest.scroll_into_view_if_needed()
    page.add_style_tag(content=".md-header { visibility: hidden }")  # fixed: it would cover
    tallest.screenshot(path=str(SHOTS / "benchmarks-plot.png"))  # the plot as shown
    with page.expect_navigation():
        plots.first.click()
    assert page.url.endswith(".svg")
    assert watched.errors == []
    watched.page.close()


def test_search_returns_results(browser: Any, served: str) -> None:
    """Material's search runs in a web worker; served over HTTP it answers."""
    watched = _Watched(browser)
    page = watched.open(served)
    page.keyboard.press("s")  # Material's shortcut: focus the search box
    page.keyboard.type("idempotent")
    results = page.locator(".md-search-result__item")
    results.first.wait_for(timeout=60_000)
    assert results.count() > 0
    meta = page.locator(".md-search-result__meta").inner_text()
    assert "matching" in meta and "Initializing" not in meta, meta
    page.screenshot(path=str(SHOTS / "search.png"))
    assert watched.errors == []
    watched.page.close()

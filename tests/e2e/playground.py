"""What the playground's browser tests share: Debian's Chromium driven by Playwright, a page per test, screenshots.

Chromium is Debian's package (`make browser` installs it); Playwright is pointed at it and never downloads a
browser. Screenshots (docs/img/playground-*.png) are written only when GENSERVE_SCREENSHOTS=1 (`make screenshots`),
so `make test` leaves the checkout as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("GENSERVE_CHROMIUM", "/usr/bin/chromium"))
SHOTS = ROOT / "docs" / "img"
DESKTOP, PHONE = {"width": 1280, "height": 860}, {"width": 375, "height": 760}
TIMEOUT_MS = 30_000


@contextmanager
def chromium() -> Iterator[Any]:
    """One headless Chromium (Debian's) for a test module."""
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium (as root: apt-get install -y "
                    "chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def page_at(browser: Any, url: str, viewport: dict[str, int] = DESKTOP) -> Iterator[Any]:
    """A fresh page (its own storage) at `url`, once the page has read the server's settings; page errors fail."""
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(url)
        yield page
        assert not errors, f"errors in the page: {errors}"
    finally:
        context.close()


def wait_ready(page: Any) -> None:
    page.wait_for_selector("body[data-ready=true]")


def screenshots_wanted() -> bool:
    return os.environ.get("GENSERVE_SCREENSHOTS") == "1"


def assert_fits_a_phone(page: Any) -> None:
    """At 375 px nothing scrolls sideways: the page's width is the screen's."""
    page.set_viewport_size(PHONE)
    try:
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"the page is {width} px wide at {PHONE['width']} px"
    finally:
        page.set_viewport_size(DESKTOP)


def screenshot(page: Any, name: str) -> None:
    """docs/img/playground-<name>-{desktop,375}.png of the page as it is, when GENSERVE_SCREENSHOTS=1."""
    if not screenshots_wanted():
        return
    for label, size in (("desktop", DESKTOP), ("375", PHONE)):
        page.set_viewport_size(size)
        page.wait_for_timeout(150)  # one layout pass at the new width
        page.screenshot(path=str(SHOTS / f"playground-{name}-{label}.png"), full_page=True)
    page.set_viewport_size(DESKTOP)


# Records the page's renders of the answer being streamed, and whether the stream had ended at each one.
WATCH_ANSWER = """() => {
  window.renders = [];
  new MutationObserver(() => {
    const last = document.querySelector('.message.assistant:last-child');
    if (last) window.renders.push({text: last.querySelector('.content').textContent, state: last.dataset.state});
  }).observe(document.getElementById('conversation'), {childList: true, subtree: true, characterData: true});
}"""


def watch_answer(page: Any) -> None:
    """Start recording the renders of the next answer (read with `partial_renders`)."""
    page.evaluate(WATCH_ANSWER)


def partial_renders(page: Any, final: str) -> set[str]:
    """The distinct texts the answer showed while it streamed, before it became `final`."""
    renders = page.evaluate("window.renders")
    return {r["text"] for r in renders if r["state"] == "streaming" and r["text"] and r["text"] != final}


def ask(page: Any, text: str) -> None:
    """Types `text` into the chat box and sends it; returns once the answer has finished (Send enabled again)."""
    page.get_by_role("textbox", name="Message").fill(text)
    page.get_by_role("button", name="Send").click()
    page.wait_for_selector(".message.assistant:last-child:not([data-state=streaming])")

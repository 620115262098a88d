"""The dashboard's tests' browser: real headless Chromium on the gateway of the module's `stack`."""

import os
import shutil

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 30_000


def _chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def playwright():
    if _chromium() is None:
        pytest.skip("no Chromium found (install Debian's `chromium`, or set CHROMIUM); .ci/run installs it")
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        yield playwright


@pytest.fixture
def launch(playwright, stack):
    """launch(extra_args, viewport, permissions, url) -> a page on the dashboard (of `stack`, or of
    the gateway at `url`); fails the test on a JavaScript error in the page."""
    browsers, errors = [], []

    def open_page(extra_args=(), viewport=(1280, 800), permissions=(), url=None):
        browser = playwright.chromium.launch(executable_path=_chromium(), args=[*CHROMIUM_ARGS, *extra_args])
        browsers.append(browser)
        context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        if permissions:
            context.grant_permissions(list(permissions), origin=url or stack.url)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url or stack.url)
        return page

    yield open_page
    for browser in browsers:
        browser.close()
    assert errors == [], f"JavaScript errors in the page: {errors}"


@pytest.fixture
def page(launch):
    return launch()

"""The first dashboard in real headless Chromium: create a session, upload a video, ask."""

import os
import shutil
from pathlib import Path

import pytest

from tests.support import sample_video

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def page(stack):
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium found (install Debian's `chromium`, or set CHROMIUM); .ci/run installs it")
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def test_create_upload_watch_ingest_and_ask(stack, page):
    page.goto(stack.url)
    page.get_by_role("button", name="Create session").click()
    page.wait_for_selector("#session-line:has-text('Session ')")

    page.set_input_files("#file", str(sample_video("bikes.mp4")))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_function("document.querySelector('#upload-progress').value === 100")
    page.wait_for_selector("dd[data-field='state']:has-text('ingested')")
    assert page.text_content("dd[data-field='frames_ingested']") == "10"
    assert page.text_content("dd[data-field='video_time_s']") == "9.0 s"
    assert page.text_content("dd[data-field='model']") == "tiny-random-llava"

    page.fill("#question", "What is happening?")
    page.press("#question", "Enter")
    page.wait_for_selector("#history li .meta")
    assert page.text_content("#history li .question") == "What is happening?"
    assert page.text_content("#history li .meta").startswith("at 9.0 s of video")
    assert page.is_hidden("#error")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-first-page.png"), full_page=True)


def test_an_upload_error_is_shown_to_the_user(stack, page, tmp_path):
    page.goto(stack.url)
    page.get_by_role("button", name="Create session").click()
    page.wait_for_selector("#session-line:has-text('Session ')")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video\n" * 100)
    page.set_input_files("#file", str(notes))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_selector("#session-error:has-text('not a readable video file')")
    assert page.text_content("dd[data-field='state']") == "error"


def test_an_api_error_is_shown_to_the_user(stack, page, tmp_path):
    page.goto(stack.url)
    page.get_by_role("button", name="Create session").click()
    page.wait_for_selector("#session-line:has-text('Session ')")
    big = tmp_path / "big.mp4"
    big.write_bytes(b"\0" * (4 * 1024 * 1024 + 1))  # the stack allows 4 MiB
    page.set_input_files("#file", str(big))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_selector("#error:has-text('Upload failed: the upload exceeds the limit of 4194304 bytes')")
    assert page.is_enabled("#upload-form button")  # the user may try another file

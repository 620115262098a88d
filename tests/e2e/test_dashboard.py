"""The dashboard in real headless Chromium, against a real gateway and worker: a file, a camera,
the memory view, errors, and a phone-sized screen. The default model has random weights, so the
tests assert an answer's shape (text, evidence chips, timings), never its words."""

import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
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
    """launch(extra_args, viewport, permissions) -> a page on the dashboard; fails the test on a
    JavaScript error in the page."""
    browsers, errors = [], []

    def open_page(extra_args=(), viewport=(1280, 800), permissions=()):
        browser = playwright.chromium.launch(executable_path=_chromium(), args=[*CHROMIUM_ARGS, *extra_args])
        browsers.append(browser)
        context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        if permissions:
            context.grant_permissions(list(permissions), origin=stack.url)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(stack.url)
        return page

    yield open_page
    for browser in browsers:
        browser.close()
    assert errors == [], f"JavaScript errors in the page: {errors}"


@pytest.fixture
def page(launch):
    return launch()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def create_session(page, policy: str | None = None, budget: int | None = None, fps: float | None = None) -> None:
    page.wait_for_selector("#model option[value='tiny-random-llava']", state="attached")
    if policy:
        page.select_option("#policy", policy)
    if budget:
        page.fill("#budget", str(budget))
    if fps:
        page.fill("#fps", str(fps))
    page.get_by_role("button", name="Create session").click()
    page.wait_for_selector("#session-line:has-text('Session ')")
    page.wait_for_selector("#connection[data-state='live']")


def upload(page, path: Path) -> None:
    page.set_input_files("#file", str(path))
    page.get_by_role("button", name="Upload").click()


def field(page, name: str) -> str:
    return page.text_content(f"#status [data-field='{name}']")


def frames_ingested(page) -> int:
    text = field(page, "frames_ingested")
    return int(text.replace(",", "")) if text.replace(",", "").isdigit() else 0


def ask(page, question: str):
    """Ask with Enter; the history item once its answer is done."""
    page.fill("#question", question)
    page.press("#question", "Enter")
    page.wait_for_selector("#history li.qa[data-state='done']")
    item = page.locator("#history li.qa").first
    assert item.locator(".question").text_content() == question
    answer = item.locator(".answer").text_content()
    assert answer and answer != "Thinking…"
    assert int(item.get_attribute("data-tokens")) >= 1  # it arrived token by token
    chips = item.locator(".chip")
    assert chips.count() >= 1
    for chip in chips.all_text_contents():
        assert re.fullmatch(r"\d+\.\d s", chip), chip
    meta = item.locator(".meta").text_content()
    assert re.search(r"first token \d+(\.\d+)? m?s · total \d+(\.\d+)? m?s$", meta), meta
    return item


def write_y4m(path: Path, width: int = 160, height: int = 120, fps: int = 10, frames: int = 30) -> None:
    """A YUV4MPEG2 clip of moving gradients, for Chromium's fake camera."""
    rows, columns = np.mgrid[0:height, 0:width]
    with path.open("wb") as out:
        out.write(f"YUV4MPEG2 W{width} H{height} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(frames):
            out.write(b"FRAME\n")
            out.write(((rows + columns + 8 * i) % 256).astype(np.uint8).tobytes())
            out.write(np.full((height // 2, width // 2), (16 * i) % 256, np.uint8).tobytes())
            out.write(np.full((height // 2, width // 2), 255 - (16 * i) % 256, np.uint8).tobytes())


def test_a_file_is_uploaded_ingested_previewed_and_asked_about(page):
    assert page.is_hidden("#error")
    create_session(page)
    assert page.text_content("#setup [data-field='model']") == "tiny-random-llava"
    assert page.text_content("#setup [data-field='policy']") == "infmllm"

    upload(page, sample_video("bikes.mp4"))
    page.wait_for_function("document.querySelector('#upload-progress').value === 100")
    assert page.text_content("#upload-percent") == "100%"
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    assert field(page, "frames_ingested") == "10"  # 10 s at 1 frame/s
    assert field(page, "video_time_s") == "9.0 s"
    assert re.fullmatch(r"[\d,]+ / 8,192", field(page, "cache_tokens"))
    page.wait_for_selector("#ingest-percent:text-is('100%')")
    # the memory view: one span per second, nothing evicted under the default budget
    page.wait_for_function("document.querySelectorAll('#timeline .span').length === 10")
    assert page.locator("#timeline .span[data-held='all']").count() == 10

    item = ask(page, "What is happening?")
    assert item.locator(".meta").text_content().startswith("at 9.0 s of video")
    page.wait_for_selector("#timeline .span[data-evidence]", state="attached")

    # an evidence chip shows its moment in the preview
    page.wait_for_function("document.querySelector('#preview').readyState >= 1")
    chip = item.locator(".chip").last
    chip_s = float(chip.get_attribute("data-time"))
    chip.click()
    page.wait_for_function(
        f"Math.abs(document.querySelector('#preview').currentTime - {chip_s}) < 0.05 "
        "&& document.querySelector('#preview').paused"
    )
    assert page.is_hidden("#error")
    screenshot(page, "dashboard-file.png")


def test_the_camera_streams_frames_at_the_sessions_fps_and_is_asked_about(launch, tmp_path):
    clip = tmp_path / "camera.y4m"
    write_y4m(clip)
    page = launch(
        ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream", f"--use-file-for-fake-video-capture={clip}"],
        permissions=["camera"],
    )
    create_session(page, fps=2)
    page.get_by_role("tab", name="Camera").click()
    page.get_by_role("button", name="Start camera").click()
    page.wait_for_selector("#stage-badge:has-text('Live')")

    page.wait_for_function("Number(document.querySelector('#status [data-field=frames_ingested]').textContent) >= 2")
    first_frames, first_at = frames_ingested(page), time.monotonic()
    first_video_s = float(field(page, "video_time_s").removesuffix(" s"))
    page.wait_for_function(
        f"Number(document.querySelector('#status [data-field=frames_ingested]').textContent) >= {first_frames + 6}"
    )
    frames, elapsed_s = frames_ingested(page) - first_frames, time.monotonic() - first_at
    video_s = float(field(page, "video_time_s").removesuffix(" s")) - first_video_s
    assert 1.2 <= frames / elapsed_s <= 3.0, (frames, elapsed_s)  # 2 frames a second
    assert 0.7 <= video_s / elapsed_s <= 1.4, (video_s, elapsed_s)  # of video in real time
    assert field(page, "state") == "ingesting"
    assert re.fullmatch(r"\d+\.\d\d s", field(page, "ingest_lag_s"))

    ask(page, "What do you see?")
    screenshot(page, "dashboard-camera.png")
    page.get_by_role("button", name="Stop").click()
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    page.wait_for_selector("#source-status:has-text('Stream ended')")
    last_s = float(field(page, "video_time_s").removesuffix(" s"))
    page.wait_for_function(  # the memory view covers every second streamed, all held
        f"document.querySelectorAll('#timeline .span[data-held=all]').length === {int(last_s) + 1}"
    )
    assert page.is_hidden("#error")


def test_the_memory_view_shows_evicted_seconds_apart_from_held_ones(page):
    # 40 frames of 16 tokens in a 256-token budget: the sliding window keeps only the latest
    create_session(page, policy="sliding", budget=256, fps=4)
    assert page.text_content("#policy-hint").startswith("Keeps the first and the latest tokens only")
    upload(page, sample_video("bikes.mp4"))
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    assert field(page, "frames_ingested") == "40"
    page.wait_for_function(
        "document.querySelectorAll('#timeline .span').length === 10"
        " && document.querySelectorAll('#timeline .span[data-held=none]').length > 0"
    )
    held = page.eval_on_selector_all("#timeline .span", "spans => spans.map(s => s.dataset.held)")
    assert held[0] == "none" and held[-1] == "all", held
    first_held = held.index("all") if "part" not in held else held.index("part")
    assert set(held[:first_held]) == {"none"}, held  # evicted from the start, held to the end
    assert int(page.text_content("[data-memory='evictions']")) > 0
    assert page.locator(".budget-frames").bounding_box()["width"] > 0
    assert page.locator(".budget-text").bounding_box()["width"] > 0
    assert "of a 256-token budget" in page.get_attribute("#budget-bar", "aria-label")
    assert re.search(r"\d+ s evicted", page.get_attribute("#timeline", "aria-label"))
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#memory").screenshot(path=str(ARTIFACTS / "dashboard-memory.png"))

    # a reload keeps the session, and draws its memory again
    session_line = page.text_content("#session-line")
    page.reload()
    page.wait_for_selector(f"#session-line:text-is('{session_line}')")
    page.wait_for_function("document.querySelectorAll('#timeline .span[data-held=none]').length > 0")
    assert field(page, "frames_ingested") == "40"


def test_an_upload_that_is_not_a_video_shows_the_sessions_error(page, tmp_path):
    create_session(page)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video\n" * 100)
    upload(page, notes)
    page.wait_for_selector("#session-error:has-text('not a readable video file')")
    assert field(page, "state") == "error"
    page.get_by_role("button", name="End session").click()  # and start again
    page.wait_for_selector("#connection:text-is('No session')")
    assert page.is_visible("#create-form") and page.is_hidden("#session-error")


def test_an_api_error_is_shown_to_the_user(page, tmp_path):
    create_session(page)
    big = tmp_path / "big.mp4"
    big.write_bytes(b"\0" * (4 * 1024 * 1024 + 1))  # the stack allows 4 MiB
    upload(page, big)
    page.wait_for_selector("#error:has-text('Upload failed: the upload exceeds the limit of 4194304 bytes')")
    assert page.is_visible("#error")
    assert page.is_enabled("#upload-form button")  # the user may try another file
    screenshot(page, "dashboard-error.png")
    page.get_by_role("button", name="Dismiss the message").click()
    assert page.is_hidden("#error")


def test_the_page_fits_a_phone_and_a_laptop(launch):
    phone = launch(viewport=(390, 844))
    create_session(phone)
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    boxes = {card: phone.locator(f"#{card}").bounding_box() for card in ("setup", "source", "live", "ask", "memory")}
    assert len({(round(box["x"]), round(box["width"])) for box in boxes.values()}) == 1  # one column
    assert all(box["x"] >= 0 and box["x"] + box["width"] <= 390 for box in boxes.values())
    screenshot(phone, "dashboard-phone.png")

    laptop = launch(viewport=(1280, 800))
    assert laptop.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    setup, live, questions = (laptop.locator(f"#{card}").bounding_box() for card in ("setup", "live", "ask"))
    assert setup["x"] < live["x"] < questions["x"]  # three columns
    assert questions["x"] + questions["width"] <= 1280


def test_a_lost_connection_reconnects_and_says_so(page, stack):
    """Last in the file: it restarts the module's gateway."""
    create_session(page)
    gateway = stack.processes["gateway"]
    gateway.kill()  # a crash (a SIGTERM waits for the page's open event stream to end)
    gateway.wait()
    try:
        page.wait_for_selector("#connection[data-state='reconnecting']:has-text('reconnecting')")
    finally:
        stack.start("gateway", "app")
        stack.wait_until_serving()
    page.wait_for_selector("#connection[data-state='live']")
    upload(page, sample_video("carphone_pristine.mp4"))
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    assert field(page, "frames_ingested") == "4"
    ask(page, "Still there?")

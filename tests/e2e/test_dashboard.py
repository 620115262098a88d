"""The dashboard in real headless Chromium, against a real gateway and worker: a file, a camera,
the memory view, errors, and a phone-sized screen. The default model has random weights, so the
tests assert an answer's shape (text, evidence chips, timings), never its words."""

import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.e2e.dashboard import ARTIFACTS, create_session, field, screenshot, upload
from tests.media import cut_before_frame, faststart_mp4
from tests.support import Client, running_stack, sample_video


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
    chips = item.locator(".evidence .chip")
    assert chips.count() >= 1
    for chip in chips.all_text_contents():
        assert re.fullmatch(r"\d+\.\d s \d+%", chip), chip  # the time, and the weight
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
    # no question before any frame: the model would answer about nothing
    assert page.is_disabled("#ask-form button[type=submit]") and page.is_disabled("#question")
    assert page.text_content("#ask-hint") == "No video yet: upload a file or start the camera, then ask."

    upload(page, sample_video("bikes.mp4"))
    page.wait_for_function("document.querySelector('#upload-progress').value === 100")
    assert page.text_content("#upload-percent") == "100%"
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    assert field(page, "frames_ingested") == "10"  # 10 s at 1 frame/s
    assert field(page, "video_time_s") == "9.0 s"
    assert page.is_hidden("#session-warnings")  # a whole file
    assert re.fullmatch(r"[\d,]+ / 8,192", field(page, "cache_tokens"))
    page.wait_for_selector("#ingest-percent:text-is('100%')")
    # the memory view: one span per second, nothing evicted under the default budget
    page.wait_for_function("document.querySelectorAll('#timeline .span').length === 10")
    assert page.locator("#timeline .span[data-held='all']").count() == 10

    assert page.text_content("#ask-hint") == "Enter to send · Shift+Enter for a new line"
    page.fill("#question", " \n ")  # only white space: nothing to ask
    assert page.is_disabled("#ask-form button[type=submit]")
    page.fill("#question", "What?")
    assert page.is_enabled("#ask-form button[type=submit]")
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
    create_session(page, policy="sliding", budget=256, fps=4, recall=False)
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
    gap = page.locator(".timeline-legend span", has_text="Gap")  # the legend says what a gap means
    assert gap.is_visible() and gap.text_content() == (
        "Gap: no frames reached the cache (dropped while the model was behind, or none sampled)"
    )
    assert page.text_content("#setup [data-field='recall']") == "off"
    assert page.locator("#memory [data-recall='with']:visible").count() == 0  # no host tier without recall
    assert page.locator("#timeline .lane-host").first.bounding_box()["height"] == 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#memory").screenshot(path=str(ARTIFACTS / "dashboard-memory.png"))

    # a reload keeps the session, and draws its memory again
    session_line = page.text_content("#session-line")
    page.reload()
    page.wait_for_selector(f"#session-line:text-is('{session_line}')")
    page.wait_for_function("document.querySelectorAll('#timeline .span[data-held=none]').length > 0")
    assert field(page, "frames_ingested") == "40"


def test_the_conversation_survives_a_reload_newest_first(page):
    create_session(page)
    assert page.is_hidden("#history-order")  # no answers, no order to tell
    upload(page, sample_video("carphone_pristine.mp4"))
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    first = ask(page, "What is first?")
    first_answer = first.locator(".answer").text_content()
    page.fill("#question", "What is second?")
    page.press("#question", "Enter")
    page.wait_for_function("document.querySelectorAll(\"#history li.qa[data-state='done']\").length === 2")
    second_answer = page.locator("#history li.qa").first.locator(".answer").text_content()
    assert page.text_content("#history-order") == "Newest first"

    page.reload()
    page.wait_for_function("document.querySelectorAll(\"#history li.qa[data-state='done']\").length === 2")
    items = page.locator("#history li.qa")
    assert items.locator(".question").all_text_contents() == ["What is second?", "What is first?"]
    assert items.locator(".answer").all_text_contents() == [second_answer, first_answer]
    assert items.nth(1).locator(".evidence .chip").count() >= 1
    assert items.nth(1).locator(".meta").text_content().startswith("at 3.0 s of video")
    assert page.is_visible("#history-order") and page.is_hidden("#history-empty")
    assert page.is_hidden("#error")
    screenshot(page, "dashboard-reloaded-conversation.png")


def place(span: dict) -> str:
    """Where a span's frame tokens are, by the memory report: device, host, dropped, part, empty."""
    dropped = span["frame_seen"] - span["frame_held"] - span["frame_host"]
    places = [name for name, n in (("device", span["frame_held"]), ("host", span["frame_host"]), ("dropped", dropped)) if n > 0.05]
    return "empty" if span["frame_seen"] == 0 else places[0] if len(places) == 1 else "part"


def test_with_recall_the_memory_view_shows_device_host_and_dropped_seconds_and_what_an_answer_recalled(page, stack):
    page.wait_for_selector("#model option[value='tiny-random-llava']", state="attached")
    page.select_option("#policy", "full")
    assert page.is_disabled("#recall") and not page.is_checked("#recall")  # nothing is evicted, so nothing to recall
    page.select_option("#policy", "sliding")
    assert page.is_checked("#recall")  # on again for a policy that evicts: the default
    page.get_by_label("Recall").uncheck()
    assert page.is_hidden("#host-budget")
    page.get_by_label("Recall").check()
    assert page.get_attribute("#host-budget", "placeholder") == "8 × budget"  # the budget is the model's
    page.fill("#budget", "8192")
    assert page.get_attribute("#host-budget", "placeholder") == "65,536 (8 × budget)"
    page.fill("#budget", "")
    # 40 frames of 16 tokens (and 7 of text) in a 256-token budget: the latest seconds stay on the
    # device, 256 tokens evicted wait in the host tier, the rest are dropped
    create_session(page, policy="sliding", budget=256, fps=4, recall=True, host_budget=256)
    assert page.text_content("#setup [data-field='recall']") == "on · 256-token host tier"
    upload(page, sample_video("bikes.mp4"))
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    saved = page.evaluate("JSON.parse(sessionStorage.getItem('streamvqa.session'))")
    auth = {"Authorization": f"Bearer {saved['token']}"}
    memory = httpx.get(f"{stack.url}/sessions/{saved['id']}/memory", headers=auth).json()  # as is until a question
    spans = memory["spans"]
    states = [place(span) for span in spans]
    assert len(states) == 10 and "dropped" in states and states[-1] == "device", states
    assert set(states[states.index("device") :]) <= {"device", "part"}, states  # sliding: the latest stay on the device

    page.wait_for_function(
        "states => [...document.querySelectorAll('#timeline .span')].map(s => s.dataset.state).join() === states.join()",
        arg=states,
    )
    columns = page.locator("#timeline .span")
    host = max(range(len(spans)), key=lambda i: spans[i]["frame_host"])  # the second the host tier holds most of
    seen, kept = spans[host]["frame_seen"], round(spans[host]["frame_host"])
    assert kept > 0 and spans[host]["frame_held"] == 0
    assert f"frames: {seen} tokens: 0 on the device, {kept} in the host tier, {seen - kept} dropped" in (
        columns.nth(host).get_attribute("title")
    )
    gone = states.index("dropped")
    assert f"frames: {spans[gone]['frame_seen']} tokens: 0 on the device, 0 in the host tier, {spans[gone]['frame_seen']} dropped" in (
        columns.nth(gone).get_attribute("title")
    )
    host_fill = columns.nth(host).locator(".lane-frames .lane-host")
    page.wait_for_function(  # the host fill covers its share of the lane, once its transition ends
        "([fill, share]) => Math.abs(fill.offsetHeight - share * fill.parentElement.offsetHeight) <= 1",
        arg=[host_fill.element_handle(), kept / seen],
    )
    assert "rgb(13, 148, 136)" in host_fill.evaluate("fill => getComputedStyle(fill).backgroundImage")  # striped teal

    seconds = {state: states.count(state) for state in ("device", "host", "dropped", "part")}
    summary = page.text_content("#memory-summary")
    assert f"host tier {memory['host_tokens']} of 256 tokens, " in summary, summary
    assert (
        f"{seconds['device']} s on the device, {seconds['host']} s in the host tier, "
        f"{seconds['dropped']} s dropped, {seconds['part']} s split"
    ) in summary, summary
    assert page.text_content("[data-memory='host_tokens']") == f"{memory['host_tokens']} / 256"
    assert re.fullmatch(r"\d+ KB", page.text_content("[data-memory='host_bytes']"))
    assert page.is_visible(".timeline-legend :text('Host tier')") and page.is_hidden(".timeline-legend :text('Evicted')")

    page.fill("#question", "What was there at the start?")
    page.press("#question", "Enter")
    page.wait_for_selector("#history li.qa[data-state='done']")
    chips = page.locator("#history li.qa .recalled .chip")
    assert chips.count() >= 1 and page.is_visible("#history li.qa .recalled:has-text('Recalled from host')")
    recalled = set()
    for chip in chips.all():
        start, end = int(chip.get_attribute("data-start")), int(chip.get_attribute("data-end"))
        assert chip.text_content() == f"0:{start:02d}–0:{end:02d}"
        recalled |= set(range(start, end))
    assert recalled <= {i for i, span in enumerate(spans) if span["frame_host"] or span["text_host"]}, recalled
    marked = page.eval_on_selector_all("#timeline .span[data-recalled]", "spans => spans.map(s => Number(s.dataset.start))")
    assert set(marked) == recalled
    screenshot(page, "dashboard-recall.png")

    chips.first.focus()  # a recalled range is a button: it shows its start in the preview
    page.keyboard.press("Enter")
    page.wait_for_function(f"Math.abs(document.querySelector('#preview').currentTime - {min(recalled)}) < 0.05")
    assert page.is_hidden("#error")


def test_an_upload_that_is_not_a_video_shows_the_sessions_error(page, tmp_path):
    create_session(page)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video\n" * 100)
    upload(page, notes)
    page.wait_for_selector("#session-error:has-text('not a readable video file')")
    assert field(page, "state") == "error"
    assert page.text_content("#stage-badge") == "The model could not read this video"  # not "Waiting for the model"
    assert page.is_disabled("#ask-form button[type=submit]")
    assert page.text_content("#ask-hint") == "The session failed: it takes no questions. Start a new session."
    page.get_by_role("button", name="End session", exact=True).click()  # and start again
    page.wait_for_selector("#connection:text-is('No session')")
    assert page.is_visible("#create-form") and page.is_hidden("#session-error")


def test_a_file_cut_short_is_ingested_with_a_warning_beside_the_session(page, tmp_path):
    create_session(page)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(cut_before_frame(faststart_mp4(10.0, tmp_path / "whole.mp4"), 50))  # 5 of its 10 s
    upload(page, cut)
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    page.wait_for_selector("#session-warnings [data-code='truncated_media']")
    assert page.text_content("#session-warnings") == (
        "Incomplete file: the file ends after 5.0 s of the 10.0 s it states (it was cut short, as by a download or "
        "copy that stopped part-way): 5 frames were ingested, up to 4.0 s; upload the whole file to a new session "
        "for the rest."
    )
    assert page.is_visible("#session-warnings") and page.is_hidden("#session-error")
    assert field(page, "frames_ingested") == "5"
    assert page.is_enabled("#question")  # what it has can be asked about
    screenshot(page, "dashboard-cut-short.png")
    page.reload()  # the warning is the session's: it is there again after a reload
    page.wait_for_selector("#session-warnings [data-code='truncated_media']")


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


def test_the_cache_plot_is_drawn_to_the_caches_scale_and_the_same_after_a_reload(page):
    create_session(page)  # the default budget, 8,192 tokens
    upload(page, sample_video("bikes.mp4"))
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')")
    assert field(page, "cache_tokens") == "379 / 8,192"  # 10 frames and the text around them
    page.wait_for_function("document.querySelector('[data-plot=seen]').textContent === '379'")
    page.wait_for_function("Number(document.querySelector('#cache-plot').dataset.points) >= 2")

    # the scale is the cache's, not the budget's: 379 tokens on an axis to 500, the budget said above it
    assert page.get_attribute("#cache-plot", "data-y-max") == "500"
    assert page.locator("#cache-plot .plot-labels text").first.text_content() == "500"
    assert page.text_content("#cache-plot .plot-above") == "↑ budget 8,192 (above the scale)"
    held = [tuple(map(float, xy.split(","))) for xy in page.get_attribute("#cache-plot .plot-held", "points").split()]
    assert held[-1][1] < 10 + 110 * 0.25  # the last point in the top quarter of the plot (10 px pad, 110 px tall)
    points = page.get_attribute("#cache-plot .plot-held", "points")
    drawn = page.get_attribute("#cache-plot", "data-points")

    page.reload()
    page.wait_for_selector("#connection[data-state='live']")
    page.wait_for_function("document.querySelector('[data-plot=seen]').textContent === '379'")
    assert page.get_attribute("#cache-plot", "data-points") == drawn
    assert page.get_attribute("#cache-plot .plot-held", "points") == points  # the same line, point for point
    assert page.text_content("[data-plot='held']") == "379"
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#memory").screenshot(path=str(ARTIFACTS / "dashboard-plot-reloaded.png"))

    page.get_by_role("button", name="End session", exact=True).click()  # an ended session's points go from the tab
    page.wait_for_selector("#create-form:not([hidden])")
    assert page.evaluate("Object.keys(sessionStorage).filter((key) => key.startsWith('streamvqa.plot.'))") == []


# The plot's legend and the session's state, every 50 ms, until the session is ingested (at most 90 s).
SAMPLE_LEGEND = """() => new Promise((resolve) => {
  const samples = [];
  const text = (selector) => document.querySelector(selector).textContent;
  const timer = setInterval(() => {
    const state = text("#status [data-field='state']");
    samples.push([state, text("[data-plot=held]"), text("[data-plot=seen]")]);
    if (state === "ingested" || samples.length >= 1800) {
      clearInterval(timer);
      resolve(samples);
    }
  }, 50);
})"""


def test_the_plot_legend_never_shows_fewer_tokens_seen_than_held_while_a_file_is_ingested(page, tmp_path):
    video = tmp_path / "long.mp4"
    faststart_mp4(90, video)  # at 4 frames/s: 360 frames, seconds of ingest
    create_session(page, fps=4)
    upload(page, video)
    page.wait_for_selector("#status [data-field='state']:has-text('ingesting')")
    samples = page.evaluate(SAMPLE_LEGEND)
    assert samples[-1][0] == "ingested"

    def tokens(text: str) -> int | None:
        return None if text == "–" else int(text.replace(",", ""))

    shown = [(tokens(held), tokens(seen)) for state, held, seen in samples if held != "–"]
    assert sum(state == "ingesting" for state, _, _ in samples) >= 40  # seconds of ingest, sampled every 50 ms
    below = [(held, seen) for held, seen in shown if seen is None or seen < held]
    assert below == [], f"{len(below)} of {len(shown)} samples show fewer tokens seen than held, e.g. {below[:5]}"


# Elements that cut what they hold: clipped (overflow other than visible) and wider inside than
# out, with text of their own; the visually hidden labels are meant to be clipped.
CUT_LABELS = """() => [...document.querySelectorAll('body *')].filter((e) => {
  if (!e.getClientRects().length || e.closest('.visually-hidden')) return false;
  const style = getComputedStyle(e);
  if (style.overflowX === 'visible' && style.textOverflow !== 'ellipsis') return false;
  if (!e.textContent.trim() || ['TEXTAREA', 'SELECT', 'INPUT'].includes(e.tagName)) return false;
  return e.scrollWidth > e.clientWidth + 1;
}).map((e) => `${e.tagName}#${e.id}.${e.className}: ${e.textContent.trim().slice(0, 40)}`)"""


def test_no_label_is_cut_at_1280_or_1400_px_and_a_long_upload_says_its_time_left(launch, tmp_path):
    video = tmp_path / "long.mp4"
    faststart_mp4(90, video)  # at 4 frames/s: 360 frames, thousands of tokens, seconds of ingest
    page = launch(viewport=(1400, 900))
    create_session(page, fps=4)
    upload(page, video)
    page.wait_for_selector("#status [data-field='state']:has-text('ingesting')")
    page.wait_for_function("/^About \\d+:\\d\\d left$/.test(document.querySelector('#ingest-eta').textContent)")
    assert re.fullmatch(r"Ingesting · \d+\.\d s", page.text_content("#ingest-label"))
    for width in (1400, 1280):
        page.set_viewport_size({"width": width, "height": 900})
        assert page.evaluate(CUT_LABELS) == [], width
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(page, f"dashboard-ingesting-{width}.png")
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')", timeout=120_000)
    assert (page.text_content("#ingest-percent"), page.text_content("#ingest-eta")) == ("100%", "")
    assert page.text_content("#ingest-label") == "Ingested · 360 frames"
    assert re.fullmatch(r"[\d,]+ / 8,192", field(page, "cache_tokens")) and "," in field(page, "cache_tokens")
    for width in (1280, 1400):
        page.set_viewport_size({"width": width, "height": 900})
        assert page.evaluate(CUT_LABELS) == [], width
        screenshot(page, f"dashboard-ingested-{width}.png")


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


def demo_state(page) -> dict:
    """What a stalled demo was doing: the session's fields, the source's status, the stage's video."""
    fields = ("state", "frames_ingested", "frames_dropped", "video_time_s", "ingest_lag_s", "cache_tokens")
    return {
        **{name: field(page, name) for name in fields},
        "source": page.text_content("#source-status"),
        "connection": page.get_attribute("#connection", "data-state"),
        "video": page.evaluate(
            "[...document.querySelectorAll('video')].map((v) => [v.readyState, v.paused, v.currentTime, v.videoWidth])"
        ),
    }


def test_the_demo_streams_the_samples_into_a_256_token_cache_and_shows_it_evict(page):
    page.wait_for_selector("#model option[value='tiny-random-llava']", state="attached")
    page.get_by_role("button", name="Try the demo").click()
    page.wait_for_selector("#connection[data-state='live']")
    assert page.text_content("#setup [data-field='policy']") == "infmllm"
    assert page.text_content("#setup [data-field='budget_tokens']") == "256 tokens"
    assert page.text_content("#setup [data-field='fps']") == "2 frames/s"
    page.wait_for_selector("#stage-badge:text-is('● Live · demo · clip 1 of 9')")  # 3 samples, 3 times over
    page.wait_for_selector("#source-status:has-text('Streaming at 2 frames/s')")

    # 23 tokens a frame (16 of frame, 7 of text), 2 frames a second: the cache is full within 6 s
    # of video, and from then on what it no longer holds shows as partly or wholly evicted seconds
    try:
        page.wait_for_selector("#timeline .span:is([data-held='part'], [data-held='none'])", state="attached", timeout=60_000)
    except Exception as err:  # say what the session and the page were doing
        raise AssertionError(f"no eviction shown within 60 s: {demo_state(page)}") from err
    page.wait_for_function("Number(document.querySelector('[data-plot=seen]').textContent.replace(',', '')) >= 512")
    assert field(page, "cache_tokens") == "256 / 256"
    assert int(page.text_content("[data-memory='evictions']")) > 0
    label = page.get_attribute("#timeline", "aria-label")  # the demo recalls: what it evicts goes to the host tier
    seconds = re.search(r"(\d+) s in the host tier, (\d+) s dropped, (\d+) s split$", label)
    assert seconds and sum(map(int, seconds.groups())) >= 1, label

    # the plot: the held line rose to the budget and lies on it, while the seen line goes on above
    assert int(page.get_attribute("#cache-plot", "data-points")) >= 3
    assert page.text_content("[data-plot='held']") == "256" and page.text_content("[data-plot='budget']") == "256"
    assert re.fullmatch(
        r"Cache over video time: 256 tokens held of a 256-token budget at \d+\.\d s; [\d,]+ tokens seen so far",
        page.get_attribute("#cache-plot", "aria-label"),
    )
    budget_y = float(page.get_attribute("#cache-plot .plot-budget", "y1"))
    held = [tuple(map(float, xy.split(","))) for xy in page.get_attribute("#cache-plot .plot-held", "points").split()]
    seen = [tuple(map(float, xy.split(","))) for xy in page.get_attribute("#cache-plot .plot-seen", "points").split()]
    assert held[0][1] > budget_y and held[-1][1] == budget_y, (held, budget_y)  # below the budget, then on it
    assert seen[-1][1] < budget_y, (seen, budget_y)  # above it
    screenshot(page, "dashboard-demo.png")

    page.get_by_role("button", name="Stop the demo").click()
    page.wait_for_selector("#source-status:has-text('Stream ended')")
    assert field(page, "state") == "ingested"
    assert page.text_content("#stage-empty") == "The demo is over. The session keeps what the model saw: ask away."
    assert page.is_hidden("#demo-controls") and page.is_hidden("#error")


@pytest.fixture(scope="module")
def two_each(redis_url, tmp_path_factory):
    """A gateway that lets each caller (here: each address) hold two sessions, and lists and ends
    a session only with its token (the default)."""
    with running_stack(redis_url, tmp_path_factory.mktemp("two-each"), MAX_SESSIONS_PER_KEY="2", MAX_SESSIONS="64") as stack:
        yield stack


@pytest.fixture(scope="module")
def two_each_by_address(redis_url, tmp_path_factory):
    """Two sessions each address, and an address owns its sessions (ADDRESS_OWNS_SESSIONS)."""
    with running_stack(
        redis_url, tmp_path_factory.mktemp("two-each-by-address"), MAX_SESSIONS_PER_KEY="2", MAX_SESSIONS="64",
        ADDRESS_OWNS_SESSIONS="true",
    ) as stack:
        yield stack


def wait_for_note(page, text: str) -> None:
    """Until the note over "Your sessions" reads `text` (else it fails with what it read)."""
    try:
        page.wait_for_function(f"document.querySelector('#sessions-note').textContent === {text!r}")
    except Exception as err:  # playwright's TimeoutError
        raise AssertionError(f"the note reads {page.text_content('#sessions-note')!r}, not {text!r}") from err


def owned_rows(page) -> list[tuple[str, str]]:
    """The rows of "Your sessions": (the id's first 8 digits, the state)."""
    rows = page.locator("#session-list li")
    return [(row.locator(".owned-id").text_content(), row.locator(".owned-state").text_content()) for row in rows.all()]


def test_your_sessions_lists_and_ends_the_sessions_this_browser_made_by_their_tokens(launch, two_each, tmp_path):
    elsewhere = Client(two_each.url)  # from the page's address, through the API: the page has not its token
    assert elsewhere.create().status_code == 201
    page = launch(url=two_each.url)
    wait_for_note(page, "1 of 2 in use, 1 not listed")
    assert owned_rows(page) == [] and page.text_content("#sessions-empty") == "None: a session you create here shows here."

    page.get_by_role("button", name="Try the demo").click()  # the demo's session is the page's, by its token
    page.wait_for_selector("#connection[data-state='live']")
    demo_id = page.get_attribute("#session-line", "title")
    page.wait_for_selector(f"#session-list li[data-id='{demo_id}'][data-current='true']")
    wait_for_note(page, "2 of 2 in use, 1 not listed")
    tab = page.context.new_page()  # another tab of this browser lists it too
    tab.goto(two_each.url)
    tab.wait_for_selector(f"#session-list li[data-id='{demo_id}'][data-current='false']")
    tab.close()
    demo_token = page.evaluate(f"JSON.parse(localStorage.getItem('streamvqa.tokens'))[{demo_id!r}]")

    page.get_by_role("button", name=f"End session {demo_id[:8]}").click()  # with its token
    page.wait_for_selector("#create-form:not([hidden])")
    wait_for_note(page, "1 of 2 in use, 1 not listed")
    assert httpx.get(f"{two_each.url}/sessions/{demo_id}", headers={"Authorization": f"Bearer {demo_token}"}).status_code == 404
    assert elsewhere.get().status_code == 200  # not the page's to end

    second = Client(two_each.url)
    assert second.create().status_code == 201
    page.get_by_role("button", name="Create session", exact=True).click()
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error-text") == (
        "Could not create a session: you hold as many sessions as the server allows. "
        "End one under “Your sessions”, then try again."
    )
    wait_for_note(page, "2 of 2 in use, 2 not listed")
    second.delete()
    elsewhere.delete()

    create_session(page)  # one that fails stays listed, and ends by its token too
    mine = page.get_attribute("#session-line", "title")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video\n" * 100)
    upload(page, notes)
    page.wait_for_selector(f"#session-list li[data-id='{mine}'][data-state='error']")
    wait_for_note(page, "0 of 2 in use")
    page.get_by_role("button", name=f"End session {mine[:8]}").click()
    page.wait_for_selector("#sessions-empty:not([hidden])")
    page.wait_for_function("Object.keys(JSON.parse(localStorage.getItem('streamvqa.tokens'))).length === 0")  # forgotten


def test_where_an_address_owns_its_sessions_your_sessions_lists_and_ends_them_api_demo_and_failed_ones_too(
    launch, two_each_by_address,
):
    two_each = two_each_by_address
    # from the page's address, through the API: one session that failed and one that did not
    failed, first = Client(two_each.url), Client(two_each.url)
    assert failed.create().status_code == 201 and first.create().status_code == 201
    failed.wait_for_state("ready")
    assert failed.upload(b"not a video at all" * 100).status_code == 202
    failed.wait_for_state("error")

    page = launch(url=two_each.url)
    page.wait_for_selector("#session-list li >> nth=1")
    assert owned_rows(page) == [(first.id[:8], "ready"), (failed.id[:8], "error")]
    assert page.text_content("#sessions-note") == "1 of 2 in use"  # a failed session does not count
    assert page.get_attribute("#session-list li >> nth=1 >> .owned-state", "title")  # why it failed

    page.get_by_role("button", name="Try the demo").click()  # the demo's session is one of them
    page.wait_for_selector("#connection[data-state='live']")
    demo_id = page.get_attribute("#session-line", "title")
    page.wait_for_selector("#session-list li >> nth=2")
    assert [short for short, _ in owned_rows(page)] == [demo_id[:8], first.id[:8], failed.id[:8]]
    assert page.get_attribute("#session-list li >> nth=0", "data-current") == "true"
    assert re.fullmatch(
        r"tiny-random-llava · created \d\d:\d\d:\d\d · this page", page.text_content("#session-list li >> nth=0 >> .owned-meta")
    )
    assert page.text_content("#sessions-note") == "2 of 2 in use"

    page.get_by_role("button", name=f"End session {demo_id[:8]}").click()  # its own: the page lets it go
    page.wait_for_selector("#create-form:not([hidden])")
    assert page.text_content("#connection") == "No session" and page.is_hidden("#demo-controls")
    page.wait_for_function("document.querySelectorAll('#session-list li').length === 2")
    # the row goes at once; the count is the server's, once its deletion is done (a moment later under load)
    page.wait_for_function("document.querySelector('#sessions-note').textContent === '1 of 2 in use'")

    second = Client(two_each.url)
    assert second.create().status_code == 201  # through the API again: two that count
    page.get_by_role("button", name="Create session", exact=True).click()
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error-text") == (
        "Could not create a session: you hold as many sessions as the server allows. "
        "End one under “Your sessions”, then try again."
    )
    page.wait_for_function("document.querySelectorAll('#session-list li').length === 3")
    assert [short for short, _ in owned_rows(page)] == [second.id[:8], first.id[:8], failed.id[:8]]
    screenshot(page, "dashboard-sessions-full.png")

    page.get_by_role("button", name=f"End session {first.id[:8]}").click()
    page.wait_for_function("document.querySelectorAll('#session-list li').length === 2")
    assert first.get().status_code == 404  # ended without its token
    create_session(page)
    page.wait_for_selector("#session-list li[data-current='true']")
    mine = page.get_attribute("#session-line", "title")
    assert [short for short, _ in owned_rows(page)] == [mine[:8], second.id[:8], failed.id[:8]]
    assert page.text_content("#sessions-note") == "2 of 2 in use"

    page.get_by_role("button", name=f"End session {failed.id[:8]}").click()
    page.wait_for_function("document.querySelectorAll('#session-list li').length === 2")
    assert failed.get().status_code == 404
    assert page.is_visible("#session-summary")  # the page's own session goes on
    screenshot(page, "dashboard-sessions.png")
    second.delete()
    httpx.delete(f"{two_each.url}/sessions/{mine}")


# When (ms after it began) the page's own session first showed each state in its status and in
# its row of "Your sessions", looked at every 20 ms until the row has shown `until` (at most 30 s):
# a promise kept in `window.ownRow`.
WATCH_OWN_ROW = """(until) => { window.ownRow = new Promise((resolve) => {
  const began = performance.now();
  const first = {};
  const timer = setInterval(() => {
    const now = performance.now() - began;
    const status = document.querySelector("#status [data-field='state']").textContent;
    const row = document.querySelector("#session-list li[data-current='true'] .owned-state")?.textContent;
    first[`status ${status}`] ??= now;
    if (row) first[`row ${row}`] ??= now;
    if (`row ${until}` in first || now > 30000) {
      clearInterval(timer);
      resolve(first);
    }
  }, 20);
}); }"""


def test_the_pages_own_row_in_your_sessions_follows_its_state_and_its_end_at_once(page):
    create_session(page, fps=4)
    mine = page.get_attribute("#session-line", "title")
    page.wait_for_selector(f"#session-list li[data-id='{mine}'][data-current='true']", timeout=1000)
    page.wait_for_selector("#status [data-field='state']:text-is('ready')")
    page.wait_for_selector("#session-list li[data-current='true'] .owned-state:text-is('ready')", timeout=1000)
    page.evaluate(WATCH_OWN_ROW, "ingested")
    upload(page, sample_video("bikes.mp4"))  # 40 frames at 4 frames/s: seconds of ingest
    first = page.evaluate("() => window.ownRow")
    for state in ("ingesting", "ingested"):  # the row shows each state within a second of the status
        assert first.get(f"row {state}", float("inf")) - first[f"status {state}"] < 1000, first

    page.get_by_role("button", name="End session", exact=True).click()
    page.wait_for_selector(f"#session-list li[data-id='{mine}']", state="detached", timeout=1000)
    create_session(page)
    again = page.get_attribute("#session-line", "title")
    page.wait_for_selector(f"#session-list li[data-id='{again}'][data-current='true']", timeout=1000)
    assert page.locator(f"#session-list li[data-id='{mine}']").count() == 0


def test_the_sample_videos_are_served_by_name_and_nothing_else(stack):
    listed = httpx.get(f"{stack.url}/samples").json()["samples"]
    assert [(s["name"], s["bytes"], s["url"]) for s in listed] == [
        ("bikes.mp4", 509868, "/samples/bikes.mp4"),
        ("bigbuckbunny.mp4", 1055736, "/samples/bigbuckbunny.mp4"),
        ("carphone_pristine.mp4", 588804, "/samples/carphone_pristine.mp4"),
    ]
    video = httpx.get(f"{stack.url}/samples/bikes.mp4")
    assert (video.status_code, video.headers["content-type"], video.content) == (
        200, "video/mp4", sample_video("bikes.mp4").read_bytes()
    )
    for name in ("carphone_distorted.mp4", "README.md", "__init__.py", "bikes.mp4.bak"):
        missing = httpx.get(f"{stack.url}/samples/{name}")
        assert (missing.status_code, missing.json()["code"]) == (404, "sample_not_found"), name
        assert missing.json()["message"] == (
            "no such sample video; the samples served: bikes.mp4, bigbuckbunny.mp4, carphone_pristine.mp4"
        )
    outside = httpx.get(f"{stack.url}/samples/..%2F..%2F__init__.py")  # a path, not a name: no route at all
    assert (outside.status_code, outside.json()["code"]) == (404, "not_found")


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


def test_the_api_pages_render_every_operation_with_no_network(page, stack):
    operations = sum(len(methods) for methods in httpx.get(f"{stack.url}/openapi.json").json()["paths"].values())
    elsewhere = []

    def local_only(route):
        if route.request.url.startswith(stack.url):
            route.continue_()
        else:  # a CDN: there is none to reach
            elsewhere.append((route.request.resource_type, route.request.url))
            route.abort()

    page.route("**/*", local_only)
    page.goto(f"{stack.url}/docs")
    page.wait_for_function(f"document.querySelectorAll('.opblock').length === {operations}")
    assert page.locator(".opblock-summary-path", has_text="/v1/chat/completions").count() == 1
    page.goto(f"{stack.url}/redoc")
    page.wait_for_function(f"document.querySelectorAll('[data-section-id^=\"operation/\"]').length === {operations}")
    # every script and style sheet is the gateway's; only ReDoc's footer asks for its maker's logo
    assert [url for kind, url in elsewhere if kind != "image"] == []
    screenshot(page, "api-docs.png")

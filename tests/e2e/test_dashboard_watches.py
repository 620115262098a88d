"""Watches in the dashboard, in real headless Chromium against a real gateway and worker: a watch
added beside the question box fires as the file is ingested, shows as a mark on the memory
timeline that seeks the preview, comes back after a reload, and goes when removed; the API's
refusals are shown as its other errors are.

The tiny random model's p(yes) is arbitrary but never near 0: a threshold of 1e-6 makes a
condition that holds at every check, so that the watch fires once, at its first check
(tests/app/test_watches.py)."""

import httpx
import pytest

from tests.e2e.dashboard import create_session, screenshot, upload
from tests.support import sample_video

ALWAYS = "0.000001"
CONDITION = "a bike is visible"
INGEST_MS = 90_000  # a 10-s file on a loaded 2-core machine

# The Notification API as the page sees it where the user allows notifications: what it was asked
# and what it showed, kept on the window for the test to read.
NOTIFICATIONS = """
window.notificationsAsked = 0;
window.notificationsShown = [];
window.Notification = class {
  static permission = "default";
  static async requestPermission() {
    window.notificationsAsked += 1;
    this.permission = "granted";
    return "granted";
  }
  constructor(title, options) { window.notificationsShown.push({ title, body: options.body }); }
  close() {}
};
"""


def add_watch(page, condition: str, every_s: str | None = None, threshold: str | None = None) -> None:
    if every_s is not None:
        page.fill("#watch-every", every_s)
    if threshold is not None:
        page.fill("#watch-threshold", threshold)
    page.fill("#watch-condition", condition)
    page.press("#watch-condition", "Enter")


def session_watches(page, stack) -> list[dict]:
    saved = page.evaluate("JSON.parse(sessionStorage.getItem('streamvqa.session'))")
    auth = {"Authorization": f"Bearer {saved['token']}"}
    return httpx.get(f"{stack.url}/sessions/{saved['id']}/watches", headers=auth).json()["watches"]


def test_a_watch_fires_as_a_mark_on_the_timeline_that_seeks_the_video_and_goes_when_removed(page, stack):
    page.add_init_script(NOTIFICATIONS)
    page.reload()
    assert page.is_disabled("#watch-condition")  # no session yet
    create_session(page)  # 1 frame/s
    assert page.input_value("#watch-every") == "2"  # 2 s: more than the frame interval
    add_watch(page, CONDITION, threshold=ALWAYS)
    page.wait_for_selector("#watch-list li.watch")
    assert page.text_content("#watch-list .watch-meta") == "every 2 s · p(yes) ≥ 0.000001 · not fired yet"
    assert page.input_value("#watch-condition") == ""
    assert page.evaluate("window.notificationsAsked") == 1  # asked at the first watch

    upload(page, sample_video("bikes.mp4"))  # 10 s: frames at 0..9 s
    mark = page.locator("#watch-marks .watch-mark")
    mark.first.wait_for(state="attached", timeout=INGEST_MS)
    page.wait_for_selector("#status [data-field='state']:has-text('ingested')", timeout=INGEST_MS)
    page.wait_for_function("document.querySelectorAll('#timeline .span').length === 10")  # the timeline is 10 s

    (watch,) = session_watches(page, stack)
    assert len(watch["fired"]) == 1  # it holds at every check, so it fired once, at its first
    fired_s = watch["fired"][0]["time_s"]
    assert fired_s == pytest.approx(2.0, abs=0.01)  # set before the upload: checked from its first frames, at 2 s
    assert mark.count() == 1
    assert float(mark.get_attribute("data-time")) == pytest.approx(fired_s)
    timeline, box = page.locator("#timeline").bounding_box(), mark.bounding_box()
    assert (box["x"] + box["width"] / 2 - timeline["x"]) / timeline["width"] == pytest.approx(fired_s / 10, abs=0.01)

    seen = sorted(e["time_s"] for e in watch["fired"][0]["evidence"])  # what the check that fired attended to
    assert seen and all(0.0 <= t <= fired_s for t in seen)
    shown = f"“{CONDITION}” at {fired_s:.1f} s of video · seen at " + ", ".join(f"{t:.1f} s" for t in seen)
    assert page.text_content("#watch-toast-text") == f"Watch fired: {shown}"
    assert page.is_visible("#watch-toast")
    assert page.evaluate("window.notificationsShown") == [{"title": "Watch fired", "body": shown}]
    assert page.text_content("#watch-list .watch-meta") == (
        f"every 2 s · p(yes) ≥ 0.000001 · 1 firing, last at {fired_s:.1f} s"
    )
    screenshot(page, "dashboard-watch-fired.png")

    page.get_by_role("button", name="Dismiss the watch's message").click()
    assert page.is_hidden("#watch-toast")

    # the mark shows its moment in the preview, as an evidence chip does
    page.wait_for_function("document.querySelector('#preview').readyState >= 1")
    mark.click()
    page.wait_for_function(
        f"Math.abs(document.querySelector('#preview').currentTime - {fired_s}) < 0.05 "
        "&& document.querySelector('#preview').paused"
    )

    # a reload draws the firing again, from the API
    page.reload()
    page.wait_for_selector("#watch-list li.watch[data-fired='1']")
    mark.first.wait_for(state="attached")
    assert float(mark.get_attribute("data-time")) == pytest.approx(fired_s)
    # the file is all in: a new watch would never be checked, so none is taken
    page.wait_for_selector("#watch-hint[data-refused='true']")
    assert page.text_content("#watch-hint") == (
        "The file is all in: a watch added now would have no video left to check. Add watches before uploading."
    )
    assert page.is_disabled("#watch-condition") and page.is_disabled("#watch-form button[type=submit]")

    page.get_by_role("button", name=f"Remove the watch “{CONDITION}”").click()
    page.wait_for_selector("#watch-list li.watch", state="detached")
    assert mark.count() == 0
    assert session_watches(page, stack) == []
    assert page.is_hidden("#error")


def test_a_bad_watch_and_a_ninth_are_refused_with_the_servers_reason(page):
    create_session(page)  # 1 frame/s
    add_watch(page, "a bike is visible", every_s="0.5")
    page.wait_for_selector("#error:has-text('Could not add the watch: ')")
    assert page.text_content("#error-text") == (
        "Could not add the watch: body.every_s: at least the session's frame interval, 1 s (its fps is 1)"
    )
    assert page.input_value("#watch-condition") == "a bike is visible"  # kept, to be corrected
    page.get_by_role("button", name="Dismiss the message").click()

    for n in range(1, 9):
        add_watch(page, f"condition {n}", every_s="2")
        page.wait_for_function(f"document.querySelectorAll('#watch-list li.watch').length === {n}")
    assert page.is_hidden("#error")
    add_watch(page, "condition 9")
    page.wait_for_selector("#error:has-text('Could not add the watch: ')")
    assert page.text_content("#error-text") == (
        "Could not add the watch: the session has 8 watches (MAX_WATCHES_PER_SESSION); delete one first"
    )
    assert page.locator("#watch-list li.watch").count() == 8
    screenshot(page, "dashboard-watches-full.png")

    # one removed, the ninth goes in
    page.get_by_role("button", name="Dismiss the message").click()
    page.get_by_role("button", name="Remove the watch “condition 1”").click()
    page.wait_for_function("document.querySelectorAll('#watch-list li.watch').length === 7")
    page.press("#watch-condition", "Enter")
    page.wait_for_selector("#watch-list li.watch:last-child .watch-condition:text-is('condition 9')")
    assert page.locator("#watch-list li.watch").count() == 8
    assert page.is_hidden("#error")

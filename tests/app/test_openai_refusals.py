"""Media the worker refuses, sent in OpenAI `messages` to a real gateway, worker and Redis: a 400
within seconds naming the reason, for every request that sent or waited for it and for each
retry; a session made for it leaves at once."""

import asyncio
import io
import time

import httpx
import pytest
from PIL import Image

from tests.media import data_url, jpeg
from tests.support import live_session_ids

MODEL = "tiny-random-llava"
PARAM = {"image": "messages.1.content.1.image_url.url", "video": "messages.1.content.1.video_url.url"}
SOON_S = 10  # a refusal comes within this (the worker decodes a frame, or probes a file, in well under a second)


def huge_png() -> bytes:
    """An 8000x4000 PNG of one colour: 30 KB that would take 96 MB decoded."""
    buffer = io.BytesIO()
    Image.new("RGB", (8000, 4000), (40, 90, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def truncated_jpeg() -> bytes:
    whole = jpeg(7, (640, 480))
    return whole[: len(whole) // 2]


# kind -> (media, type, the reason the 400 gives after "the <kind> cannot be read: ")
REFUSED = {
    "huge png": ("image", huge_png(), "image/png", "a 8000x4000 frame is larger than the limit of 16777216 pixels"),
    "truncated jpeg": ("image", truncated_jpeg(), "image/jpeg", "the file is incomplete: it ends part-way through the "
                       "image, as a download or copy that stopped does"),
    "not a video": ("video", b"\x01\x02" * 4000, "video/mp4", "not a readable video file; supported containers: mp4, "),
}


def body(case: str, opening: str) -> dict:
    """A request with the case's media, under a system message of its own (so, a session of its own)."""
    kind, data, media_type, _ = REFUSED[case]
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": data_url(data, media_type)}}
    messages = [{"role": "system", "content": opening}, {"role": "user", "content": [{"type": "text", "text": "What?"}, part]}]
    return {"model": MODEL, "max_tokens": 2, "messages": messages}


def assert_refused(reply: httpx.Response, case: str) -> None:
    kind, _, _, reason = REFUSED[case]
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_media", PARAM[kind], "invalid_request_error")
    assert error["message"].startswith(f"the {kind} cannot be read: {reason}"), error["message"]


@pytest.mark.parametrize("case", REFUSED)
def test_refused_media_is_a_400_within_seconds_and_so_is_each_retry(stack, case):
    before = live_session_ids(stack)
    request = body(case, f"Retried: {case}.")
    for attempt in range(3):
        started = time.monotonic()
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json=request, timeout=60)
        took_s = time.monotonic() - started
        assert_refused(reply, case)
        assert took_s < SOON_S, (attempt, took_s)
    assert live_session_ids(stack) == before  # each session made for it left at once


@pytest.mark.parametrize("case", REFUSED)
def test_the_same_refused_media_sent_three_times_at_once_is_a_400_for_each(stack, case):
    """One request sends it; the others wait for the same session: each hears the refusal, none a 404."""
    request = body(case, f"At once: {case}.")

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=request) for _ in range(3)))

    started = time.monotonic()
    replies = asyncio.run(together())
    assert time.monotonic() - started < SOON_S
    for reply in replies:
        assert_refused(reply, case)


def test_a_refused_image_sent_to_a_named_session_is_a_400_and_the_session_stays(stack):
    made = httpx.post(f"{stack.url}/sessions", json={}).json()
    auth = {"Authorization": f"Bearer {made['token']}"}
    request = {**body("huge png", "unused"), "session_id": made["id"]}
    request["messages"] = request["messages"][1:]  # no system message: the session's own opening
    for _ in range(2):
        started = time.monotonic()
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json=request, headers=auth, timeout=60)
        assert time.monotonic() - started < SOON_S
        assert reply.status_code == 400 and reply.json()["error"]["message"] == (
            "the image cannot be read: a 8000x4000 frame is larger than the limit of 16777216 pixels"
        ), reply.text
        assert reply.json()["error"]["param"] == "messages.0.content.1.image_url.url"
    session = httpx.get(f"{stack.url}/sessions/{made['id']}", headers=auth).json()
    assert (session["state"], session["frames_ingested"]) == ("ready", 0)  # the client's own session is not ended
    httpx.delete(f"{stack.url}/sessions/{made['id']}", headers=auth)

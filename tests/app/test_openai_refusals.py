"""Media the worker refuses, sent in OpenAI `messages` to a real gateway, worker and Redis: a 400
within seconds naming the reason, for every request that sent or waited for it and for each
retry; a session made for it leaves at once."""

import asyncio
import hashlib
import io
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from PIL import Image
from redis.asyncio import Redis
from starlette.requests import Request

from app import chat_messages
from app.chat_ingest import MEDIA_FIELD
from app.chat_media import MediaSlots
from app.chat_sessions import MADE_FIELD, ChatSessions
from app.completions import ChatCompletionRequest
from app.errors import ApiError
from app.metrics import GatewayMetrics
from app.sessions import SessionStore
from app.settings import GatewaySettings
from streamvqa.protocol import Keys
from streamvqa.redis_client import close, connect
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


def sha256_of(case: str) -> bytes:
    return hashlib.sha256(REFUSED[case][1]).hexdigest().encode()


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


class LateReply:
    """A Redis client whose reply to one command comes late, as on a loaded machine: the first
    `command` whose arguments `match` runs at once, and its reply is held until `release` is set
    (`ran` says it has run, `reply` is its reply). Every other command passes straight through."""

    def __init__(self, redis: Redis, command: str, match: Callable[..., bool] = lambda *args: True) -> None:
        self.redis, self.command, self.match = redis, command, match
        self.ran, self.release, self.reply = asyncio.Event(), asyncio.Event(), None

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.redis, name)
        if name != self.command:
            return call

        async def late(*args: Any) -> Any:
            reply = await call(*args)
            if not self.ran.is_set() and self.match(*args):
                self.reply = reply
                self.ran.set()
                await self.release.wait()
            return reply

        return late


def test_a_request_that_found_the_session_just_before_the_refusal_deleted_it_is_a_400_and_leaves_nothing(stack):
    """Two requests with the same refused image, in a gateway on the stack's Redis and worker: the
    first sends it and hears the refusal; the other reads the session (its media claimed and sent)
    just before the first deletes it, and goes on after. Each gets the refusal's 400, and no key of
    the deleted session comes back (the other's writes do not make its hash again)."""
    before = live_session_ids(stack)
    request = body("huge png", "Found late: huge png.")
    settings = GatewaySettings(redis_url=stack.redis_url, redis_prefix=stack.prefix, model=MODEL, ask_timeout_s=SOON_S)
    keys = Keys(stack.prefix)

    async def never_leaves() -> dict:
        await asyncio.Event().wait()
        return {}

    async def refused(redis: Redis | LateReply) -> ApiError:
        http = Request({"type": "http", "method": "POST", "headers": [], "client": ("127.0.0.1", 1)}, never_leaves)
        store = SessionStore(redis, keys, settings.session_ttl_s)
        chat = ChatSessions(http, store, redis, keys, settings, GatewayMetrics(), None, MediaSlots(2))
        dialogue = chat_messages.read(ChatCompletionRequest.model_validate(request).messages)
        with pytest.raises(ApiError) as refusal:
            await chat.session_for(None, dialogue, None)
        return refusal.value

    async def race() -> list[ApiError]:
        redis = connect(stack.redis_url)
        sender = LateReply(redis, "hget", lambda key, field: field == MADE_FIELD)  # just before it deletes the session
        finder = LateReply(redis, "hgetall")  # its read of the session it found for the image
        try:
            async with asyncio.timeout(2 * SOON_S):
                sending = asyncio.create_task(refused(sender))
                await sender.ran.wait()  # it sent the image, and heard the worker refuse it
                finding = asyncio.create_task(refused(finder))
                await finder.ran.wait()  # what it read: the image claimed and sent
                assert (finder.reply[b"media"], finder.reply[MEDIA_FIELD.encode()]) == (b"frames", sha256_of("huge png"))
                sender.release.set()
                first = await sending  # the session is deleted, its refusal kept
                finder.release.set()
                return [first, await finding]
        finally:
            await close(redis)

    for error in asyncio.run(race()):
        assert (error.status, error.code) == (400, "invalid_media"), error.message
        assert (error.param, error.message) == (PARAM["image"], f"the image cannot be read: {REFUSED['huge png'][3]}")
    assert live_session_ids(stack) == before

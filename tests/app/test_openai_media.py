"""Video and images in OpenAI `messages`, with the official `openai` client against a real
gateway, worker and Redis: a session made for the media, found again by its content, named by
the reply for the next turn; system messages, earlier turns; media fetched over http; limits;
and the example of README.md and docs/api.md, run as written."""

import asyncio
import re
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from streamvqa.redis_server import free_port
from tests.media import data_url, jpeg
from tests.support import live_session_ids, running_stack, sample_video, stored_session

MODEL = "tiny-random-llava"
QUESTION = "What is in the video?"
CARPHONE = sample_video("carphone_pristine.mp4")  # 588,804 bytes: 4 frames at fps 1, the last at ~3 s
KEY = "key-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


def video_message(text: str, url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "video_url", "video_url": {"url": url}}]}


def image_message(text: str, url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}


def listed(stack, session_id: str) -> dict:
    """The session's record (a session made for media has no token to show: read from Redis)."""
    return stored_session(stack, session_id)


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    """The tests' usual stack, fetching media from loopback too (its servers here are on 127.0.0.1)."""
    with running_stack(
        redis_url, tmp_path_factory.mktemp("stack"), MAX_UPLOAD_BYTES=str(4 * 1024 * 1024), MAX_SESSIONS="64",
        MEDIA_FETCH_PRIVATE="true",
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def chat(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def first_token_s(chat: OpenAI, **request) -> tuple[float, str]:
    """A streamed completion's time to its first token as the client sees it (from sending the
    request), and its `X-Session-Id` header."""
    started = time.monotonic()
    with chat.chat.completions.with_streaming_response.create(model=MODEL, stream=True, **request) as reply:
        first_s = None
        for chunk in reply.parse():
            if first_s is None and chunk.choices and chunk.choices[0].delta.content:
                first_s = time.monotonic() - started
        assert first_s is not None, "no token came"
        return first_s, reply.headers["x-session-id"]


def test_a_video_url_makes_a_session_that_the_next_turn_reuses_without_a_second_ingest(stack, chat):
    messages = [video_message(QUESTION, data_url(CARPHONE.read_bytes(), "video/mp4"))]
    # the first token comes once the video is sent, decoded and in the cache
    first_s, session_id = first_token_s(chat, messages=messages, max_tokens=4)
    made = listed(stack, session_id)
    assert (made["frames_ingested"], made["upload_bytes"], made["media"]) == (4, 588_804, "upload")
    assert made["video_time_s"] == pytest.approx(3.0, abs=0.01)

    # the next turn names the session (any bearer key: no API_KEYS, and the address made it): the
    # same cache, nothing sent or read again, so its first token comes sooner
    second_s, named = first_token_s(
        chat, messages=[{"role": "user", "content": "And now?"}], max_tokens=4, extra_body={"session_id": session_id},
    )
    assert named == session_id
    again = listed(stack, session_id)
    assert (again["frames_ingested"], again["upload_bytes"]) == (4, 588_804)  # nothing ingested twice
    assert 2 * second_s < first_s, (second_s, first_s)  # here about 0.02 s against 0.5 s

    # the same video sent again without a session id finds the session by its content; the reply
    # names it in its header, its `session_id` and its `streamvqa` details
    raw = chat.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
    third = raw.parse()
    assert raw.headers["x-session-id"] == third.model_extra["session_id"] == session_id
    assert third.model_extra["streamvqa"]["session_id"] == session_id
    assert third.model_extra["streamvqa"]["video_time_s"] == pytest.approx(3.0, abs=0.01)
    assert third.usage.prompt_tokens == len(QUESTION) + 13  # the tiny model reads a character a token
    # and the header names it as well as the body does
    header = chat.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once more?"}], max_tokens=2,
        extra_headers={"X-Session-Id": session_id},
    )
    assert header.model_extra["session_id"] == session_id
    assert listed(stack, session_id)["frames_ingested"] == 4


def test_an_image_url_is_one_frame_of_a_session_made_for_it(stack, chat):
    image = jpeg(7)
    completion = chat.chat.completions.create(
        model=MODEL, messages=[image_message("What is this?", data_url(image, "image/jpeg"))], max_tokens=3,
    )
    session = listed(stack, completion.model_extra["session_id"])
    assert (session["frames_ingested"], session["media"], session["video_time_s"]) == (1, "frames", 0.0)
    assert 1 <= completion.usage.completion_tokens <= 3


def test_a_streamed_completion_names_its_session_in_the_header_and_each_chunk(stack, chat):
    messages = [image_message("Describe it.", data_url(jpeg(3), "image/jpeg"))]
    with chat.chat.completions.with_streaming_response.create(
        model=MODEL, messages=messages, max_tokens=3, stream=True
    ) as reply:
        session_id = reply.headers["x-session-id"]
        chunks = list(reply.parse())
    assert {chunk.model_extra["session_id"] for chunk in chunks} == {session_id}
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_system_message_opens_the_session_made_and_must_not_change_after(stack, chat):
    system = "Answer in three words."
    messages = [{"role": "system", "content": system}, image_message("What is this?", data_url(jpeg(11), "image/jpeg"))]
    completion = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    session_id = completion.model_extra["session_id"]
    assert listed(stack, session_id)["system_prompt"] == system
    # the same system message again: the same session; another one: a session of its own
    again = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.model_extra["session_id"] == session_id
    other = [{"role": "system", "content": "Answer in French."}, *messages[1:]]
    french = chat.chat.completions.create(model=MODEL, messages=other, max_tokens=2)
    assert french.model_extra["session_id"] != session_id
    # the system message is in the cache, before the image and the question: the same image, question
    # and answer length, and a system message 5 characters shorter (the tiny model reads a character a token)
    held = [reply.model_extra["streamvqa"]["cache_tokens"] for reply in (completion, french)]
    assert held[0] - held[1] == len(system) - len("Answer in French.") == 5, held
    # naming the session, another system message cannot be used: said, not dropped
    with pytest.raises(openai.BadRequestError) as changed:
        chat.chat.completions.create(
            model=MODEL, max_tokens=2, extra_body={"session_id": session_id},
            messages=[{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "And?"}],
        )
    assert (changed.value.body["code"], changed.value.body["param"]) == ("system_prompt_mismatch", "messages")
    assert "'Answer in three words.'" in changed.value.body["message"]


def test_earlier_turns_the_session_answered_are_not_asked_again_and_others_go_before_the_question(stack, chat):
    image = data_url(jpeg(21), "image/jpeg")
    # a history the new session never answered: the turns go before the question, as a transcript
    history = [image_message("What colour is it?", image), {"role": "assistant", "content": "Blue."}]
    first = chat.chat.completions.create(
        model=MODEL, messages=[*history, {"role": "user", "content": "Is it moving?"}], max_tokens=3,
    )
    transcript = "Earlier in this conversation:\nUser: What colour is it?\nAssistant: Blue.\n\nIs it moving?"
    assert first.usage.prompt_tokens == len(transcript) + 13
    # the next turn sends the whole history with the session's own answer: only the new question is asked
    answered = [*history, {"role": "user", "content": "Is it moving?"}, {"role": "assistant", "content": first.choices[0].message.content}]
    second = chat.chat.completions.create(
        model=MODEL, messages=[*answered, {"role": "user", "content": "Why?"}], max_tokens=3,
    )
    assert second.model_extra["session_id"] == first.model_extra["session_id"]
    assert second.usage.prompt_tokens == len("Why?") + 13


def test_http_urls_are_fetched_and_an_unreachable_one_is_a_400(stack, chat, tmp_path):
    """MEDIA_FETCH_PRIVATE is on here; without it a loopback URL is refused (the last test)."""
    (tmp_path / "carphone.mp4").write_bytes(CARPHONE.read_bytes())
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        completion = chat.chat.completions.create(
            model=MODEL, messages=[video_message(QUESTION, f"{base}/carphone.mp4")], max_tokens=2,
        )
        assert listed(stack, completion.model_extra["session_id"])["frames_ingested"] == 4
        with pytest.raises(openai.BadRequestError) as missing:
            chat.chat.completions.create(model=MODEL, messages=[video_message(QUESTION, f"{base}/nothing.mp4")])
        assert missing.value.body == {
            "message": f"fetching {base}/nothing.mp4 answered 404", "type": "invalid_request_error",
            "param": "messages.0.content.1.video_url.url", "code": "media_unreachable",
        }
    finally:
        server.shutdown()
    closed = f"http://127.0.0.1:{free_port()}/video.mp4"
    with pytest.raises(openai.BadRequestError) as unreachable:
        chat.chat.completions.create(model=MODEL, messages=[video_message(QUESTION, closed)])
    assert unreachable.value.body["code"] == "media_unreachable"
    assert unreachable.value.body["message"].startswith(f"fetching {closed} failed: ")


def test_the_same_media_sent_twice_at_once_makes_one_session_read_once(stack):
    before = live_session_ids(stack)
    opening = {"role": "system", "content": "Twice at once."}  # content no other test sent: a new session
    body = {"model": MODEL, "max_tokens": 2, "messages": [opening, video_message(QUESTION, data_url(CARPHONE.read_bytes(), "video/mp4"))]}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(2)))

    replies = asyncio.run(both())
    assert [reply.status_code for reply in replies] == [200, 200]
    [session_id] = {reply.headers["x-session-id"] for reply in replies}
    assert live_session_ids(stack) - before == {session_id}
    made = listed(stack, session_id)
    assert (made["frames_ingested"], made["upload_bytes"]) == (4, 588_804)  # sent and read once


def post(stack, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, **body}, headers=headers, timeout=120)


def test_media_has_the_upload_limit_and_bad_media_is_a_clear_400(stack):
    # the stack's MAX_UPLOAD_BYTES is 4 MiB: a 4,200,000-byte video is over it, its body (5.6 MB) within the route's
    over = post(stack, {"messages": [video_message(QUESTION, data_url(b"\0" * 4_200_000, "video/mp4"))]})
    assert over.status_code == 413
    assert over.json()["error"] == {
        "message": "the video exceeds the limit of 4194304 bytes", "type": "invalid_request_error",
        "param": "messages.0.content.1.video_url.url", "code": "media_too_large",
    }
    body = post(stack, {"messages": [video_message(QUESTION, data_url(b"\0" * 5_000_000, "video/mp4"))]})
    assert body.status_code == 413
    assert body.json()["error"]["code"] == "body_too_large" and body.json()["error"]["type"] == "invalid_request_error"
    for url, code in (
        ("data:video/mp4;base64,not base64!", "invalid_media_url"),
        ("ftp://example.com/a.mp4", "invalid_media_url"),
        ("data:video/mp4;base64,", "invalid_media"),
    ):
        reply = post(stack, {"messages": [video_message(QUESTION, url)]})
        assert (reply.status_code, reply.json()["error"]["code"]) == (400, code), url
    text_as_image = post(stack, {"messages": [image_message(QUESTION, data_url(b"hello", "image/png"))]})
    assert text_as_image.json()["error"] == {
        "message": "an image_url must be JPEG, PNG or WebP", "type": "invalid_request_error",
        "param": "messages.0.content.1.image_url.url", "code": "invalid_media",
    }
    # bytes no decoder reads: the worker says so, and the session made for them is gone at once
    before = live_session_ids(stack)
    undecodable = post(stack, {"messages": [video_message(QUESTION, data_url(b"\x01\x02" * 4000, "video/mp4"))]})
    assert (undecodable.status_code, undecodable.json()["error"]["code"]) == (400, "invalid_media")
    assert undecodable.json()["error"]["message"].startswith("the video cannot be read: ")
    assert live_session_ids(stack) == before


def test_messages_that_cannot_be_used_are_400s_naming_them(stack):
    image = data_url(jpeg(1), "image/jpeg")
    for messages, param, message in (
        ([{"role": "user", "content": QUESTION}], "session_id",
         "no session to ask: send the video or image in the messages (a `video_url` or `image_url` part), or name a "
         "session with `session_id`"),
        ([image_message("a", image), {"role": "tool", "content": "42"}, {"role": "user", "content": "b"}], "messages.1",
         "tool messages are not supported (no tools are offered)"),
        ([{"role": "assistant", "content": "Hello."}, image_message("a", image)], "messages.0",
         "an assistant message must answer a user message before it"),
        ([image_message("a", image), {"role": "system", "content": "Late."}, {"role": "user", "content": "b"}], "messages.1",
         "a system message must come before the conversation's first user message"),
        ([image_message("a", image), image_message("b", data_url(jpeg(2), "image/jpeg"))], "messages.1.content.1.image_url.url",
         "a session holds one video or image, and these messages carry two different ones: start a new conversation "
         "for the other"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}], "messages",
         "the question (the user's text after the last assistant message): String should have at least 1 character"),
    ):
        reply = post(stack, {"messages": messages})
        assert reply.status_code == 400, messages
        error = reply.json()["error"]
        assert (error["param"], error["message"], error["type"]) == (param, message, "invalid_request_error")


def test_with_api_keys_a_key_makes_and_reuses_the_session_as_open_webui_talks(redis_url, tmp_path):
    """Open WebUI: one API key as the bearer, the whole history sent each turn (the image with
    it), streamed; the session is found again each turn and asked only the new question."""
    with running_stack(redis_url, tmp_path, API_KEYS=KEY) as keyed:
        webui = OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        image = data_url(jpeg(5), "image/jpeg")
        messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
        sessions = set()
        for turn, question in enumerate(("What is in the picture?", "What colour is it?", "Anything else?")):
            messages.append(image_message(question, image) if turn == 0 else {"role": "user", "content": question})
            with webui.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True},
            ) as reply:
                sessions.add(reply.headers["x-session-id"])
                chunks = list(reply.parse())
            assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
            assert chunks[-2].choices[0].finish_reason == "length"  # the tiny model never stops before max_tokens
            assert chunks[-1].usage.prompt_tokens == len(question) + 13  # the new question alone
            messages.append({"role": "assistant", "content": "".join(c.choices[0].delta.content or "" for c in chunks[:-1])})
        [session_id] = sessions
        session = listed(keyed, session_id)
        assert (session["frames_ingested"], session["system_prompt"]) == (1, "You are a helpful assistant.")
        # the key opens the session it owns by its id too; another bearer does not
        named = webui.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Last?"}], max_tokens=2, extra_body={"session_id": session_id},
        )
        assert named.model_extra["session_id"] == session_id
        stranger = OpenAI(base_url=f"{keyed.url}/v1", api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            stranger.chat.completions.create(model=MODEL, messages=[image_message("What?", image)])
        assert denied.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What?"}], extra_body={"session_id": session_id}
            )
        # by default (MEDIA_FETCH_PRIVATE unset) the gateway fetches nothing from its own networks
        with pytest.raises(openai.BadRequestError) as private:
            webui.chat.completions.create(model=MODEL, messages=[video_message(QUESTION, f"{keyed.url}/samples/x.mp4")])
        assert private.value.body == {
            "message": "127.0.0.1 resolves to 127.0.0.1, not a public address: the gateway does not fetch media from "
            "loopback, private, link-local, multicast, reserved or unspecified addresses unless MEDIA_FETCH_PRIVATE=true",
            "type": "invalid_request_error", "param": "messages.0.content.1.video_url.url", "code": "media_url_private",
        }


def video_example(doc: str) -> str:
    """The one Python example of `doc` that sends a video in `messages` with the `openai` client."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
    [example] = [block for block in blocks if '"video_url"' in block and "OpenAI(" in block]
    return example


@pytest.mark.parametrize(("doc", "video"), [("README.md", "clip.mp4"), ("docs/api.md", "bikes.mp4")])
def test_the_docs_example_of_a_video_in_messages_runs_as_a_new_user_copies_it(stack, tmp_path, monkeypatch, doc, video):
    """Run as written, but for the gateway's address and the model (the tests' tiny one)."""
    example = video_example(doc)
    assert example.count('base_url="http://127.0.0.1:8000/v1"') == 1 and 'model="streamvqa-demo"' in example
    example = example.replace("http://127.0.0.1:8000", stack.url).replace('"streamvqa-demo"', f'"{MODEL}"')
    (tmp_path / video).write_bytes(sample_video("bikes.mp4").read_bytes())
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(example, doc, "exec"), names)
    session_id = names["session_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", session_id), session_id
    assert names["later"].model_extra["session_id"] == session_id  # the next turn asked the same session
    assert 1 <= names["later"].usage.completion_tokens <= 64  # the default max_tokens
    made = listed(stack, session_id)
    assert (made["frames_ingested"], made["upload_bytes"]) == (10, 509_868)  # bikes.mp4 at 1 frame/s, read once

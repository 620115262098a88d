"""The sessions `/v1/chat/completions` makes for media, over their lives, against a real gateway,
worker and Redis at the default MAX_SESSIONS_PER_KEY (8): a chat user is never locked out by
conversations it has left, and a session's warnings reach the reply."""

import json

import httpx
import pytest

from tests.app.test_openai_media import image_message, video_message
from tests.media import data_url, file_bytes, jpeg
from tests.support import live_session_ids, running_stack

MODEL = "tiny-random-llava"


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    with running_stack(redis_url, tmp_path_factory.mktemp("stack"), MAX_SESSIONS_PER_KEY=None, MAX_SESSIONS="64") as stack:
        yield stack


def jpeg_url(index: int) -> str:
    return data_url(jpeg(index), "image/jpeg")


def chat(stack, **body) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)


def test_ten_conversations_with_ten_images_in_a_row_are_all_answered(stack):
    """The caller may hold 8 sessions; one it made itself, with its token, is never ended for room."""
    own = httpx.post(f"{stack.url}/sessions", json={}).json()
    made = []
    for index in range(10):
        reply = chat(stack, messages=[image_message(f"What is picture {index}?", jpeg_url(100 + index))])
        assert reply.status_code == 200, (index, reply.text)
        made.append(reply.json()["session_id"])
    assert len(set(made)) == 10
    # room was made by ending the least recently used conversations: the first three
    assert live_session_ids(stack) == {own["id"], *made[3:]}
    # a later turn of a recent conversation still finds its session by its image
    again = chat(stack, messages=[image_message("What is picture 9?", jpeg_url(109)), {"role": "assistant", "content": "x"},
                                  {"role": "user", "content": "Sure?"}])
    assert again.status_code == 200 and again.json()["session_id"] == made[9]
    # an ended one comes back as a new session, asked the earlier turns as a transcript
    back = chat(stack, messages=[image_message("What is picture 0?", jpeg_url(100)), {"role": "assistant", "content": "x"},
                                 {"role": "user", "content": "Sure?"}])
    assert back.status_code == 200 and back.json()["session_id"] not in made
    httpx.delete(f"{stack.url}/sessions/{own['id']}", headers={"Authorization": f"Bearer {own['token']}"})


def test_a_caller_whose_sessions_are_all_its_own_still_gets_the_429(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, MAX_SESSIONS_PER_KEY=None) as own:
        made = [httpx.post(f"{own.url}/sessions", json={}) for _ in range(8)]
        assert [reply.status_code for reply in made] == [201] * 8
        reply = chat(own, messages=[image_message("What is it?", jpeg_url(77))])
        assert reply.status_code == 429 and reply.json()["error"]["code"] == "too_many_sessions", reply.text
        assert live_session_ids(own) == {reply.json()["id"] for reply in made}


CUT_AVI = (
    "the file ends after 9.2 s of the 10.0 s it states (it was cut short, as by a download or copy that stopped "
    "part-way): 10 frames were ingested, up to 9.0 s; upload the whole file to a new session for the rest"
)


def test_a_sessions_warnings_are_in_each_reply_whole_or_streamed(stack):
    """An AVI cut before its index (at its end): its frames are answered about, and each reply says
    what the session knows of its media, in `streamvqa.warnings` (an extra field, as `session_id`)."""
    whole = file_bytes("avi", 10.0)
    messages = [video_message("What happens?", data_url(whole[: len(whole) * 9 // 10], "video/mp4"))]
    reply = chat(stack, messages=messages)
    assert reply.status_code == 200, reply.text
    assert reply.json()["streamvqa"]["warnings"] == [{"code": "truncated_media", "message": CUT_AVI}]
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "max_tokens": 2, "stream": True, "messages": messages}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    finished = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"]]
    assert [chunk["streamvqa"]["warnings"] for chunk in finished] == [[{"code": "truncated_media", "message": CUT_AVI}]]
    assert finished[0]["streamvqa"]["session_id"] == reply.json()["session_id"]
    # a whole file: none
    assert chat(stack, messages=[video_message("What happens?", data_url(whole, "video/mp4"))]).json()["streamvqa"]["warnings"] == []


def test_an_mpeg_ts_cut_part_way_and_an_mp4_cut_before_its_index_are_told_as_such(stack):
    whole = file_bytes("ts", 10.0)
    reply = chat(stack, messages=[video_message("What happens?", data_url(whole[: len(whole) * 9 // 10], "video/mp4"))])
    assert reply.status_code == 200, reply.text
    assert reply.json()["streamvqa"]["warnings"] == [{"code": "truncated_media", "message": (
        "the file ends part-way through a packet, after 9.0 s (it was cut short, as by a download or copy that stopped "
        "part-way): 9 frames were ingested, up to 8.0 s; upload the whole file to a new session for the rest"
    )}]
    mp4 = file_bytes("mp4", 10.0)  # its index (`moov`) after its frames
    refused = chat(stack, messages=[video_message("What happens?", data_url(mp4[: len(mp4) // 2], "video/mp4"))])
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "the video cannot be read: the file is incomplete: it ends before its index (the `moov` box, which this MP4 or "
        "MOV file keeps at its end), as a download or copy that stopped part-way does, and no frame can be found "
        "without it; upload the whole file"
    )

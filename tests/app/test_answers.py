"""Asking and fetching answers: a JSON answer, Server-Sent Events, 202 and resuming by id."""

import os
import signal
import time

import httpx
import pytest

from tests.support import Client, sample_video, sse_events

QUESTION = "What is in the video?"


@pytest.fixture
def ingested(client: Client) -> Client:
    client.create(fps=1)
    assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    assert client.wait_for_state("ingested")["frames_ingested"] == 4
    return client


def _stream(user: Client, method: str, path: str, **kwargs) -> tuple[httpx.Response, list[dict]]:
    with user.http.stream(method, path, headers={**user.auth, **kwargs.pop("headers", {})}, **kwargs) as reply:
        return reply, list(sse_events(reply)) if reply.status_code == 200 else []


def test_a_json_answer_has_its_times_and_evidence_inside_the_video(ingested):
    reply = ingested.ask(QUESTION, max_new_tokens=6)
    assert reply.status_code == 200
    answer = reply.json()
    assert 1 <= answer["tokens"] <= 6
    assert answer["video_time_s"] == pytest.approx(3.0, abs=0.01)  # carphone: 4 frames at 1 fps, the last at ~3 s
    assert all(0.0 <= e["time_s"] <= 3.01 for e in answer["evidence"])
    assert 0 <= answer["ttft_ms"] <= answer["total_ms"]


@pytest.mark.parametrize("how", ["body", "accept"])
def test_a_streamed_answer_is_token_events_then_done(ingested, how):
    body = {"question": QUESTION, "max_new_tokens": 6, **({"stream": True} if how == "body" else {})}
    headers = {"Accept": "text/event-stream"} if how == "accept" else {}
    reply, events = _stream(ingested, "POST", f"/sessions/{ingested.id}/ask", json=body, headers=headers)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    started, *events = events
    location = f"/sessions/{ingested.id}/answers/{started['data']['answer_id']}"
    assert (started["event"], started["data"]["location"], reply.headers["location"]) == ("started", location, location)
    names = [e["event"] for e in events]
    assert names[-1] == "done" and set(names[:-1]) == {"token"}
    done = events[-1]["data"]
    assert "".join(e["data"]["text"] for e in events[:-1]) == done["answer"]
    assert done["answer_id"] == started["data"]["answer_id"]
    assert done["video_time_s"] == pytest.approx(3.0, abs=0.01)
    assert all(e.get("id") for e in events)  # each event can be resumed after


def test_an_answer_not_done_in_wait_s_is_202_then_fetched_by_id(ingested):
    reply = ingested.ask(QUESTION, max_new_tokens=8, wait_s=0)
    assert reply.status_code == 202
    pending = reply.json()
    answer_id = pending["answer_id"]
    assert reply.headers["location"] == f"/sessions/{ingested.id}/answers/{answer_id}" == pending["location"]
    assert pending["status"] in ("pending", "streaming", "done")  # it may end between the wait and the reply

    reply, events = _stream(ingested, "GET", pending["location"], headers={"Accept": "text/event-stream"})
    done = events[-1]
    assert done["event"] == "done" and done["data"]["answer_id"] == answer_id

    looked_up = ingested.http.get(pending["location"], headers=ingested.auth).json()
    assert looked_up["status"] == "done"
    assert looked_up["answer"] == done["data"]["answer"] == looked_up["result"]["answer"]
    assert looked_up["tokens"] == done["data"]["tokens"]


def test_an_answer_stream_resumes_after_the_last_event_id(ingested):
    reply, (_, *events) = _stream(ingested, "POST", f"/sessions/{ingested.id}/ask", json={"question": QUESTION, "max_new_tokens": 8, "stream": True})
    assert len(events) >= 3, "needs at least two tokens to resume in the middle"
    location = f"/sessions/{ingested.id}/answers/{events[-1]['data']['answer_id']}"
    _, rest = _stream(ingested, "GET", location, headers={"Accept": "text/event-stream", "Last-Event-ID": events[0]["id"]})
    assert rest == events[1:]
    _, after_the_end = _stream(ingested, "GET", location, headers={"Accept": "text/event-stream", "Last-Event-ID": events[-1]["id"]})
    assert after_the_end == []  # ends at once: nothing more will come
    bad = ingested.http.get(location, headers={**ingested.auth, "Accept": "text/event-stream", "Last-Event-ID": "oops"})
    assert (bad.status_code, bad.json()["code"]) == (400, "bad_event_id")


def test_an_unknown_answer_or_another_sessions_answer_is_404(stack, ingested):
    answer_id = ingested.ask(QUESTION, max_new_tokens=2).json()["answer_id"]
    other = Client(stack.url)
    other.create()
    try:
        for user, answer in ((ingested, "0" * 32), (ingested, "not-an-id"), (other, answer_id)):
            reply = user.http.get(f"/sessions/{user.id}/answers/{answer}", headers=user.auth)
            assert (reply.status_code, reply.json()["code"]) == (404, "answer_not_found")
        # the other session's token cannot reach this session's answers at all
        reply = other.http.get(f"/sessions/{ingested.id}/answers/{answer_id}", headers=other.auth)
        assert reply.status_code == 403
    finally:
        other.delete()


def test_ask_options_are_validated_by_name(ingested):
    reply = ingested.ask(QUESTION, wait_s=-1, stream="maybe", colour="red")
    assert reply.status_code == 422
    assert {f["field"] for f in reply.json()["fields"]} == {"body.wait_s", "body.stream", "body.colour"}


def test_a_blocking_ask_outlasting_the_keepalive_gets_its_answer_id(ingested, stack):
    worker = stack.processes["worker"]
    os.kill(worker.pid, signal.SIGSTOP)  # a worker too busy to answer in time
    try:
        reply = ingested.ask(QUESTION, max_new_tokens=2, wait_s=17)  # past the answer stream's 15-s keepalive
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert reply.status_code == 202, reply.text
    location = reply.json()["location"]
    deadline = time.monotonic() + 60
    while (found := ingested.http.get(location, headers=ingested.auth).json())["status"] != "done":
        assert time.monotonic() < deadline, found
        time.sleep(0.2)
    assert found["tokens"] == 2


def test_a_question_over_the_token_limit_is_refused_and_leaves_the_cache_alone(ingested):
    before = ingested.get().json()["cache_tokens"]
    reply = ingested.ask("x" * 1500, max_new_tokens=2)  # 1,500 tokens with this model's tokenizer
    assert (reply.status_code, reply.json()["code"]) == (422, "question_too_long")
    assert "at most 1024" in reply.json()["message"]
    assert ingested.get().json()["cache_tokens"] == before
    assert ingested.ask("x" * 1000, max_new_tokens=2).status_code == 200  # within it


def test_the_conversation_lists_each_question_with_its_answer_oldest_first_and_is_bounded(stack, ingested):
    assert ingested.http.get(f"/sessions/{ingested.id}/answers", headers=ingested.auth).json() == {"answers": []}
    questions = ["What is first?", "What is second?", "What is third?"]
    given = [ingested.ask(question, max_new_tokens=3).json() for question in questions]
    reply = ingested.http.get(f"/sessions/{ingested.id}/answers", headers=ingested.auth)
    assert reply.status_code == 200
    listed = reply.json()["answers"]
    assert [item["question"] for item in listed] == questions
    assert [item["answer_id"] for item in listed] == [answer["answer_id"] for answer in given]
    assert [item["status"] for item in listed] == ["done", "done", "done"]
    assert [item["answer"] for item in listed] == [answer["answer"] for answer in given]
    assert listed[0]["asked_at"] < listed[1]["asked_at"] < listed[2]["asked_at"]

    latest = ingested.http.get(f"/sessions/{ingested.id}/answers", params={"limit": 2}, headers=ingested.auth).json()
    assert [item["question"] for item in latest["answers"]] == questions[1:]
    for limit in (0, 101):
        reply = ingested.http.get(f"/sessions/{ingested.id}/answers", params={"limit": limit}, headers=ingested.auth)
        assert (reply.status_code, reply.json()["code"]) == (422, "invalid_request")
    other = Client(stack.url)
    other.create()
    try:
        assert other.http.get(f"/sessions/{ingested.id}/answers", headers=other.auth).status_code == 403
    finally:
        other.delete()

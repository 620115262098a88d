"""One worker, several sessions: a long answer on one holds up no other session's question, and
DELETE or SIGTERM stop it at its next step."""

import os
import signal
import time
import uuid

import pytest
import redis

from streamvqa.protocol import AnswerEnvelope, WorkerInfo
from tests.support import Client, Stack, delete_prefix

LONG_TOKENS = 1024  # the tiny random model never stops early: each of these answers is 1024 tokens
QUEUED = 16  # the session's whole question backlog


@pytest.fixture
def worker_stack(redis_url: str, tmp_path) -> Stack:
    stack = Stack(redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", tmp_path)
    stack.start("worker", "worker")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        yield stack
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)


def _busy_session(stack: Stack, first_tokens: int = LONG_TOKENS) -> tuple[Client, list[str]]:
    """A session with QUEUED long questions waiting (the first one `first_tokens` long), the
    first long one being answered."""
    busy = Client(stack.url)
    busy.create()
    busy.wait_for_state("ready")
    busy.show_frames()
    answer_ids = []
    for i in range(QUEUED):
        reply = busy.ask(f"question {i}", max_new_tokens=first_tokens if i == 0 else LONG_TOKENS, wait_s=0)
        assert reply.status_code == 202, reply.text
        answer_ids.append(reply.json()["answer_id"])
    streaming = answer_ids[0] if first_tokens == LONG_TOKENS else answer_ids[1]
    deadline = time.monotonic() + 60
    while _status(busy, streaming) != "streaming":
        assert time.monotonic() < deadline, "the first answer never started"
        time.sleep(0.05)
    return busy, answer_ids


def _status(user: Client, answer_id: str) -> str:
    return user.http.get(f"/sessions/{user.id}/answers/{answer_id}", headers=user.auth).json()["status"]


def _finals(store: redis.Redis, prefix: str, session_id: str) -> dict[str, str]:
    """The final event of every answer stream of the session: done, or error:<code>."""
    finals = {}
    for key in store.scan_iter(match=f"{prefix}session:{{{session_id}}}:answer:*"):
        for _, fields in store.xrange(key):
            event = AnswerEnvelope.model_validate_json(fields[b"m"]).event
            if event.type != "token":
                finals[key.decode().rsplit(":", 1)[1]] = "done" if event.type == "done" else f"error:{event.code}"
    return finals


def test_a_question_is_answered_while_another_session_has_16_long_answers_queued(worker_stack, redis_url):
    busy, answer_ids = _busy_session(worker_stack)
    other = Client(worker_stack.url)
    other.create()
    assert other.wait_for_state("ready")["worker"] == busy.get().json()["worker"]  # the same worker
    other.show_frames()

    reply = other.ask("Still there?", max_new_tokens=2)
    assert reply.status_code == 200 and reply.json()["tokens"] == 2
    # answered while the busy session's first answer was still going: it waited for steps, not answers
    assert _status(busy, answer_ids[0]) == "streaming"
    assert [_status(busy, answer_id) for answer_id in answer_ids[1:]] == ["pending"] * (QUEUED - 1)
    busy.delete()
    other.delete()


def test_deleting_a_session_stops_its_answer_and_answers_nothing_it_had_queued(worker_stack, redis_url):
    busy, answer_ids = _busy_session(worker_stack)
    store = redis.Redis.from_url(redis_url)
    workers = f"{worker_stack.prefix}workers"

    def held() -> bool:
        return any(busy.id in WorkerInfo.model_validate_json(w).session_ids for w in store.hvals(workers))

    assert held()
    assert busy.http.delete(f"/sessions/{busy.id}", headers=busy.auth).status_code == 204
    deadline = time.monotonic() + 10
    while held():
        assert time.monotonic() < deadline, "the worker kept the deleted session"
        time.sleep(0.05)
    # another session on the same worker is answered: the worker has moved on
    other = Client(worker_stack.url)
    other.create()
    other.show_frames()
    assert other.ask("Next?", max_new_tokens=2).status_code == 200
    assert store.keys(f"{worker_stack.prefix}session:{{{busy.id}}}*") == []  # no answer came back after the delete
    other.delete()


def test_sigterm_during_a_long_answer_hands_the_session_over_at_once(worker_stack, redis_url):
    # a short first answer, then the worker has read several long questions together
    busy, answer_ids = _busy_session(worker_stack, first_tokens=4)
    worker = worker_stack.processes["worker"]
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.wait(timeout=60) == 0
    store = redis.Redis.from_url(redis_url)
    finals = _finals(store, worker_stack.prefix, busy.id)
    # the answer under way ended (done within the grace, or cut: ask again); the 14 queued wait
    assert sorted(finals) == sorted(answer_ids[:2]) and finals[answer_ids[0]] == "done"
    assert finals[answer_ids[1]] in ("done", "error:session_reset")

    reply = Client(worker_stack.url).create()  # the gateway's model, with no worker now: try again later
    assert (reply.status_code, reply.json()["code"], reply.headers["retry-after"]) == (503, "no_worker", "5")

    worker_stack.start("successor", "worker")  # the queued questions are answered by the next worker
    deadline = time.monotonic() + 120
    while _status(busy, answer_ids[2]) == "pending":
        assert time.monotonic() < deadline, "the next worker did not take the session's questions"
        time.sleep(0.1)
    busy.delete()

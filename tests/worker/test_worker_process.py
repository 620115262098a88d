"""A real worker process: its session capacity, freeing deleted sessions, Redis losing its data, and a malformed media entry."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from streamvqa.redis_server import free_port
from tests.support import Client, Stack, running_stack, sample_video

MAX_SESSIONS = 2
LEASE_TTL_S = 3  # heartbeats every second


@pytest.fixture(scope="module")
def small_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        redis_url, tmp_path_factory.mktemp("small"), MAX_SESSIONS=str(MAX_SESSIONS), LEASE_TTL_S=str(LEASE_TTL_S)
    ) as stack:
        yield stack


def _create_until(user: Client, status: int, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = user.create()
        if reply.status_code == status or time.monotonic() > deadline:
            assert reply.status_code == status, reply.text
            return reply.json()
        time.sleep(0.2)


def test_a_full_worker_refuses_new_sessions_until_one_is_deleted(small_stack):
    users = [Client(small_stack.url) for _ in range(MAX_SESSIONS + 1)]
    for user in users[:MAX_SESSIONS]:
        assert user.create().status_code == 201
        user.wait_for_state("ready")
    full = _create_until(users[-1], 503)
    assert full["code"] == "no_capacity"

    first = users[0]
    assert first.http.delete(f"/sessions/{first.id}", headers=first.auth).status_code == 204
    _create_until(users[-1], 201)  # the worker dropped the deleted session and has room again
    assert users[-1].wait_for_state("ready")["worker"]
    for user in users:
        user.http.close()


def test_the_worker_keeps_serving_after_redis_loses_its_data(small_stack):
    # The worker is full with the sessions of the test above. A Redis restarted without
    # persistence has none of them, nor the worker registry, nor the pending queue.
    client = redis.Redis.from_url(small_stack.redis_url)
    for key in client.scan_iter(match=f"{small_stack.prefix}*"):
        client.delete(key)
    client.close()

    user = Client(small_stack.url)
    _create_until(user, 201)
    assert user.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    session = user.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"]) == ("ingested", 4)
    assert user.ask("still there?", max_new_tokens=3).status_code == 200
    user.http.close()


def test_sessions_fit_the_worker_s_cache_memory(redis_url, tmp_path):
    # tiny-random-llava: 512 bytes per cached token; a 256-token budget without recall peaks at 256 + 2048 + 1024
    # tokens (budget, a prompt, an answer), and with the rotated copy of their keys takes
    # 3328 x 512 x 1.5 = 2,555,904 bytes: two fit in 6 MB, a third does not
    with running_stack(
        redis_url, tmp_path, KV_MEMORY_BYTES=str(6_000_000), HOST_MEMORY_BYTES=str(150_000_000), MAX_SESSIONS="8"
    ) as stack:
        users = [Client(stack.url) for _ in range(3)]
        vast = Client(stack.url).create(budget_tokens=256, recall=True, host_budget_tokens=4_000_000)  # ~1.1 GB of host tier
        assert (vast.status_code, vast.json()["code"]) == (503, "no_capacity")
        assert "4000000-token host tier" in vast.json()["message"]
        # 200,000 host tokens: 56 MB of host memory fit, but their index (20 bytes a token on
        # the device: 4 MB) beside the peak cache (256 + 128 borrowed + 3,072: 2.65 MB) does not
        indexed = Client(stack.url).create(budget_tokens=256, recall=True, host_budget_tokens=200_000)
        assert (indexed.status_code, indexed.json()["code"]) == (503, "no_capacity")
        small = Client(stack.url)
        assert small.create(budget_tokens=256, recall=True, host_budget_tokens=50_000).status_code == 201
        assert small.wait_for_state("ready")["host_budget_tokens"] == 50_000
        small.delete()
        deadline = time.monotonic() + 10
        while (reply := users[0].create(budget_tokens=256, recall=False)).status_code != 201:  # its room is given back
            assert time.monotonic() < deadline, reply.text
            time.sleep(0.2)
        assert users[1].create(budget_tokens=256, recall=False).status_code == 201
        for user in users[:2]:
            user.wait_for_state("ready")
        deadline = time.monotonic() + 10
        while (reply := users[2].create(budget_tokens=256, recall=False)).status_code != 503:  # the registry catches up
            assert time.monotonic() < deadline, reply.text
            users[2].delete()
            time.sleep(0.2)
        assert reply.json()["code"] == "no_capacity" and "a cache of 3328 tokens at its peak" in reply.json()["message"]  # 256, a prompt, an answer
        big = Client(stack.url).create(budget_tokens=8192)  # 11,264 tokens: never fits
        assert (big.status_code, big.json()["code"]) == (503, "no_capacity")
        users[0].delete()  # its worker frees the room within a heartbeat
        deadline = time.monotonic() + 10
        while (reply := users[2].create(budget_tokens=256, recall=False)).status_code != 201:
            assert time.monotonic() < deadline, reply.text
            time.sleep(0.2)
        assert users[2].wait_for_state("ready")["budget_tokens"] == 256


def test_a_question_submitted_twice_is_answered_once(stack, redis_url):
    """A submit retried after its reply was lost puts the same question in the stream twice."""
    import uuid

    from streamvqa.protocol import AnswerEnvelope, Question

    user = Client(stack.url)
    user.create()
    user.show_frames()
    store = redis.Redis.from_url(redis_url)
    answer_id = uuid.uuid4().hex
    message = Question(answer_id=answer_id, question="twice?", max_new_tokens=4).model_dump_json()
    questions = f"{stack.prefix}session:{{{user.id}}}:questions"
    for _ in range(2):
        store.xadd(questions, {"m": message})
    deadline = time.monotonic() + 30
    while store.xlen(questions):  # both entries handled
        assert time.monotonic() < deadline
        time.sleep(0.1)
    events = [AnswerEnvelope.model_validate_json(f[b"m"]).event.type for _, f in store.xrange(f"{stack.prefix}session:{{{user.id}}}:answer:{answer_id}")]
    assert events.count("done") == 1 and events[-1] == "done"
    user.delete()


def test_a_model_that_cannot_load_ends_the_worker_with_one_line_that_says_what_to_do(redis_url):
    hub_id = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"  # not in this machine's cache, and no hub reachable
    env = {**os.environ, "REDIS_URL": redis_url, "MODEL": hub_id, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "worker"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 2, done.stderr
    assert lines[0].endswith(f"INFO worker: loading {hub_id}…")
    assert lines[1].endswith(
        f"ERROR worker: cannot load model '{hub_id}': We couldn't connect to 'https://huggingface.co' to load the "
        "files, and couldn't find them in the cached files (built-in models: smollm2-135m-instruct, streamvqa-demo, "
        "tiny-random-llama, tiny-random-llava, tiny-random-llava-next-video, tiny-random-llava-onevision, "
        "tiny-random-qwen2-5-vl, tiny-random-qwen3-vl). Set MODEL "
        "to a built-in model, a local checkpoint folder, or a hub id that this machine can download or already has "
        "in the Hugging Face cache (HF_HOME)."
    ), lines[1]


def test_a_worker_waiting_for_redis_stops_when_told():
    """Redis not up yet: the worker retries, and a SIGTERM (`docker stop`) ends it at once, with
    status 0, instead of after its orchestrator's grace period."""
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{free_port()}", "MODEL": "tiny-random-llava"}
    worker = subprocess.Popen([sys.executable, "-m", "worker"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in worker.stderr:  # up to the first retry
            if "Redis unreachable" in line:
                break
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        worker.kill()


def test_a_worker_set_to_bfloat16_says_so_and_answers(redis_url, tmp_path):
    """DTYPE=bfloat16: the worker's start line and `GET /models` name it, and questions about an
    upload are answered."""
    with running_stack(redis_url, tmp_path, DTYPE="bfloat16") as stack:
        worker = httpx.get(f"{stack.url}/models").json()["models"][0]["memory"][0]
        assert worker["dtype"] == "bfloat16"
        assert re.search(r"INFO worker: tiny-random-llava loaded in \d+\.\d s, in bfloat16 \(DTYPE=bfloat16: set\)", stack.log("worker"))
        user = Client(stack.url)
        user.create(fps=2)
        assert user.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
        assert user.wait_for_state("ingested")["frames_ingested"] == 8
        reply = user.ask("What is it?", max_new_tokens=4)
        assert reply.status_code == 200 and reply.json()["tokens"] == 4


def test_a_malformed_media_entry_fails_its_session_and_the_worker_serves_others(stack, redis_url):
    """A media entry no gateway writes (its byte count not a number) ends its own session with an
    error the user can read; another session on the same worker ingests and answers."""
    broken, other = Client(stack.url), Client(stack.url)
    broken.create()
    other.create()
    broken.wait_for_state("ready")
    store = redis.Redis.from_url(redis_url)
    store.xadd(f"{stack.prefix}session:{{{broken.id}}}:media", {"type": "data", "data": b"x", "bytes": "many"})
    session = broken.wait_for_state("error")
    assert session["error"] == "receiving media failed (a fault of the worker; its log has the details)"
    assert other.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    assert other.wait_for_state("ingested", "error")["frames_ingested"] == 4
    assert other.ask("still there?", max_new_tokens=3).status_code == 200
    store.close()
    broken.delete()
    other.delete()

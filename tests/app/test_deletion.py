"""DELETE forgets a session at once: its upload stops, its files and keys go, its answers too."""

import threading
import time
from collections.abc import Iterator

import redis

from tests.support import Client, Stack, sample_video
from worker.loop import prefix_folder


def _spool(stack: Stack, session_id: str):
    return stack.directory / "spool" / prefix_folder(stack.prefix) / f"{session_id}.upload"


def test_deleting_a_session_mid_upload_stops_the_upload_and_leaves_no_file_or_key(stack, redis_url):
    user = Client(stack.url)
    user.create(fps=1)
    user.wait_for_state("ready")
    data = sample_video("bikes.mp4").read_bytes()
    started = threading.Event()

    def slowly() -> Iterator[bytes]:
        for start in range(0, len(data), 64 * 1024):
            yield data[start : start + 64 * 1024]
            started.set()
            time.sleep(0.5)

    replies = []
    uploader = threading.Thread(target=lambda: replies.append(user.upload(slowly())))
    uploader.start()
    assert started.wait(10)
    deadline = time.monotonic() + 10
    while not _spool(stack, user.id).exists():  # the worker is spooling it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    user.delete()
    uploader.join(timeout=60)
    assert (replies[0].status_code, replies[0].json()["code"]) == (404, "session_not_found")

    store = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while _spool(stack, user.id).exists():
        assert time.monotonic() < deadline, "the spool file of the deleted session stayed"
        time.sleep(0.1)
    assert store.keys(f"{stack.prefix}session:{{{user.id}}}*") == []


def test_a_deleted_session_s_answers_are_gone_with_it(client, stack, redis_url):
    client.create()
    client.show_frames()
    answer_id = client.ask("What do you see?", max_new_tokens=3).json()["answer_id"]
    store = redis.Redis.from_url(redis_url)
    assert store.exists(f"{stack.prefix}session:{{{client.id}}}:answer:{answer_id}")
    assert client.http.delete(f"/sessions/{client.id}", headers=client.auth).status_code == 204
    assert store.keys(f"{stack.prefix}session:{{{client.id}}}*") == []

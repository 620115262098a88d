"""Several workers on one Redis: placement, a worker killed mid-stream, and Redis going away."""

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from streamvqa.protocol import AnswerEnvelope
from streamvqa.redis_client import connect_sync
from streamvqa.redis_server import EmbeddedRedis
from tests.media import timed_jpeg
from tests.support import Client, Stack, StreamSocket, delete_prefix

LEASE_TTL_S = 2.0
TAKEOVER_MARGIN_S = 8.0  # a heartbeat (LEASE_TTL_S / 3) to notice, then restoring and replaying


def _stack(redis_url: str, directory, **env: str) -> Stack:
    return Stack(
        redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", directory,
        LEASE_TTL_S=str(LEASE_TTL_S), SNAPSHOT_DIR=str(directory / "snapshots"),
        LIVE_MAX_LAG_S="1000",  # frames sent faster than real time are never late: none is dropped
        **{"SNAPSHOT_INTERVAL_S": "0.5", **env},
    )


@pytest.fixture
def two_workers(redis_url: str, tmp_path) -> Iterator[Stack]:
    stack = _stack(redis_url, tmp_path, MAX_SESSIONS="3")
    stack.start("a", "worker", WORKER_ID="a")
    stack.start("b", "worker", WORKER_ID="b")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving(workers=2)
        yield stack
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)


def _answer_finals(redis_url: str, prefix: str, cluster: bool = False) -> dict[str, list[str]]:
    """For every answer stream under `prefix`: the types of its final events (done, error:code)."""
    store = connect_sync(redis_url, cluster)
    finals = {}
    for key in store.scan_iter(match=f"{prefix}session:*:answer:*"):
        events = [AnswerEnvelope.model_validate_json(f[b"m"]).event for _, f in store.xrange(key)]
        finals[key.decode()] = [e.type if e.type == "done" else f"error:{e.code}" for e in events if e.type != "token"]
    return finals


def test_six_sessions_on_two_workers_each_held_by_one_and_all_answered(two_workers, redis_url):
    users = [Client(two_workers.url) for _ in range(6)]
    for user in users:
        assert user.create().status_code == 201
    owners = [user.wait_for_state("ready")["worker"] for user in users]
    assert sorted(owners) == ["a", "a", "a", "b", "b", "b"]  # three sessions each: MAX_SESSIONS
    store = redis.Redis.from_url(redis_url)
    for user, owner in zip(users, owners, strict=True):
        assert store.get(f"{two_workers.prefix}session:{{{user.id}}}:lease") == owner.encode()
        user.show_frames()

    replies: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda i=i, u=u: replies.__setitem__(i, u.ask("What do you see?", max_new_tokens=4).status_code))
        for i, u in enumerate(users)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert replies == {i: 200 for i in range(6)}


def test_a_killed_worker_s_stream_goes_on_elsewhere_and_every_question_ends_once(redis_url, tmp_path):
    a_killed_worker_s_stream_goes_on_elsewhere(redis_url, tmp_path)


def a_killed_worker_s_stream_goes_on_elsewhere(redis_url: str, directory, **env: str) -> None:
    """Worker a is killed (SIGKILL) while it answers and ingests a live stream: b takes the
    session over, every frame reaches its cache once, every question ends once."""
    # snapshots only every 32 media entries: the dead worker leaves media no snapshot covers
    stack = _stack(redis_url, directory, MAX_SESSIONS="4", SNAPSHOT_INTERVAL_S="600", **env)
    stack.start("a", "worker", WORKER_ID="a")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        user = Client(stack.url)
        user.create(fps=1)
        assert user.wait_for_state("ready")["worker"] == "a"
        stack.start("b", "worker", WORKER_ID="b")
        stack.wait_until_serving(workers=2)

        socket = StreamSocket(user, "frames")
        # a snapshot after 32 entries; the last 28 are replayed after the kill, more than the
        # live queue takes at once (so the replay runs ingest steps between entries)
        for second in range(60):
            socket.send(timed_jpeg(float(second), second))
        socket.wait_for(lambda e: e["type"] == "ingest" and e["frames"] == 60)
        statuses: list[int] = []
        assert user.ask("before?", max_new_tokens=4).status_code == 200

        def ask(question: str) -> None:
            asker = Client(stack.url)
            asker.id, asker.token = user.id, user.token
            statuses.append(asker.ask(question, max_new_tokens=24).status_code)

        askers = [threading.Thread(target=ask, args=("during?",))]
        askers[0].start()
        time.sleep(0.05)  # the question reaches the worker, which starts answering
        os.kill(stack.processes["a"].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        askers.append(threading.Thread(target=ask, args=("while nobody holds it?",)))
        askers[-1].start()
        for second in range(60, 70):  # the gateway keeps taking frames while no worker reads them
            socket.send(timed_jpeg(float(second), second))

        while user.get().json()["worker"] != "b":
            assert time.monotonic() - killed_at < LEASE_TTL_S + TAKEOVER_MARGIN_S, "no takeover"
            time.sleep(0.1)
        for second in range(70, 80):
            socket.send(timed_jpeg(float(second), second))
        socket.end()
        assert socket.wait_for(lambda e: e["type"] == "state" and e["state"] == "ingested", timeout_s=60)
        ask("after?")
        for asker in askers:
            asker.join(timeout=120)
            assert not asker.is_alive()

        session = user.get().json()
        # every frame once in the cache b holds: 32 from the snapshot, the rest replayed or new
        assert (session["worker"], session["frames_ingested"], session["video_time_s"]) == ("b", 80, 79.0)
        ingested = [t for e in socket.events if e["type"] == "ingest" for t in e["times"]]
        assert [t for t in ingested if t >= 60] == [float(s) for s in range(60, 80)]  # every frame after the kill
        assert len(statuses) == 3 and set(statuses) <= {200, 503}  # 503: session_reset, for one cut short
        finals = _answer_finals(redis_url, stack.prefix, stack.cluster)
        assert len(finals) == 4  # before, during, while nobody holds it, after
        assert all(ends in (["done"], ["error:session_reset"]) for ends in finals.values()), finals
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix, stack.cluster)


@pytest.mark.parametrize("apart", [False, True], ids=["whole", "host-pages-apart"])
def test_a_takeover_keeps_the_host_tier_and_recalls_from_it(redis_url, tmp_path, apart):
    """Its snapshot in Redis, or (a host tier larger than SNAPSHOT_REDIS_MAX_BYTES) its host
    pages each in a file of their own, written once they changed."""
    env = {"SNAPSHOT_REDIS_MAX_BYTES": "100000"} if apart else {}
    stack = _stack(redis_url, tmp_path, MAX_SESSIONS="4", **env)
    stack.start("a", "worker", WORKER_ID="a")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        user = Client(stack.url)
        user.create(fps=1, policy="sliding", budget_tokens=256, recall=True)
        assert user.wait_for_state("ready")["worker"] == "a"
        stack.start("b", "worker", WORKER_ID="b")
        stack.wait_until_serving(workers=2)
        socket = StreamSocket(user, "frames")
        for second in range(40):  # 40 frames of 23 tokens: 256 on the device, the rest in the host tier
            socket.send(timed_jpeg(float(second), second))
        socket.wait_for(lambda e: e["type"] == "ingest" and e["frames"] == 40)
        ingested_at = time.time()  # the 40th frame was in the cache before its event was sent
        store = redis.Redis.from_url(redis_url)
        memory_key, snapshot_key = (f"{stack.prefix}session:{{{user.id}}}:{name}" for name in ("memory", "snapshot"))
        deadline = time.monotonic() + 20
        while True:  # a memory report and a snapshot of all 40 frames
            report = json.loads(store.get(memory_key) or "{}")
            if report.get("frames") == 40 and float(store.hget(snapshot_key, "taken_at") or 0) > ingested_at:
                break
            assert time.monotonic() < deadline, "no snapshot after the last frame"
            time.sleep(0.1)
        held = report["host_tokens"]
        assert held > 500
        pages = store.hget(snapshot_key, "pages")
        assert (pages is not None) == apart
        if apart:  # one file per page the tier holds, in the session's folder of pages
            files = json.loads(pages)
            folder = next((tmp_path / "snapshots").rglob(f"{user.id}.pages"))
            assert len(files) >= held // 32 and {path.name for path in folder.iterdir()} == set(files.values())
        os.kill(stack.processes["a"].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while user.get().json()["worker"] != "b":
            assert time.monotonic() - killed_at < LEASE_TTL_S + TAKEOVER_MARGIN_S, "no takeover"
            time.sleep(0.1)
        reply = user.ask("What came first?", max_new_tokens=4)
        assert reply.status_code == 200 and reply.json()["recalled_s"]
        after = user.http.get(f"/sessions/{user.id}/memory", headers=user.auth).json()
        assert after["frames"] == 40 and after["host_tokens"] >= held  # the past came along
        assert min(reply.json()["recalled_s"]) < 20
        socket.end()
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)


def test_redis_away_for_ten_seconds_is_survived(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    stack = Stack(server.url, "svqa-test-blip:", tmp_path, LEASE_TTL_S="5")
    stack.start("worker", "worker")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        user = Client(stack.url)
        user.create(fps=1)
        user.wait_for_state("ready")
        socket = StreamSocket(user, "frames")
        socket.send(timed_jpeg(0.0))
        socket.wait_for(lambda e: e["type"] == "ingest")
        socket.close()
        store = redis.Redis.from_url(server.url)
        while store.exists(f"{stack.prefix}session:{{{user.id}}}:streamer"):  # the gateway saw the socket close
            time.sleep(0.05)
        store.save()  # the restarted server loads this
        server.stop()
        time.sleep(10)
        assert user.get().status_code == 503  # the gateway says Redis is away, and stays up
        server.start()
        deadline = time.monotonic() + 30
        while user.get().status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not reconnect"
            time.sleep(0.5)
        socket = StreamSocket(user, "frames")
        socket.send(timed_jpeg(1.0, 1))
        socket.end()
        ingested = socket.wait_for(lambda e: e["type"] == "state" and e["state"] == "ingested", timeout_s=60)
        assert ingested, (socket.events, socket.close_code, socket.close_reason, stack.log("worker"))
        assert user.get().json()["frames_ingested"] == 2
        assert user.ask("still there?", max_new_tokens=4).status_code == 200
        assert all(process.poll() is None for process in stack.processes.values())
    finally:
        stack.stop()
        server.stop()


def test_idle_workers_take_new_sessions_after_redis_restarts_empty(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    stack = Stack(server.url, "svqa-test-empty:", tmp_path, LEASE_TTL_S="3")
    stack.start("a", "worker", WORKER_ID="a")
    stack.start("b", "worker", WORKER_ID="b")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving(workers=2)
        time.sleep(1)  # both idle, waiting on the pending queue
        server.kill()
        time.sleep(4)  # longer than a command's retries: each worker's loop meets the failure
        server.start()  # the same port, and no data: no pending queue, no group, no registry
        restarted_at = time.monotonic()
        user = Client(stack.url)
        while user.create().status_code != 201:  # 503 until a worker advertises itself again
            assert time.monotonic() - restarted_at < 3 + 10, "no worker came back"
            time.sleep(0.2)
        while user.get().json()["state"] != "ready":
            assert time.monotonic() - restarted_at < 3 + 10, f"the new session stayed pending: {stack.log('a')}"
            time.sleep(0.2)
        while httpx.get(f"{stack.url}/readyz").json().get("workers") != 2:  # both advertise again
            assert time.monotonic() - restarted_at < 3 + 10, "a worker did not come back"
            time.sleep(0.2)
    finally:
        stack.stop()
        server.stop()


def test_a_stream_goes_on_at_once_after_redis_restarts_from_its_append_only_file(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always")
    server.start()
    stack = Stack(server.url, "svqa-test-aof:", tmp_path, LEASE_TTL_S="5", LIVE_MAX_LAG_S="1000")
    stack.start("worker", "worker")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        user = Client(stack.url)
        user.create(fps=1)
        user.wait_for_state("ready")
        socket = StreamSocket(user, "frames")
        connection = socket.started["connection"]
        for second in range(10):
            socket.send(timed_jpeg(float(second), second))
        socket.wait_for(lambda e: e["type"] == "ingest" and e["frames"] == 10)
        server.kill()
        for second in range(10, 12):  # in flight: the gateway cannot pass them on
            socket.send(timed_jpeg(float(second), second))
        assert socket.wait_closed() == 1013  # connect again in a few seconds
        server.start()  # from its append-only file: the socket's claim on the stream came back too

        restarted_at = time.monotonic()
        while (again := StreamSocket(user, "frames", resume=connection)).started is None:
            assert again.close_code == 1013 and time.monotonic() - restarted_at < 10, (again.close_code, again.close_reason)
            time.sleep(0.2)
        assert again.started["last_frame_s"] == 9.0  # what reached Redis: send on after it
        for second in range(10, 20):
            again.send(timed_jpeg(float(second), second))
        again.end()
        assert again.wait_for(lambda e: e["type"] == "state" and e["state"] == "ingested", timeout_s=60)
        session = user.get().json()
        assert (session["frames_ingested"], session["video_time_s"]) == (20, 19.0)  # every frame once
    finally:
        stack.stop()
        server.stop()

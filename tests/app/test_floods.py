"""Clients that misbehave: one floods media, one never reads its answers. Memory stays bounded,
the flooder hears backpressure, and another session is unaffected."""

import threading
import time

import httpx
import redis

from streamvqa import protocol
from tests.media import timed_jpeg
from tests.support import Client, StreamSocket

FLOOD_FRAMES = 1500


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_flood_of_media_and_unread_answers_stay_bounded(stack, redis_url):
    store = redis.Redis.from_url(redis_url)
    gateway_pid, worker_pid = stack.processes["gateway"].pid, stack.processes["worker"].pid
    gateway_before, worker_before = _rss_bytes(gateway_pid), _rss_bytes(worker_pid)
    redis_before = store.info("memory")["used_memory"]

    flooder = Client(stack.url)
    flooder.create(fps=4)
    flood = StreamSocket(flooder, "frames")
    image = timed_jpeg(0.0)[8:]  # one JPEG, sent with ever later times
    longest_backlog = 0

    def watch_backlog() -> None:
        nonlocal longest_backlog
        watcher_store = redis.Redis.from_url(redis_url)
        while not done.is_set():
            longest_backlog = max(longest_backlog, watcher_store.xlen(f"{stack.prefix}session:{{{flooder.id}}}:media"))
            time.sleep(0.02)

    done = threading.Event()
    watcher = threading.Thread(target=watch_backlog)
    watcher.start()

    silent = Client(stack.url)
    silent.create()
    for i in range(protocol.QUESTIONS_BACKLOG):  # asked, then never read: the client goes away
        try:
            silent.http.post(
                f"/sessions/{silent.id}/ask", json={"question": f"question {i}?", "max_new_tokens": 64},
                headers=silent.auth, timeout=0.05,
            )
        except httpx.TimeoutException:
            pass

    calm = Client(stack.url)
    calm.create(fps=1)
    calm_socket = StreamSocket(calm, "frames")
    calm_times = []
    for i in range(FLOOD_FRAMES):  # the flooder ignores backpressure; the calm one sends a frame a second
        if i % 100 == 0:
            calm_times.append(float(i // 100))
            calm_socket.send(timed_jpeg(calm_times[-1]))
        if not flood.send(protocol.frame_message(i * 0.25, image)):
            break
    flood.end()
    calm_socket.end()
    try:
        # closed with 4429 for sending over WS_MESSAGES_PER_S, or paused by the gateway (and
        # closed with 4429 if it went on sending after that); else it drains
        last = flood.wait_for(lambda e: e["type"] == "state" and e["state"] == "ingested", timeout_s=300)
        paused = any(e["type"] == "backpressure" and e["paused"] for e in flood.events)
        assert (last is None and flood.close_code == 4429) or (last is not None and paused)
        assert paused or "messages per second" in flood.close_reason
        assert calm_socket.wait_for(lambda e: e["type"] == "state" and e["state"] == "ingested", timeout_s=120)
        assert calm_socket.frame_times() == calm_times
    finally:
        done.set()
        watcher.join()
    assert longest_backlog <= protocol.MEDIA_MAXLEN
    assert _rss_bytes(gateway_pid) - gateway_before < 64 * 1024 * 1024  # 8 MiB read-ahead per socket
    assert _rss_bytes(worker_pid) - worker_before < 128 * 1024 * 1024  # 16 queued frames, bounded caches
    assert store.info("memory")["used_memory"] - redis_before < 32 * 1024 * 1024  # 256 media entries at most

    for key in store.scan_iter(match=f"{stack.prefix}session:*:answer:*"):
        assert store.xlen(key) <= protocol.ANSWER_MAXLEN and 0 < store.ttl(key) <= protocol.ANSWER_TTL_S
    assert store.xlen(f"{stack.prefix}session:{{{silent.id}}}:questions") <= protocol.QUESTIONS_BACKLOG
    assert stack.processes["worker"].poll() is None

"""The service on a real Redis Cluster (3 masters, 3 replicas on loopback): the whole path, a
worker killed mid-stream, and a session's keys in one slot."""

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from app.settings import GatewaySettings

from streamvqa.protocol import Keys
from streamvqa.redis_client import connect_sync
from streamvqa.redis_server import LocalCluster
from tests.support import Client, Stack, StreamSocket, running_stack, sample_video, sse_events
from tests.worker.test_recovery import a_killed_worker_s_stream_goes_on_elsewhere
from worker.settings import WorkerSettings


@pytest.fixture(scope="module")
def stack(redis_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The suite's stack, on the cluster: the suite's `client` fixture talks to this one here."""
    with running_stack(redis_cluster.url, tmp_path_factory.mktemp("stack"), REDIS_CLUSTER="true", MAX_SESSIONS="16") as stack:
        yield stack


def test_upload_stream_ask_sse_and_memory_on_a_cluster(client, stack):
    assert client.create(fps=1).status_code == 201
    video = sample_video("bikes.mp4")  # 10 s at 25 fps
    assert client.upload(video.read_bytes()).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"], session["video_time_s"]) == ("ingested", 10, 9.0)

    reply = client.ask("What is happening in the video?", max_new_tokens=8)
    assert reply.status_code == 200 and 1 <= reply.json()["tokens"] <= 8
    assert reply.json()["video_time_s"] == 9.0

    body = {"question": "And now?", "max_new_tokens": 4, "stream": True}
    with client.http.stream("POST", f"/sessions/{client.id}/ask", json=body, headers=client.auth) as streamed:
        events = list(sse_events(streamed))
    assert [e["event"] for e in events][0] == "started" and events[-1]["event"] == "done"
    assert {e["event"] for e in events[1:-1]} <= {"token"}

    memory = client.http.get(f"/sessions/{client.id}/memory", headers=client.auth).json()
    assert (memory["frames"], memory["video_time_s"]) == (10, 9.0)
    assert [(s["start_s"], s["end_s"]) for s in memory["spans"]] == [(t, t + 1) for t in range(10)]

    live = Client(stack.url)
    try:
        assert live.create(fps=1).status_code == 201
        socket = StreamSocket(live, "frames")
        assert socket.send_frames(5) is not None
        socket.send('{"type": "ask", "question": "What do you see?", "max_new_tokens": 3, "ref": "q"}')
        done = socket.wait_for(lambda e: e["type"] in ("answer_done", "answer_error"))
        assert (done["type"], done["ref"], done["video_time_s"]) == ("answer_done", "q", 4.0)
        socket.close()
    finally:
        live.delete()


def test_a_session_s_keys_share_one_slot_and_sessions_spread_over_masters(stack):
    users = [Client(stack.url) for _ in range(12)]
    try:
        for user in users:
            assert user.create().status_code == 201
        users[0].show_frames(2)
        assert users[0].ask("Here?", max_new_tokens=2).status_code == 200
        store = connect_sync(stack.redis_url, cluster=True)
        keys = Keys(stack.prefix)
        first = [key.decode() for key in store.scan_iter(match=f"{keys.session(users[0].id)}*")]
        # hash, media, questions, events, memory, asked, asked questions, lease, answer (at least)
        assert len(first) >= 9
        assert len({store.keyslot(key) for key in first}) == 1
        masters = {store.get_node_from_key(keys.session(user.id)).port for user in users}
        assert len(masters) >= 2  # 12 sessions on one of 3 masters: 3 in 3^12
    finally:
        for user in users:
            user.delete()


def test_a_killed_worker_s_stream_goes_on_elsewhere_on_a_cluster(redis_cluster, tmp_path):
    a_killed_worker_s_stream_goes_on_elsewhere(redis_cluster.url, tmp_path, REDIS_CLUSTER="true")


def test_a_prefix_with_braces_is_refused_at_start_up():
    with pytest.raises(ValidationError, match="redis_prefix\n  Value error, may not hold { or }"):
        GatewaySettings(redis_prefix="svqa{x}:")
    with pytest.raises(ValidationError, match="redis_prefix"):
        WorkerSettings(redis_prefix="}")


def test_the_launcher_needs_a_node_to_reach_a_cluster(tmp_path):
    env = {**os.environ, "REDIS_CLUSTER": "true", "REDIS_URL": "", "RUN_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "streamvqa.run"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "REDIS_CLUSTER=true needs REDIS_URL: a node of the cluster" in run.stderr


def test_a_cluster_starts_on_other_ports_when_one_it_chose_was_taken(tmp_path):
    cluster = LocalCluster(tmp_path / "cluster", masters=3)
    chosen = list(cluster.ports)
    with socket.socket() as squatter:  # another process binds a chosen port before the node does
        squatter.bind(("127.0.0.1", chosen[2]))
        squatter.listen()
        with cluster:
            assert cluster.ports != chosen and chosen[2] not in cluster.ports
            client = connect_sync(cluster.url, cluster=True)
            client.set("a-key", "a-value")
            assert client.get("a-key") in (b"a-value", "a-value")

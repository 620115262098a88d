"""Watches through the service: a real gateway and worker (the tiny random model) on one Redis.

The tiny model's p(yes) is arbitrary but never near 0 nor 1: a threshold of 1e-6 makes a
condition that is always true (it fires once, at its first check, and is never armed again), a
threshold of 1.0 one that never is."""

import os
import signal
import time
import uuid

import httpx
import pytest

from tests.media import timed_jpeg
from tests.support import Client, Stack, StreamSocket, delete_prefix, sample_video, sse_events

ALWAYS, NEVER = 1e-6, 1.0


def watch(client: Client, **body: object) -> httpx.Response:
    return client.http.post(f"/sessions/{client.id}/watches", json={"condition": "a bike is visible", **body}, headers=client.auth)


def watch_after(client: Client, watch_id: str, checks: int, timeout_s: float = 30) -> dict:
    """The watch once it has had `checks` checks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = client.http.get(f"/sessions/{client.id}/watches/{watch_id}", headers=client.auth).json()
        if found["checks"] >= checks:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the watch never had {checks} checks: {found}")


def test_a_watch_is_created_listed_looked_up_and_deleted(client):
    client.create(fps=1)
    created = watch(client, every_s=3, threshold=0.7)
    assert created.status_code == 201
    body = created.json()
    assert {k: body[k] for k in ("condition", "every_s", "threshold", "created_video_s", "fired")} == {
        "condition": "a bike is visible", "every_s": 3.0, "threshold": 0.7, "created_video_s": 0.0, "fired": [],
    }
    default = watch(client).json()
    assert (default["every_s"], default["threshold"]) == (2.0, 0.5)
    listed = client.http.get(f"/sessions/{client.id}/watches", headers=client.auth).json()
    assert [w["id"] for w in listed["watches"]] == [body["id"], default["id"]]
    assert listed["max_watches"] == 8
    assert client.http.get(f"/sessions/{client.id}/watches/{body['id']}", headers=client.auth).json()["id"] == body["id"]
    assert client.http.delete(f"/sessions/{client.id}/watches/{body['id']}", headers=client.auth).status_code == 204
    for gone in (client.http.get, client.http.delete):
        reply = gone(f"/sessions/{client.id}/watches/{body['id']}", headers=client.auth)
        assert (reply.status_code, reply.json()["code"]) == (404, "watch_not_found")
    assert [w["id"] for w in client.http.get(f"/sessions/{client.id}/watches", headers=client.auth).json()["watches"]] == [
        default["id"]
    ]


@pytest.mark.parametrize(("body", "field"), [
    ({"condition": ""}, "body.condition"),
    ({"condition": "   "}, "body.condition"),
    ({"condition": "x" * 301}, "body.condition"),
    ({"every_s": 0.4}, "body.every_s"),  # under the frame interval of a 2-fps session
    ({"every_s": 0}, "body.every_s"),
    ({"threshold": 0}, "body.threshold"),
    ({"threshold": 1.01}, "body.threshold"),
])
def test_an_invalid_watch_is_a_422_naming_its_field(client, body, field):
    client.create(fps=2)
    reply = watch(client, **body)
    assert (reply.status_code, reply.json()["code"]) == (422, "invalid_request"), reply.json()
    assert [f["field"] for f in reply.json()["fields"]] == [field]
    assert watch(client, every_s=0.5).status_code == 201  # the frame interval itself is allowed


def test_a_session_holds_at_most_max_watches_per_session(client):
    client.create()
    assert [watch(client).status_code for _ in range(8)] == [201] * 8
    refused = watch(client)
    assert (refused.status_code, refused.json()["code"]) == (429, "too_many_watches")
    assert "MAX_WATCHES_PER_SESSION" in refused.json()["message"]
    first = client.http.get(f"/sessions/{client.id}/watches", headers=client.auth).json()["watches"][0]["id"]
    client.http.delete(f"/sessions/{client.id}/watches/{first}", headers=client.auth)
    assert watch(client).status_code == 201


def test_another_sessions_token_neither_sees_nor_deletes_a_watch(stack, client):
    client.create()
    watch_id = watch(client).json()["id"]
    other = Client(stack.url)
    other.create()
    try:
        for method in ("GET", "DELETE"):
            reply = other.http.request(method, f"/sessions/{client.id}/watches/{watch_id}", headers=other.auth)
            assert reply.status_code == 403
        assert other.http.get(f"/sessions/{client.id}/watches", headers=other.auth).status_code == 403
        assert other.http.get(f"/sessions/{other.id}/watches/{watch_id}", headers=other.auth).status_code == 404
        assert httpx.get(f"{stack.url}/sessions/{client.id}/watches").status_code == 401
    finally:
        other.delete()
    assert client.http.get(f"/sessions/{client.id}/watches/{watch_id}", headers=client.auth).status_code == 200


def test_on_an_upload_a_true_condition_fires_once_at_its_first_check_and_an_impossible_one_never(client):
    client.create(fps=1)
    client.wait_for_state("ready")
    always = watch(client, every_s=2, threshold=ALWAYS).json()
    never = watch(client, every_s=2, threshold=NEVER).json()
    assert client.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202  # 10 s: frames at 0..9 s
    client.wait_for_state("ingested")
    fired = watch_after(client, always["id"], 4)
    assert fired["checked_s"] == pytest.approx(8.0, abs=0.01)  # checks at 2, 4, 6 and 8 s of video
    assert [f["time_s"] for f in fired["fired"]] == pytest.approx([2.0], abs=0.01)
    assert ALWAYS <= fired["fired"][0]["probability"] < 1
    evidence = fired["fired"][0]["evidence"]  # what the check that fired attended to, of the frames at 0, 1 and 2 s
    assert 1 <= len(evidence) <= 3 and {e["time_s"] for e in evidence} <= {0.0, 1.0, 2.0}
    assert all(0 < e["weight"] <= 1 for e in evidence)
    silent = watch_after(client, never["id"], 4)
    assert (silent["checked_s"], silent["fired"]) == (pytest.approx(8.0, abs=0.01), [])
    assert silent["probability"] == pytest.approx(fired["probability"], abs=1e-6)  # one condition, the same video
    # the firing is a `watch_fired` event, once, before the upload's end
    with client.http.stream("GET", f"/sessions/{client.id}/events?since=0", headers=client.auth) as events:
        seen = []
        for event in sse_events(events):
            seen.append(event)
            if event["event"] == "state" and event["data"]["state"] == "ingested":
                break
    sent = [e["data"] for e in seen if e["event"] == "watch_fired"]
    assert sent == [{"type": "watch_fired", "watch_id": always["id"], **fired["fired"][0]}]


def test_a_watch_created_part_way_never_reports_video_before_its_creation(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames")
    try:
        for second in range(5):  # 0..4 s in the cache
            socket.send(timed_jpeg(float(second), second))
        socket.wait_for(lambda e: e["type"] == "ingest" and e["frames"] == 5)
        deadline = time.monotonic() + 10
        while client.get().json()["video_time_s"] < 4 and time.monotonic() < deadline:  # the record follows the event
            time.sleep(0.05)
        created = watch(client, every_s=2, threshold=ALWAYS).json()
        assert created["created_video_s"] == pytest.approx(4.0)
        for second in range(5, 12):
            socket.send(timed_jpeg(float(second), second))
        socket.end()
        socket.wait_for(lambda e: (e["type"], e.get("state")) == ("state", "ingested"))
    finally:
        socket.close()
    checked = watch_after(client, created["id"], 3)  # at 6, 8 and 10 s
    assert checked["checked_s"] == pytest.approx(10.0, abs=0.01)
    assert [f["time_s"] for f in checked["fired"]] == pytest.approx([6.0], abs=0.01)
    # the stream socket relayed the firing, before the stream's end
    relayed = [e for e in socket.events if e["type"] == "watch_fired"]
    assert relayed == [{"type": "watch_fired", "watch_id": created["id"], **checked["fired"][0]}]


def test_a_worker_killed_after_a_firing_leaves_it_sent_once_and_its_successor_checks_on(redis_url, tmp_path):
    """Worker a fires a watch and is killed (SIGKILL); b takes the session over from its snapshot
    and replays the media no snapshot covered: it checks on from the last check Redis holds, and
    the firing is neither written nor sent again."""
    stack = Stack(
        redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", tmp_path, LEASE_TTL_S="2", SNAPSHOT_INTERVAL_S="600",
        SNAPSHOT_DIR=str(tmp_path / "snapshots"), LIVE_MAX_LAG_S="1000",
    )
    stack.start("a", "worker", WORKER_ID="a")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        user = Client(stack.url)
        user.create(fps=1)
        assert user.wait_for_state("ready")["worker"] == "a"
        stack.start("b", "worker", WORKER_ID="b")
        stack.wait_until_serving(workers=2)
        created = watch(user, every_s=2, threshold=ALWAYS).json()
        socket = StreamSocket(user, "frames")
        for second in range(10):
            socket.send(timed_jpeg(float(second), second))
        checked = watch_after(user, created["id"], 4)  # at 2, 4, 6 and 8 s
        os.kill(stack.processes["a"].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while user.get().json()["worker"] != "b":
            assert time.monotonic() - killed_at < 12, "no takeover"
            time.sleep(0.1)
        for second in range(10, 15):
            socket.send(timed_jpeg(float(second), second))
        socket.end()
        socket.wait_for(lambda e: (e["type"], e.get("state")) == ("state", "ingested"), timeout_s=60)
        socket.close()
        assert checked["checked_s"] == pytest.approx(8.0, abs=0.01)
        after = watch_after(user, created["id"], 7, timeout_s=10)  # b's at 10, 12 and 14 s: none again
        assert (after["checks"], after["checked_s"]) == (7, pytest.approx(14.0, abs=0.01))
        assert [f["time_s"] for f in after["fired"]] == pytest.approx([2.0], abs=0.01)
        with user.http.stream("GET", f"/sessions/{user.id}/events?since=0", headers=user.auth) as events:
            seen = []
            for event in sse_events(events):
                seen.append(event)
                if event["event"] == "state" and event["data"]["state"] == "ingested":
                    break
        assert [e["data"]["time_s"] for e in seen if e["event"] == "watch_fired"] == pytest.approx([2.0], abs=0.01)
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)

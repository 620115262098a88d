"""The whole path with real processes: create, upload a real video, watch it ingest, ask."""

import json
import threading
import time

import httpx

from tests.media import faststart_mp4
from tests.support import Client, StreamSocket, sample_video, sse_events


def test_bikes_at_one_fps_gives_ten_frames_then_an_answer(client):
    assert client.create(fps=1).status_code == 201
    video = sample_video("bikes.mp4")  # 10 s at 25 fps
    upload = client.upload(video.read_bytes())
    assert (upload.status_code, upload.json()) == (202, {"bytes": video.stat().st_size})

    session = client.wait_for_state("ingested", "error")
    assert session["state"] == "ingested", session["error"]
    assert session["frames_ingested"] == 10
    assert session["video_time_s"] == 9.0
    assert session["upload_bytes"] == video.stat().st_size
    assert session["cache_tokens"] > 10 * 16  # 16 visual tokens per frame, plus text

    reply = client.ask("What is happening in the video?", max_new_tokens=20)
    assert reply.status_code == 200
    answer = reply.json()
    assert 1 <= answer["tokens"] <= 20  # generation stops at <|im_end|> or the cap
    assert len(answer["answer"]) <= answer["tokens"]  # a character per token, none for <unk>
    assert answer["video_time_s"] == 9.0
    assert 1 <= len(answer["evidence"]) <= 3
    assert {e["time_s"] for e in answer["evidence"]} <= {float(t) for t in range(10)}
    assert answer["cache_tokens"] > session["cache_tokens"]  # question and answer stay in the cache
    assert 0 < answer["ttft_ms"] <= answer["total_ms"]


def test_a_multipart_upload_is_decoded_like_a_raw_one(client):
    client.create(fps=2)
    files = {"file": ("bunny.mp4", sample_video("bigbuckbunny.mp4").read_bytes(), "video/mp4")}
    reply = client.http.post(
        f"/sessions/{client.id}/upload", files=files, data={"note": "form fields are ignored"}, headers=client.auth
    )
    assert reply.status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"], session["video_time_s"]) == ("ingested", 11, 5.0)


def test_a_bad_upload_fails_its_session_only(stack):
    bad, good = Client(stack.url), Client(stack.url)
    bad.create()
    good.create()
    replies = {}
    uploads = [
        threading.Thread(target=lambda: replies.__setitem__("bad", bad.upload(b"not a video at all\n" * 500))),
        threading.Thread(target=lambda: replies.__setitem__("good", good.upload(sample_video("bikes.mp4").read_bytes()))),
    ]
    for thread in uploads:
        thread.start()
    for thread in uploads:
        thread.join()
    assert replies["bad"].status_code == replies["good"].status_code == 202

    failed = bad.wait_for_state("error", "ingested")
    assert failed["state"] == "error"
    assert "not a readable video file" in failed["error"]
    refused = bad.ask("what did you see?")
    assert (refused.status_code, refused.json()["code"]) == (409, "session_error")

    session = good.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"]) == ("ingested", 10)
    assert good.ask("and now?", max_new_tokens=4).status_code == 200

    # the worker still takes new sessions
    late = Client(stack.url)
    late.create()
    assert late.wait_for_state("ready")["worker"] == session["worker"]
    for user in (bad, good, late):
        user.http.close()


NO_VIDEO = "the session has no video yet: upload a file or stream to it, then ask"


def test_a_question_before_any_video_is_refused_until_a_frame_is_in(client):
    client.create()
    assert client.wait_for_state("ready")["frames_ingested"] == 0
    reply = client.ask("Is anything there?", max_new_tokens=5)
    assert (reply.status_code, reply.json()) == (409, {"code": "no_video", "message": NO_VIDEO})
    socket = StreamSocket(client, None)
    socket.send(json.dumps({"type": "ask", "question": "Is anything there?", "ref": "early"}))
    refused = socket.wait_for(lambda e: e["type"] == "answer_error")
    assert (refused["ref"], refused["code"], refused["message"]) == ("early", "no_video", NO_VIDEO)
    socket.close()

    client.show_frames(1)
    reply = client.ask("Is anything there?", max_new_tokens=5)
    assert reply.status_code == 200
    assert reply.json()["video_time_s"] == 0.0


def test_unknown_routes_are_json_404(stack):
    reply = httpx.get(f"{stack.url}/sessions/abc/nothing")
    assert reply.status_code == 404
    assert reply.json()["code"] == "not_found"


def test_a_long_upload_reports_its_share_in_the_cache_and_an_honest_time_left_at_every_step(client, tmp_path):
    # 60 s at 2 frames/s: 120 frames, 8 a step (FRAMES_PER_STEP), so 15 steps of 4 s of video each
    assert client.create(fps=2).status_code == 201
    video = tmp_path / "minute.mp4"
    faststart_mp4(60, video)
    assert client.upload(video.read_bytes()).status_code == 202
    looks = []  # the record while it ingests, as a client polling it sees it
    while (record := client.get().json())["state"] not in ("ingested", "error"):
        looks.append(record)
        time.sleep(0.1)
    assert record["state"] == "ingested", record["error"]
    assert (record["frames_ingested"], record["ingest_progress"], record["ingest_eta_s"]) == (120, 1.0, 0.0)
    shares = [look["ingest_progress"] for look in looks if look["frames_ingested"]]
    assert shares == sorted(shares) and len(set(shares)) >= 5, shares  # it moves, never back
    assert all(look["ingest_eta_s"] is None for look in looks if not look["frames_ingested"])

    with client.http.stream("GET", f"/sessions/{client.id}/events?since=0", headers=client.auth, timeout=10) as reply:
        steps = []
        for event in sse_events(reply):
            if event["event"] == "ingest":
                steps.append((int(event["id"].split("-")[0]) / 1000, event["data"]))
            if event["event"] == "state" and event["data"]["state"] == "ingested":
                break
    assert [data["progress"] for _, data in steps] == [round(4 * k / 60, 4) for k in range(1, 16)]
    assert all(data["eta_s"] > 0 for _, data in steps[:8]) and steps[-1][1]["eta_s"] == 0.0
    # the time left it said against the time it took (the events' ids are their times, in ms):
    # within a factor of 3, or 0.3 s, from a quarter of the way on
    end_s = steps[-1][0]
    for at_s, data in steps[3:-1]:
        assert data["eta_s"] / 3 - 0.3 <= end_s - at_s <= 3 * data["eta_s"] + 0.3, (end_s - at_s, data)

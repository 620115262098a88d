"""Live video over `WS /sessions/{id}/stream`, against a real gateway, worker and Redis."""

import json
import os
import random
import signal
import struct
import threading
import zlib

import pytest

from streamvqa.protocol import frame_message
from tests.media import file_bytes, jpeg, png, random_cuts, stream_bytes, timed_jpeg
from tests.support import Client, StreamSocket

SECONDS = 6  # each generated stream: 6 s at 10 frames per second
EXPECTED_TIMES = {
    1.0: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    2.0: [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5],
}


def _ingested(socket: StreamSocket) -> dict | None:
    return socket.wait_for(lambda e: e["type"] == "state" and e["state"] == "ingested")


@pytest.mark.parametrize("codec", ["libx264", "libvpx", "libvpx-vp9", "mpeg4"])
@pytest.mark.parametrize("fps", [1.0, 2.0])
def test_a_stream_cut_anywhere_reaches_the_engine_at_its_video_times(client, codec, fps):
    media_format, data = stream_bytes(codec, SECONDS)
    client.create(fps=fps)
    socket = StreamSocket(client, media_format)
    assert socket.started["type"] == "started"
    assert (socket.started["format"], socket.started["bytes_received"]) == (media_format, 0)
    for piece in random_cuts(data, seed=len(codec) * 10 + int(fps)):
        socket.send(piece)
    socket.end()
    assert _ingested(socket) is not None, socket.events
    assert socket.frame_times() == EXPECTED_TIMES[fps]
    session = client.get().json()
    assert (session["state"], session["media"], session["frames_ingested"]) == ("ingested", media_format, len(EXPECTED_TIMES[fps]))
    assert session["stream_bytes"] == len(data)
    socket.close()


def test_thirty_jpeg_frames_give_thirty_frames_at_their_times(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames", query_token=True)  # the token as a query parameter
    for second in range(30):
        socket.send(timed_jpeg(float(second), second))
    socket.end()
    assert _ingested(socket) is not None, socket.events
    assert socket.frame_times() == [float(second) for second in range(30)]
    assert client.get().json()["frames_ingested"] == 30
    mine = socket.started["connection"]
    states = [(e["state"], e["connection"]) for e in socket.events if e["type"] == "state"]
    assert states == [("ingesting", mine), ("ingested", mine)]  # each names the connection it is about
    socket.close()


def test_frames_out_of_order_or_repeated_are_skipped_with_a_warning(client):
    client.create(fps=2)
    socket = StreamSocket(client, "frames")
    for time_s in [0.0, 1.0, 1.0, 0.5, 2.0, 2.2, 2.5]:
        socket.send(timed_jpeg(time_s))
    socket.end()
    assert _ingested(socket) is not None
    assert socket.frame_times() == [0.0, 1.0, 2.0, 2.5]  # 2.2 is before the next 0.5 s point
    warnings = [e for e in socket.events if e["type"] == "warning"]
    assert [w["code"] for w in warnings] == ["frame_skipped", "frame_skipped"]
    assert "not after the previous frame" in warnings[0]["message"]


def test_a_reconnecting_client_resumes_its_webm_stream(client):
    media_format, data = stream_bytes("libvpx", SECONDS)
    cut = random.Random(7).randrange(len(data) // 3, 2 * len(data) // 3)
    client.create(fps=1)
    first = StreamSocket(client, media_format)
    for piece in random_cuts(data[:cut], seed=3, pieces=5):
        first.send(piece)
    first.wait_for(lambda e: e["type"] == "ingest")
    first.close()  # the connection drops, without `end`

    second = StreamSocket(client, media_format)
    assert second.started["bytes_received"] == cut
    for piece in random_cuts(data[cut:], seed=4, pieces=5):
        second.send(piece)
    second.end()
    ingested = _ingested(second)
    assert ingested is not None, second.events
    assert ingested["connection"] == second.started["connection"]  # not the first connection's departure
    session = client.get().json()
    assert (session["frames_ingested"], session["video_time_s"]) == (SECONDS, 5.0)  # every frame, once
    assert second.frame_times() == EXPECTED_TIMES[1.0][-len(second.frame_times()) :]
    assert first.frame_times()[0] == 0.0


def test_the_token_of_another_session_or_none_is_refused(stack):
    owner, other = Client(stack.url), Client(stack.url)
    owner.create()
    other.create()
    for token, code in [(other.token, 4401), ("", 4401)]:
        socket = StreamSocket(owner, "frames", token=token)
        assert socket.started is None and socket.close_code == code
    missing = Client(stack.url)
    missing.id, missing.token = "0" * 32, owner.token
    socket = StreamSocket(missing, "frames")
    assert socket.started is None and socket.close_code == 4404


def test_a_bad_start_message_closes_with_4400(client):
    client.create()
    socket = StreamSocket(client, "gif")
    assert socket.started is None
    assert socket.close_code == 4400
    assert "start" in socket.close_reason


def test_one_socket_at_a_time_and_no_stream_into_an_upload_session(client, stack):
    client.create()
    streaming = StreamSocket(client, "frames")
    second = StreamSocket(client, "frames")
    assert (second.started, second.close_code) == (None, 4409)
    streaming.close()

    uploaded = Client(stack.url)
    uploaded.create()
    assert uploaded.upload(file_bytes("mp4", 2.0)).status_code == 202
    socket = StreamSocket(uploaded, "webm")
    assert (socket.started, socket.close_code) == (None, 4409)
    assert "upload" in socket.close_reason


def _png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares `width` x `height` pixels (and holds almost none)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _bad_stream(user: Client, media_format: str, messages: list[bytes], end: bool = True) -> StreamSocket:
    socket = StreamSocket(user, media_format)
    for message in messages:
        socket.send(message)
    if end:
        socket.end()
    return socket


def test_bad_media_gets_clear_errors_while_another_stream_goes_on(stack):
    good = Client(stack.url)
    good.create(fps=2)
    media_format, data = stream_bytes("libvpx", SECONDS)
    good_socket = StreamSocket(good, media_format)
    good_result: dict = {}

    def stream_the_good_one() -> None:
        for piece in random_cuts(data, seed=11, pieces=30):
            good_socket.send(piece)
        good_socket.end()
        good_result["ingested"] = _ingested(good_socket)

    sender = threading.Thread(target=stream_the_good_one)
    sender.start()

    cases = {
        "random bytes": ("webm", [random.Random(1).randbytes(50_000)]),
        "a webm header, then random bytes": ("webm", [data[:200] + random.Random(2).randbytes(50_000)]),
        "a png declared as webm": ("webm", [png(0)]),
        "a truncated mp4": ("mp4", [stream_bytes("libx264", 2.0)[1][:300]]),
        "an audio-only webm": ("webm", [_audio_only_webm()]),
    }
    for name, (media_format, messages) in cases.items():
        user = Client(stack.url)
        user.create()
        socket = _bad_stream(user, media_format, messages)
        event = socket.wait_for(lambda e: e["type"] == "error", timeout_s=30)
        assert event is not None and event["code"] == "decode_failed", (name, socket.events)
        assert socket.wait_closed() == 1007, name

    empty = Client(stack.url)
    empty.create()
    socket = _bad_stream(empty, "webm", [])
    event = socket.wait_for(lambda e: e["type"] == "error")
    assert event["code"] == "empty_stream"

    huge = Client(stack.url)
    huge.create()
    socket = _bad_stream(huge, "frames", [frame_message(0.0, _png_declaring(20_000, 20_000)), timed_jpeg(1.0)])
    event = socket.wait_for(lambda e: e["type"] == "error")
    assert event["code"] == "bad_frame" and "20000x20000" in event["message"]
    assert _ingested(socket) is not None
    assert socket.frame_times() == [1.0]  # the stream goes on after a bad frame

    garbage = Client(stack.url)
    garbage.create()
    socket = _bad_stream(garbage, "frames", [b"\x00\x01", frame_message(-1.0, jpeg(0)), frame_message(0.0, b"GIF89a...")], end=False)
    errors = [socket.wait_for(lambda e: e["type"] == "error") for _ in range(3)]
    assert [e["code"] for e in errors] == ["bad_frame"] * 3
    socket.close()

    oversized = Client(stack.url)
    oversized.create()
    socket = _bad_stream(oversized, "frames", [timed_jpeg(0.0) + b"\0" * (5 * 1024 * 1024)], end=False)
    assert socket.wait_closed() == 1009

    sender.join(timeout=120)
    assert good_result.get("ingested") is not None, good_socket.events
    assert good_socket.frame_times() == EXPECTED_TIMES[2.0]
    assert stack.processes["worker"].poll() is None  # the worker is still up


def _audio_only_webm() -> bytes:
    import io

    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000)
        for i in range(20):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.float32), format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48000, i * 960
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def test_a_stalled_worker_brings_backpressure_then_a_close_if_ignored(client, stack):
    client.create(fps=4)
    client.wait_for_state("ready")
    socket = StreamSocket(client, "frames")
    worker = stack.processes["worker"]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        for i in range(100):  # more than the 64-entry backlog
            socket.send(timed_jpeg(i * 0.25))
        event = socket.wait_for(lambda e: e["type"] == "backpressure", timeout_s=30)
        assert event is not None and event["paused"] is True and event["backlog"] >= 64
        for i in range(100, 140):  # sent after the pause: the 33rd closes the socket
            if not socket.send(timed_jpeg(i * 0.25)):
                break
        assert socket.wait_closed() == 4429
    finally:
        os.kill(worker.pid, signal.SIGCONT)


def test_deleting_a_session_mid_stream_closes_its_socket_and_leaves_no_keys(client, stack, redis_url):
    import redis

    client.create(fps=4)
    socket = StreamSocket(client, "frames")
    socket.send(timed_jpeg(0.0))
    socket.wait_for(lambda e: e["type"] == "ingest")
    client.delete()
    for i in range(1, 5):
        socket.send(timed_jpeg(float(i)))
    assert socket.wait_closed() == 4404
    store = redis.Redis.from_url(redis_url)
    leftovers = store.keys(f"{stack.prefix}session:{{{client.id}}}*")
    assert [key for key in leftovers if store.ttl(key) < 0] == []  # nothing that never expires
    assert {key.decode().rsplit(":", 1)[-1] for key in leftovers} <= {"lease"}  # freed at the next heartbeat


def test_a_question_on_the_stream_socket_is_answered_there(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames")
    assert socket.send_frames(3) is not None
    socket.send(json.dumps({"type": "ask", "question": "What do you see?", "max_new_tokens": 5, "ref": "q1"}))
    done = socket.wait_for(lambda e: e["type"] in ("answer_done", "answer_error"))
    assert done["type"] == "answer_done", done
    answer_events = [e for e in socket.events if e["type"].startswith("answer_")]
    assert answer_events[0]["type"] == "answer_started"
    assert {e["ref"] for e in answer_events} == {"q1"} and len({e["answer_id"] for e in answer_events}) == 1
    tokens = [e["text"] for e in answer_events if e["type"] == "answer_token"]
    assert "".join(tokens) == done["answer"] and 1 <= done["tokens"] <= 5
    assert done["video_time_s"] == 2.0  # the question saw the three frames sent before it

    socket.send(json.dumps({"type": "ask", "question": "", "ref": "q2"}))
    refused = socket.wait_for(lambda e: e["type"] == "answer_error")
    assert (refused["ref"], refused["code"], refused["answer_id"]) == ("q2", "invalid_request", None)
    socket.close()


def test_a_question_sent_right_after_frames_sees_every_one_of_them(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames")
    sent = 0
    for round_frames, ref in [(5, "first"), (2, "second")]:
        for _ in range(round_frames):  # no waiting for the frames: the question comes right behind them
            socket.send(timed_jpeg(float(sent), sent))
            sent += 1
        socket.send(json.dumps({"type": "ask", "question": "What now?", "max_new_tokens": 2, "ref": ref}))
        done = socket.wait_for(lambda e: e["type"] in ("answer_done", "answer_error") and e["ref"] == ref)
        assert done["type"] == "answer_done", done  # not `no_video`
        assert done["video_time_s"] == sent - 1  # the last frame sent before it, at 4 s, then at 6 s
    assert client.get().json()["frames_ingested"] == 7
    socket.close()


def test_a_socket_without_a_format_watches_another_sockets_stream_and_asks(client):
    client.create(fps=1)
    watcher = StreamSocket(client, None)
    assert (watcher.started["format"], watcher.started["bytes_received"]) == (None, 0)
    streamer = StreamSocket(client, "frames")  # a watcher does not hold the session's media
    assert streamer.started["type"] == "started"
    for second in range(2):
        streamer.send(timed_jpeg(float(second), second))
    assert watcher.wait_for(lambda e: e["type"] == "ingest" and e["frames"] == 2) is not None
    watcher.send(json.dumps({"type": "ask", "question": "Anything?", "max_new_tokens": 2}))
    assert watcher.wait_for(lambda e: e["type"] == "answer_done")["ref"] is None
    assert not any(e["type"].startswith("answer_") for e in streamer.events)  # answers go to the asker only
    watcher.send(json.dumps({"type": "end"}))  # a watcher has no stream to end
    assert watcher.wait_for(lambda e: e["type"] == "error")["code"] == "bad_message"
    watcher.send(timed_jpeg(2.0, 2))
    assert watcher.wait_closed() == 4400
    streamer.close()


def test_an_undecodable_stream_leaves_the_session_ready_for_another(client):
    client.create(fps=2)
    socket = _bad_stream(client, "mp4", [random.Random(3).randbytes(50_000)], end=False)
    assert socket.wait_closed() == 1007  # closed before the client could say `end`
    assert client.wait_for_state("ready", timeout_s=30)["frames_ingested"] == 0  # not left "ingesting"
    media_format, data = stream_bytes("libx264", SECONDS)
    again = StreamSocket(client, media_format)
    for piece in random_cuts(data, seed=5, pieces=10):
        again.send(piece)
    again.end()
    assert _ingested(again) is not None
    assert again.frame_times() == EXPECTED_TIMES[2.0]


def test_an_image_too_large_to_decode_is_refused_by_its_header(client):
    client.create()
    bomb = _png_declaring(8192, 8192)  # 200 MB of pixels once decoded
    socket = _bad_stream(client, "frames", [frame_message(0.0, bomb), timed_jpeg(1.0)])
    event = socket.wait_for(lambda e: e["type"] == "error")
    assert event["code"] == "bad_frame" and "8192x8192 frame is larger than the limit of 16777216 pixels" in event["message"]
    assert _ingested(socket) is not None
    assert socket.frame_times() == [1.0]

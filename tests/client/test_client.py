"""streamvqa.client against a real gateway, worker and Redis: sessions, uploads, answers whole
and streamed, live frames with questions on the socket, errors; sync and async."""

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamvqa.client import Answer, AsyncClient, Client, StreamvqaError, file_frames
from streamvqa.client.live import LiveStream
from streamvqa.client.sse import SessionEvents, SseDecoder
from streamvqa.redis_server import free_port
from tests.media import jpeg
from tests.support import sample_video

BIKES = sample_video("bikes.mp4")  # 10 s at 25 fps, 509,868 bytes
BIKES_TIMES = [float(t) for t in range(10)]  # its frames at fps 1
CARPHONE = sample_video("carphone_pristine.mp4")  # 4 frames at fps 1, the last at 3.003 s
# The tiny random model's p(yes) is arbitrary but never near 0 nor 1: a watch at ALWAYS fires once,
# at its first check, and is never armed again; one at NEVER never fires (tests/app/test_watches.py).
ALWAYS, NEVER = 1e-6, 1.0
WATCH_READ_S = 0.7  # the worker reads a session's watches every 0.5 s


@pytest.fixture(scope="module")
def api(stack):
    with Client(stack.url, timeout_s=60) as client:  # a hang fails in a minute, not at the ask timeout
        yield client


@pytest.fixture(scope="module")
def bikes(api):
    """bikes.mp4 uploaded at fps 1 and ingested, with the progress reported on the way."""
    session = api.create_session(fps=1)
    uploads, records = [], []
    sent = session.upload(BIKES, progress=lambda done, total: uploads.append((done, total)))
    final = session.wait_until_ingested(progress=records.append, timeout_s=120)
    yield session, sent, uploads, records, final
    session.delete()


def assert_answer_is_about_bikes(answer: Answer, question: str, max_new_tokens: int) -> None:
    assert answer.question == question
    assert len(answer.answer_id) == 32
    assert 1 <= answer.tokens <= max_new_tokens
    assert len(answer.answer) <= answer.tokens  # the tiny random model: at most a character per token
    assert answer.video_time_s == 9.0
    assert 1 <= len(answer.evidence) <= 3
    assert {e.time_s for e in answer.evidence} <= set(BIKES_TIMES)
    assert all(0 < e.weight <= 1 for e in answer.evidence)


def test_an_upload_goes_in_chunks_and_the_ingest_is_watched_to_its_end(bikes):
    _, sent, uploads, records, final = bikes
    size = BIKES.stat().st_size
    assert sent == size
    assert uploads == [(size, size)]  # one 1 MiB chunk holds it
    assert (final["state"], final["frames_ingested"], final["video_time_s"]) == ("ingested", 10, 9.0)
    assert final["media_duration_s"] == 10.0
    assert records[-1] == final
    times = [record["video_time_s"] for record in records]
    assert times == sorted(times)


def test_a_large_upload_reports_progress_per_chunk(api, tmp_path):
    video = tmp_path / "padded.mp4"  # 3 MiB: bikes, then zeros the container ignores
    video.write_bytes(BIKES.read_bytes() + bytes(3 * 1024 * 1024 - BIKES.stat().st_size))
    uploads = []
    with api.create_session(fps=1) as session, video.open("rb") as file:
        assert session.upload(file, progress=lambda done, total: uploads.append((done, total))) == 3 * 1024 * 1024
    assert uploads == [(n * 1024 * 1024, 3 * 1024 * 1024) for n in (1, 2, 3)]


def test_ask_answers_about_the_whole_video(bikes):
    session = bikes[0]
    answer = session.ask("What is happening?", max_new_tokens=16)
    assert_answer_is_about_bikes(answer, "What is happening?", 16)
    assert 0 < answer.ttft_ms <= answer.total_ms


def test_a_streamed_answer_comes_in_pieces_that_make_the_answer(bikes):
    session = bikes[0]
    stream = session.ask_stream("Who rides?", max_new_tokens=24)
    pieces = list(stream)
    assert_answer_is_about_bikes(stream.answer, "Who rides?", 24)
    assert "".join(pieces) == stream.answer.answer
    assert len(pieces) > 1 or len(stream.answer.answer) <= 1  # token by token, not all at once


def test_sampling_options_reach_the_answer_and_bad_ones_are_refused(bikes):
    session = bikes[0]
    answer = session.ask("Who rides?", max_new_tokens=3, temperature=1.0, top_k=40, seed=11)
    assert answer.tokens <= 3 and answer.finish_reason == ("length" if answer.tokens == 3 else "stop")
    stream = session.ask_stream("Who rides?", max_new_tokens=3, temperature=0.8, stop=["never"])
    assert "".join(stream) == stream.answer.answer and stream.answer.tokens <= 3
    with pytest.raises(StreamvqaError) as refused:
        session.ask("Who rides?", temperature=5)
    assert (refused.value.status, refused.value.code) == (422, "invalid_request")
    assert "body.temperature: Input should be less than or equal to 2" in str(refused.value)


def test_memory_shows_the_cache_by_spans_of_video(bikes):
    memory = bikes[0].memory()
    assert (memory["policy"], memory["budget_tokens"]) == ("infmllm", 8192)
    assert (memory["frames"], memory["video_time_s"]) == (10, 9.0)
    assert memory["cache_tokens"] > 0 and memory["frame_tokens"] > 0
    assert memory["spans"]
    for span in memory["spans"]:  # [start_s, end_s) in whole seconds
        assert 0 <= span["start_s"] < span["end_s"] <= 10
        assert 0 <= span["frame_held"] <= span["frame_seen"]


def test_without_api_keys_sessions_lists_none_and_a_session_shows_by_its_token(api, bikes):
    assert bikes[0].id not in [record["id"] for record in api.sessions()]  # an address owns nothing (docs/api.md)
    assert bikes[0].info()["state"] == "ingested"


def test_failures_raise_one_error_type_with_status_and_code(api, bikes):
    def error(call) -> tuple[int | None, str]:
        with pytest.raises(StreamvqaError) as raised:
            call()
        return raised.value.status, raised.value.code

    session = bikes[0]
    assert error(lambda: api.session("0" * 32, session.token).info()) == (404, "session_not_found")
    assert error(lambda: api.session(session.id, "not-the-token").info()) == (403, "forbidden")
    assert error(lambda: api.create_session(fps=9)) == (422, "invalid_request")
    with pytest.raises(StreamvqaError) as unknown:
        api.create_session(model="no-such-model")
    assert (unknown.value.status, unknown.value.code, unknown.value.retry_after_s) == (404, "model_not_found", None)
    assert error(lambda: session.upload(CARPHONE)) == (409, "media_exists")
    too_big = io.BytesIO(bytes(5 * 1024 * 1024))  # the stack's limit is 4 MiB
    assert error(lambda: session.upload(too_big)) == (413, "upload_too_large")
    assert error(lambda: session.stream_frames([(0.0, jpeg(0))])) == (4409, "conflict")  # it has an upload
    with Client(f"http://127.0.0.1:{free_port()}") as nowhere:
        status, code = error(nowhere.create_session)
    assert (status, code) == (None, "unreachable")

    with api.create_session() as doomed:
        pass  # deleted on exit
    assert error(doomed.info) == (404, "session_not_found")
    doomed.delete()  # deleting it again is no error


def test_watches_fire_as_an_upload_goes_in_and_are_listed_and_removed(api):
    with api.create_session(fps=1) as session:
        always = session.watch("a bike is visible", every_s=2, threshold=ALWAYS)
        never = session.watch("a bike is visible", threshold=NEVER)
        assert (always.every_s, always.threshold, always.created_video_s, always.fired) == (2.0, ALWAYS, 0.0, [])
        assert (never.every_s, never.threshold) == (2.0, NEVER)  # the gateway's default every_s
        time.sleep(WATCH_READ_S)
        session.upload(BIKES)  # frames at 0..9 s: checks at 2, 4, 6 and 8 s
        fired = list(session.firings())
        assert [(f.watch_id, f.time_s) for f in fired] == [(always.id, 2.0)]
        assert ALWAYS <= fired[0].probability < 1
        watches = session.watches()
        assert [(w.id, [f.time_s for f in w.fired]) for w in watches] == [(always.id, [2.0]), (never.id, [])]
        assert watches[0].fired[0].probability == fired[0].probability
        session.unwatch(never.id)
        session.unwatch(never.id)  # a gone watch is no error
        assert [w.id for w in session.watches()] == [always.id]
        with pytest.raises(StreamvqaError) as refused:
            session.watch("a bike is visible", every_s=0.5)  # under the 1 s frame interval
        assert (refused.value.status, refused.value.code) == (422, "invalid_request")


def test_firings_of_a_session_whose_media_failed_raise(api):
    with api.create_session(fps=1) as session:
        session.watch("a bike is visible", threshold=ALWAYS)
        session.upload(io.BytesIO(b"not a video at all\n" * 100))
        with pytest.raises(StreamvqaError) as failed:
            list(session.firings())
    assert (failed.value.status, failed.value.code) == (None, "session_error")


def test_frames_stream_in_and_are_sampled_at_the_session_fps(api):
    events = []
    with api.create_session(fps=1) as session:
        frames = [(i * 0.5, jpeg(i)) for i in range(7)]  # 0.0, 0.5, ... 3.0 s
        result = session.stream_frames(frames, on_event=events.append)
        record = session.info()
    assert (result.frames_sent, result.frames_ingested, result.video_time_s, result.frames_dropped) == (7, 4, 3.0, 0)
    assert result.answers == []
    assert [t for e in events if e["type"] == "ingest" for t in e["times"]] == [0.0, 1.0, 2.0, 3.0]
    assert (record["media"], record["state"], record["frames_ingested"]) == ("frames", "ingested", 4)


def test_a_file_streams_as_frames_with_a_question_every_few_seconds(api):
    heard = []
    with api.create_session(fps=1) as session:
        result = session.stream_file(
            BIKES, speed=None, question="What changed?", every_s=4, max_new_tokens=8, on_answer=heard.append
        )
    assert (result.frames_sent, result.frames_ingested, result.video_time_s, result.frames_dropped) == (10, 10, 9.0, 0)
    assert result.answers == heard
    times = [answer.video_time_s for answer in heard]  # at 4 s or later, at 8 s or later, ...; the last saw it all
    assert times[0] >= 4.0 and times[-1] == 9.0
    assert all(earlier < later for earlier, later in zip(times, times[1:]))  # none asked about what one saw
    for answer in heard:
        assert (answer.question, 1 <= answer.tokens <= 8) == ("What changed?", True)
        assert {e.time_s for e in answer.evidence} <= set(BIKES_TIMES)


def test_a_stream_pauses_while_the_gateway_says_so(api, stack):
    """With the worker stopped, the backlog fills and the gateway says pause; a client that went
    on sending would be closed (4429). This one waits, and every frame arrives once it resumes."""
    events = []
    worker = stack.processes["worker"]
    frames = [(i * 0.25, jpeg(i)) for i in range(100)]  # more than the gateway's 64-entry backlog
    with api.create_session(fps=4) as session, ThreadPoolExecutor(1) as pool:
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            streaming = pool.submit(session.stream_frames, frames, on_event=events.append)
            while not streaming.done() and not any(e["type"] == "backpressure" for e in events):
                time.sleep(0.05)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        result = streaming.result()
    assert [e["paused"] for e in events if e["type"] == "backpressure"][:2] == [True, False]
    assert (result.frames_sent, result.frames_ingested + result.frames_dropped) == (100, 100)


def test_the_async_client_does_the_same(stack):
    async def scenario() -> None:
        async with AsyncClient(stack.url, timeout_s=60) as api:
            async with await api.create_session(fps=1) as session:
                uploads = []
                with CARPHONE.open("rb") as file:
                    sent = await session.upload(file, progress=lambda done, total: uploads.append((done, total)))
                assert sent == CARPHONE.stat().st_size and uploads == [(sent, sent)]
                record = await session.wait_until_ingested(timeout_s=120)
                assert (record["state"], record["frames_ingested"], record["video_time_s"]) == ("ingested", 4, 3.003)
                answer = await session.ask("What is on screen?", max_new_tokens=8)
                assert 1 <= answer.tokens <= 8 and answer.video_time_s == 3.003
                stream = session.ask_stream("And now?", max_new_tokens=8)
                pieces = [piece async for piece in stream]
                assert "".join(pieces) == stream.answer.answer and 1 <= stream.answer.tokens <= 8

            async def frames():
                for i in range(5):
                    yield i * 1.0, jpeg(i)

            async with await api.create_session(fps=1) as live:
                result = await live.stream_frames(frames(), question="What moves?", every_s=2, max_new_tokens=4)
                assert (result.frames_sent, result.frames_ingested, result.video_time_s) == (5, 5, 4.0)
                assert result.answers[-1].video_time_s == 4.0
                assert all(a.video_time_s >= 2.0 for a in result.answers)

            async with await api.create_session(fps=1) as watched:
                always = await watched.watch("a phone", every_s=1, threshold=ALWAYS)
                never = await watched.watch("a phone", every_s=1, threshold=NEVER)
                await asyncio.sleep(WATCH_READ_S)
                await watched.upload(CARPHONE)  # frames at 0, 1.001, 2.002 and 3.003 s (29.97 frames/s)
                assert [(f.watch_id, f.time_s) async for f in watched.firings()] == [(always.id, 1.001)]
                assert [w.id for w in await watched.watches()] == [always.id, never.id]
                await watched.unwatch(always.id)
                assert [(w.id, w.fired) for w in await watched.watches()] == [(never.id, [])]

            async with await api.create_session(fps=1) as played:
                result = await played.stream_file(CARPHONE, speed=None, question="Where?")
                assert (result.frames_ingested, [a.video_time_s for a in result.answers]) == (4, [3.003])

    asyncio.run(scenario())


def test_the_client_needs_neither_torch_nor_media_libraries_to_import():
    heavy = "{'torch', 'av', 'PIL', 'numpy', 'worker', 'engine'}"
    code = f"import sys, streamvqa.client, streamvqa.cli; print(sorted({heavy} & sys.modules.keys()))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_streaming_a_file_without_pyav_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(ImportError) as missing:
        file_frames(BIKES, fps=1)
    assert "needs PyAV and Pillow (av is missing): pip install 'streamvqa[worker]'" in str(missing.value)


# -- the protocol logic, without a gateway -------------------------------------------------------


def test_server_sent_events_are_decoded_with_their_ids():
    decoder = SseDecoder()
    lines = ["retry: 2000", "", ": keep-alive", "", "id: 1-0", "event: token", 'data: {"text": "a"}', "",
             "data: two", "data: lines", "", "event: done"]  # the last event is not over yet
    events = [event for line in lines if (event := decoder.feed(line))]
    assert [(e.event, e.data, e.id) for e in events] == [
        ("token", '{"text": "a"}', "1-0"),
        ("message", "two\nlines", "1-0"),  # no event name: "message"; the id carries on
    ]


def test_a_session_s_events_end_with_the_event_saying_it_is_gone():
    events = SessionEvents()
    lines = ['data: {"type": "state", "state": "ready"}', "", ": keep-alive", "",
             'event: gone', 'data: {"type": "gone", "message": "the session was deleted or expired"}', ""]
    bodies = [events.take(line) for line in lines]
    assert [body for body in bodies if body is not None] == [{"type": "state", "state": "ready"}]
    assert events.done and bodies[-1] is None  # the gone event is not handed on: it ends the stream


def ingested_to(live: LiveStream, time_s: float) -> list[str]:
    """The refs of the questions asked when the cache reaches `time_s`."""
    event = {"type": "ingest", "frames": int(time_s) + 1, "times": [time_s], "video_time_s": time_s,
             "lag_s": 0.0, "dropped": 0, "cache_tokens": 9}
    return [message["ref"] for message in live.handle(event)]


def answered(live: LiveStream, ref: str, time_s: float) -> list[str]:
    """The refs of the questions asked when the answer to `ref`, which saw `time_s`, comes."""
    event = {"type": "answer_done", "ref": ref, "answer_id": ref, "answer": "x", "tokens": 1, "evidence": [],
             "video_time_s": time_s, "cache_tokens": 9}
    return [message["ref"] for message in live.handle(event)]


def test_a_live_stream_asks_at_each_multiple_of_every_s_one_question_at_a_time():
    live = LiveStream("q?", every_s=5, max_new_tokens=8)
    live.started({"type": "started", "connection": "c1"})
    assert [ingested_to(live, t) for t in (0.0, 4.0, 5.0, 6.0, 11.0)] == [[], [], ["q1"], [], []]  # q1 pending at 11
    assert answered(live, "q1", 5.0) == ["q2"]  # 10 s passed meanwhile: asked now
    assert ingested_to(live, 12.0) == []
    live.end()
    assert live.handle({"type": "state", "state": "ingested"}) == []  # q2 still pending
    assert answered(live, "q2", 11.0) == ["q3"]  # it saw 11 s of 12: once more, about it all
    assert not live.finished
    assert answered(live, "q3", 12.0) == [] and live.finished
    assert [a.video_time_s for a in live.summary().answers] == [5.0, 11.0, 12.0]


def test_a_live_stream_asks_nothing_an_answer_already_saw():
    live = LiveStream("q?", every_s=2)
    assert ingested_to(live, 2.0) == ["q1"]
    assert ingested_to(live, 5.0) == []
    assert answered(live, "q1", 5.0) == []  # it saw up to 5 s: the next point is 6 s
    assert ingested_to(live, 6.0) == ["q2"]
    live.end()
    live.handle({"type": "state", "state": "ingested"})
    assert answered(live, "q2", 6.0) == [] and live.finished  # the last answer saw it all


def test_fatal_stream_errors_and_close_codes_become_errors():
    live = LiveStream()
    live.started({"type": "started", "connection": "c1"})
    assert live.handle({"type": "error", "code": "bad_frame", "message": "skipped", "connection": "c1"}) == []
    assert live.handle({"type": "error", "code": "decode_failed", "message": "x", "connection": "other"}) == []
    with pytest.raises(StreamvqaError) as raised:
        live.handle({"type": "error", "code": "decode_failed", "message": "not a video", "connection": "c1"})
    assert (raised.value.status, raised.value.code) == (None, "decode_failed")
    undecodable = live.closed(1007, "")  # the close that follows says what the error event said
    assert (undecodable.status, undecodable.code, undecodable.message) == (1007, "decode_failed", "not a video")
    gone = LiveStream().closed(4404, "no session")
    assert (gone.status, gone.code, gone.message) == (4404, "session_not_found", "no session")

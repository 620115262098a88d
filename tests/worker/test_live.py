"""Live ingest without a server: the real-time frame queue, and streams that break, rejoin and restart."""

import threading
import time

import numpy as np
import pytest

from streamvqa.protocol import MediaEntry, MediaKind
from tests.media import random_cuts, stream_bytes, timed_jpeg
from worker.buffers import ByteFeed, FrameQueue
from worker.decode import Frame
from worker.ingest import FramesIngest, LiveLimits, StreamIngest

LIMITS = LiveLimits(feed_bytes=4 << 20, queue_frames=64, max_lag_s=100.0, read_ahead=8)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _frame(time_s: float) -> Frame:
    return Frame(np.zeros((2, 2, 3), np.uint8), time_s)


def test_an_engine_slower_than_real_time_sees_the_newest_frames():
    clock = Clock()
    queue = FrameQueue(capacity=16, max_lag_s=2.0, clock=clock)
    taken = []
    for second in range(10):  # one frame a second, in real time; the engine takes one every 3 s
        clock.now = 1000.0 + second
        assert queue.put(_frame(float(second)))
        if second % 3 == 0:
            frames, lag_s = queue.take(1)
            taken.append((frames[0].time_s, lag_s))
    assert taken == [(0.0, 0.0), (1.0, 2.0), (4.0, 2.0), (7.0, 2.0)]  # 2, 3, 5, 6 were late by more than 2 s
    assert queue.dropped == 4


def test_a_client_faster_than_real_time_is_never_dropped_but_fills_the_queue():
    clock = Clock()
    queue = FrameQueue(capacity=4, max_lag_s=2.0, clock=clock)
    assert [queue.put(_frame(t), block=False) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [True] * 4 + [False]
    clock.now += 1.5  # frame 0 is 1.5 s late, within the limit; frame 3 is early
    frames, lag_s = queue.take(8)
    assert [f.time_s for f in frames] == [0.0, 1.0, 2.0, 3.0]
    assert (lag_s, queue.dropped) == (0.0, 0)


def test_frames_sent_while_the_session_answers_wait_for_the_answer_instead_of_being_dropped():
    clock = Clock()
    queue = FrameQueue(capacity=16, max_lag_s=2.0, clock=clock)
    for second in range(3):  # real time, taken as they come
        clock.now = 1000.0 + second
        queue.put(_frame(float(second)))
        assert [f.time_s for f in queue.take(8)[0]] == [float(second)]
    queue.hold(True)  # a 5-s answer: frames 3 to 7 come meanwhile and wait
    for second in range(3, 8):
        clock.now = 1000.0 + second
        assert queue.put(_frame(float(second)), block=False)
    clock.now = 1008.0
    queue.hold(False)
    queue.put(_frame(8.0))
    frames, lag_s = queue.take(4)  # the engine catches up, 4 frames a step
    assert ([f.time_s for f in frames], lag_s) == ([3.0, 4.0, 5.0, 6.0], 2.0)
    clock.now = 1009.0
    queue.put(_frame(9.0))
    frames, lag_s = queue.take(4)
    assert ([f.time_s for f in frames], lag_s) == ([7.0, 8.0, 9.0], 0.0)
    assert queue.dropped == 0 and queue.grace_s == 0.0  # nothing lost; caught up, the real-time rule is whole again
    for second in range(10, 14):  # an engine slower than the stream still loses its oldest frames
        clock.now = 1000.0 + second
        queue.put(_frame(float(second)))
    frames, _ = queue.take(1)
    assert frames[0].time_s == 11.0 and queue.dropped == 1


def test_the_byte_feed_blocks_its_reader_until_bytes_come():
    feed = ByteFeed(max_bytes=10)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(feed.read(4)))
    reader.start()
    reader.join(timeout=0.2)
    assert reader.is_alive() and got == []  # nothing to read yet: it waits
    feed.write(b"xy")
    reader.join(timeout=5)
    assert got == [b"xy"]


def test_the_byte_feed_hands_over_its_bytes_then_the_end():
    feed = ByteFeed(max_bytes=10)
    feed.write(b"abcdefgh")
    assert feed.room_bytes == 2
    assert feed.read(5) == b"abcde"
    feed.write(b"ij")
    feed.end_input()
    assert feed.read(100) == b"fgh"
    assert feed.read(100) == b"ij"
    assert feed.read(100) == b""


def _drain(ingest, timeout_s: float = 20) -> list[float]:
    times: list[float] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        times += [f.time_s for f in ingest.next_frames(8).frames]
        if ingest.finished:
            return times
        time.sleep(0.01)
    raise AssertionError(f"the stream never finished; got {times}")


def _moof_offsets(data: bytes) -> list[int]:
    """Where each `moof` box (a fragment) of a fragmented MP4 starts."""
    return [i - 4 for i in range(len(data)) if data[i : i + 4] == b"moof"]


def _connect(ingest, media_format: str, connection: str) -> None:
    ingest.receive(MediaEntry(MediaKind.CONNECT, format=media_format, connection=connection))


@pytest.mark.parametrize("codec", ["libx264", "libvpx"])
def test_a_new_stream_on_the_same_session_continues_its_video_times(codec):
    media_format, data = stream_bytes(codec, 3.0)
    ingest = StreamIngest(media_format, fps=1.0, max_side=768, limits=LIMITS)
    try:
        for connection in ("first", "second"):  # a client that restarts its recorder
            _connect(ingest, media_format, connection)
            for piece in random_cuts(data, seed=5, pieces=6):
                ingest.receive(MediaEntry(MediaKind.DATA, data=piece))
        ingest.receive(MediaEntry(MediaKind.END))
        assert _drain(ingest) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert ingest.take_errors() == []
    finally:
        ingest.close()


def test_a_stream_rejoined_mid_way_resumes_at_its_next_fragment():
    media_format, data = stream_bytes("libx264", 6.0)  # one fragment (moof) per second
    fragments = _moof_offsets(data)
    cut = fragments[3] - 100  # inside the fragment of second 2
    ingest = StreamIngest(media_format, fps=1.0, max_side=768, limits=LIMITS)
    try:
        _connect(ingest, media_format, "first")
        ingest.receive(MediaEntry(MediaKind.DATA, data=data[:cut]))
        ingest.receive(MediaEntry(MediaKind.END))
        assert _drain(ingest) == [0.0, 1.0, 2.0]
        [(code, connection, message)] = ingest.take_errors()  # it ended inside a fragment
        assert (code, connection) == ("decode_failed", "first") and "corrupt" in message
        assert ingest.init_segment == data[: fragments[0]]

        _connect(ingest, media_format, "second")  # its decoder is gone: the init segment goes first
        for piece in random_cuts(data[cut:], seed=9, pieces=4):
            ingest.receive(MediaEntry(MediaKind.DATA, data=piece))
        ingest.receive(MediaEntry(MediaKind.END))
        assert _drain(ingest) == [3.0, 4.0, 5.0]
        assert ingest.take_errors() == []
    finally:
        ingest.close()


def test_bytes_without_a_header_on_a_new_session_are_refused():
    media_format, data = stream_bytes("libvpx", 2.0)
    ingest = StreamIngest(media_format, fps=1.0, max_side=768, limits=LIMITS)
    try:
        _connect(ingest, media_format, "late")
        ingest.receive(MediaEntry(MediaKind.DATA, data=data[100:]))
        assert ingest.take_errors() == [
            ("decode_failed", "late", "the stream does not start with a header, and none was seen before")
        ]
    finally:
        ingest.close()


def test_frames_keep_the_first_at_each_sampling_point_and_report_bad_images():
    ingest = FramesIngest(fps=1.0, max_side=768, limits=LIMITS)
    _connect(ingest, "frames", "camera")
    for time_s in [0.0, 0.4, 1.2, 1.9, 3.0]:
        ingest.receive(MediaEntry(MediaKind.FRAME, data=timed_jpeg(time_s)))
    ingest.receive(MediaEntry(MediaKind.FRAME, data=timed_jpeg(4.0)[:40]))  # a cut-off JPEG
    ingest.receive(MediaEntry(MediaKind.END))
    assert [f.time_s for f in ingest.next_frames(8).frames] == [0.0, 1.2, 3.0]
    [(code, connection, message)] = ingest.take_errors()
    assert (code, connection) == ("bad_frame", "camera") and message.startswith("frame at 4.000 s")
    assert ingest.finished


def test_a_new_stream_after_a_drop_inside_a_fragment_is_decoded():
    media_format, data = stream_bytes("libx264", 3.0)
    fragments = _moof_offsets(data)
    ingest = StreamIngest(media_format, fps=1.0, max_side=768, limits=LIMITS)
    try:
        _connect(ingest, media_format, "dropped")
        ingest.receive(MediaEntry(MediaKind.DATA, data=data[: fragments[2] - 100]))  # the connection drops here
        _connect(ingest, media_format, "restarted")  # a restarted recorder: a new header
        ingest.receive(MediaEntry(MediaKind.DATA, data=data))
        ingest.receive(MediaEntry(MediaKind.END))
        # the first stream's frames up to its cut, then the new one's from 1/fps after the last kept
        assert _drain(ingest) == [0.0, 1.0, 2.0, 3.0, 4.0]
        [(code, connection, _)] = ingest.take_errors()  # the cut-off stream, not the new one
        assert (code, connection) == ("decode_failed", "dropped")
    finally:
        ingest.close()


def test_a_connection_that_never_reached_a_fragment_does_not_spoil_the_next():
    media_format, data = stream_bytes("libx264", 3.0)
    fragments = _moof_offsets(data)
    ingest = StreamIngest(media_format, fps=1.0, max_side=768, limits=LIMITS)
    try:
        _connect(ingest, media_format, "first")
        ingest.receive(MediaEntry(MediaKind.DATA, data=data))
        ingest.receive(MediaEntry(MediaKind.END))
        assert _drain(ingest) == [0.0, 1.0, 2.0]
        _connect(ingest, media_format, "mid-way")  # bytes from inside a fragment, then gone
        ingest.receive(MediaEntry(MediaKind.DATA, data=data[fragments[1] + 50 : fragments[1] + 400]))
        _connect(ingest, media_format, "fresh")
        ingest.receive(MediaEntry(MediaKind.DATA, data=data))
        ingest.receive(MediaEntry(MediaKind.END))
        assert _drain(ingest) == [3.0, 4.0, 5.0]
        assert ingest.take_errors() == []
    finally:
        ingest.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_init_segment_is_exact_wherever_the_cuts_fall(seed):
    media_format, data = stream_bytes("libx264", 2.0)
    first = data.find(b"moof") - 4
    ingest = StreamIngest(media_format, fps=1.0, max_side=768, limits=LIMITS)
    try:
        _connect(ingest, media_format, "c")
        cuts = [first - 2, first + 1, first + 5, *range(first + 6, first + 12)]  # inside the size, the type
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        for piece in pieces[: seed * 3]:
            ingest.receive(MediaEntry(MediaKind.DATA, data=piece))
        ingest.receive(MediaEntry(MediaKind.DATA, data=b"".join(pieces[seed * 3 :])))
        assert ingest.init_segment == data[:first]
    finally:
        ingest.close()

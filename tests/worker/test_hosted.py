"""A hosted session's media phases: the moves an upload and a live stream make, and no other;
and a question asked after media, which waits for it."""

import math
from collections import deque

import pytest

from streamvqa.protocol import MediaEntry, MediaKind
from tests.media import timed_jpeg
from worker.hosted import MOVES, Hosted, Phase
from worker.ingest import FramesIngest, LiveLimits


def _moved(*phases: Phase) -> Hosted:
    hosted = Hosted(record=None, engine=None)  # the phase machine reads neither
    for phase in phases:
        hosted.move(phase)
    return hosted


def test_an_upload_goes_from_its_bytes_to_its_last_frame():
    assert _moved(Phase.UPLOADING, Phase.SAMPLING, Phase.INGESTED).phase is Phase.INGESTED
    assert _moved(Phase.UPLOADING, Phase.WAITING, Phase.UPLOADING).phase is Phase.UPLOADING  # aborted, then again


def test_a_live_stream_settles_and_comes_back():
    assert _moved(Phase.STREAMING, Phase.SETTLED, Phase.STREAMING, Phase.SETTLED).phase is Phase.SETTLED


@pytest.mark.parametrize(("path", "illegal"), [
    ((Phase.UPLOADING, Phase.SAMPLING), Phase.WAITING),  # a whole upload cannot be given up
    ((Phase.UPLOADING, Phase.SAMPLING, Phase.INGESTED), Phase.STREAMING),  # nor streamed into after
    ((Phase.STREAMING,), Phase.UPLOADING),
    ((Phase.WAITING,), Phase.SETTLED),
])
def test_other_moves_are_refused(path, illegal):
    hosted = _moved(*path)
    with pytest.raises(ValueError, match=f"from {hosted.phase} to {illegal}"):
        hosted.move(illegal)
    assert hosted.phase is path[-1]


def test_every_phase_may_fail_and_a_failure_is_final():
    for phase in Phase:
        if phase is not Phase.FAILED:
            assert Phase.FAILED in MOVES[phase]
    hosted = _moved(Phase.STREAMING)
    hosted.fail("not a readable video file")
    assert (hosted.failed, hosted.error) == (True, "not a readable video file")
    for phase in Phase:
        if phase is not Phase.FAILED:
            with pytest.raises(ValueError):
                hosted.move(phase)


def _watching() -> Hosted:
    """A held live `frames` session, without an engine (the waits read none)."""
    hosted = Hosted(record=None, engine=None, lease_until=math.inf)
    hosted.ingest = FramesIngest(fps=1.0, max_side=64, limits=LiveLimits(1 << 20, 16, 1000.0, 8))
    hosted.move(Phase.STREAMING)
    return hosted


def test_a_question_asked_after_a_frame_starts_once_that_frame_is_in_the_cache():
    hosted = _watching()
    hosted.questions.append((b"20-0", {}))
    hosted.wait_for_media(b"20-0", "10-0")  # the socket's last media entry before the question
    assert hosted.next_question_at is None  # the frame is not read yet
    hosted.ingest.receive(MediaEntry(MediaKind.FRAME, data=timed_jpeg(0.0)))
    hosted.took_media(b"10-0")
    assert hosted.next_question_at is None  # read, decoded, queued: not yet in the cache
    hosted.ingest.receive(MediaEntry(MediaKind.FRAME, data=timed_jpeg(1.0)))  # a later frame is not waited for
    hosted.took_media(b"11-0")
    assert [f.time_s for f in hosted.ingest.next_frames(1).frames] == [0.0]
    assert hosted.next_question_at == (20, 0)
    # a question without a media entry to wait for starts as soon as it is first
    assert Hosted(record=None, engine=None, lease_until=math.inf, questions=deque([(b"5-1", {})])).next_question_at == (5, 1)


def test_a_question_waiting_for_media_never_waits_forever():
    failed = _watching()
    failed.questions.append((b"20-0", {}))
    failed.wait_for_media(b"20-0", "10-0")
    failed.fail("the stream cannot be decoded")  # its media will never come: it is refused instead
    assert failed.next_question_at == (20, 0)
    closed = _watching()
    closed.questions.append((b"20-0", {}))
    closed.wait_for_media(b"20-0", "10-0")
    closed.ingest.receive(MediaEntry(MediaKind.FRAME, data=timed_jpeg(0.0)))
    closed.took_media(b"10-0")
    closed.ingest.close()
    closed.ingest = None  # the ingest closed with its frames (an upload aborted, another format connected)
    assert closed.next_question_at == (20, 0)

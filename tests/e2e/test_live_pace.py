"""A live stream keeps its frames while its session answers questions: real gateway and worker
processes, a real-time stream of frames, questions asked through the REST API meanwhile."""

import threading
import time

import pytest

from streamvqa.client import Client
from tests.media import jpeg
from tests.support import running_stack

FPS = 2
SECONDS = 20


@pytest.fixture(scope="module")
def strict_stack(redis_url, tmp_path_factory):
    """A worker that drops a live frame 1 s behind real time: a 256-token answer of the default
    test model takes longer than that."""
    with running_stack(redis_url, tmp_path_factory.mktemp("strict"), LIVE_MAX_LAG_S="1") as stack:
        yield stack


def test_frames_sent_while_questions_are_answered_reach_the_cache_after_the_answer(strict_stack):
    with Client(strict_stack.url) as client, client.create_session(fps=FPS, policy="infmllm", budget_tokens=256) as session:
        frames = [(i / FPS, jpeg(i)) for i in range(SECONDS * FPS)]
        streamed = {}
        stream = threading.Thread(target=lambda: streamed.update(result=session.stream_frames(frames, speed=1.0)))
        stream.start()
        while not session.info()["frames_ingested"]:
            time.sleep(0.1)
        answering_s = 0.0
        while stream.is_alive():  # one question after another, all along the stream
            started = time.monotonic()
            session.ask("What happens?", max_new_tokens=256, stop=["never said"])
            answering_s += time.monotonic() - started
        stream.join()
        result = streamed["result"]
        assert answering_s >= SECONDS / 2, answering_s  # the session answered half the time or more
        assert (result.frames_sent, result.frames_dropped, result.frames_ingested) == (40, 0, 40)
        spans = session.memory()["spans"]
        assert all(span["frame_seen"] > 0 for span in spans), spans  # no gap in the memory view

"""The whole service on Qwen2.5-VL and Qwen3-VL models (the tiny ones built in code): an upload, a
live stream over the socket, questions, the memory map and evidence, through a real gateway,
worker and Redis."""

import json
from collections.abc import Iterator

import pytest

from tests.media import timed_jpeg
from tests.support import Stack, StreamSocket, running_stack, sample_video


@pytest.fixture(scope="module", params=["tiny-random-qwen2-5-vl", "tiny-random-qwen3-vl"])
def stack(request, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """This module's gateway and worker, on each Qwen model in turn (conftest's `client` uses it)."""
    with running_stack(redis_url, tmp_path_factory.mktemp("qwen"), MODEL=request.param) as stack:
        yield stack


def test_qwen_upload_is_answered_with_evidence_and_a_memory_map(client):
    client.create(fps=2, policy="infmllm", budget_tokens=256)
    assert client.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
    session = client.wait_for_state("ingested", timeout_s=120)
    assert session["frames_ingested"] == 20  # bikes.mp4: 10 s at 2 fps, 10 pairs
    answer = client.ask("What is in the video?", max_new_tokens=6).json()
    assert 1 <= answer["tokens"] <= 6 and answer["video_time_s"] == pytest.approx(9.5, abs=0.05)
    assert answer["evidence"] and all(0.0 <= e["time_s"] <= 9.55 for e in answer["evidence"])
    memory = client.http.get(f"/sessions/{client.id}/memory", headers=client.auth).json()
    assert memory["frames"] == 20 and memory["evictions"] >= 1
    assert memory["cache_tokens"] <= 256 + 64  # the budget, then at most the question and its answer
    assert [(s["start_s"], s["end_s"]) for s in memory["spans"]] == [(t, t + 1) for t in range(10)]
    held = [s["frame_held"] for s in memory["spans"]]
    assert held[-1] > 0  # infmllm keeps the newest frames


def test_qwen_with_recall_a_question_borrows_from_the_host_tier(client):
    client.create(fps=2, policy="infmllm", budget_tokens=256, recall=True, retrieval_tokens=64)
    assert client.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
    assert client.wait_for_state("ingested", timeout_s=120)["frames_ingested"] == 20
    memory = client.http.get(f"/sessions/{client.id}/memory", headers=client.auth).json()
    assert memory["host_tokens"] > 0  # what the cache evicted, kept on the host
    answer = client.ask("What came first?", max_new_tokens=4).json()
    assert 1 <= answer["tokens"] <= 4
    assert answer["recalled_s"] and all(0 <= t <= 9 for t in answer["recalled_s"])  # seconds it brought back


def test_qwen_a_question_on_the_socket_sees_a_frame_left_without_its_pair(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames")
    for second in range(3):  # a pair, then a lone frame
        socket.send(timed_jpeg(float(second), second))
    socket.send(json.dumps({"type": "ask", "question": "What now?", "max_new_tokens": 3, "ref": "q"}))
    done = socket.wait_for(lambda e: e["type"] in ("answer_done", "answer_error"))
    assert done["type"] == "answer_done", done
    assert done["video_time_s"] == 2.0 and 1 <= done["tokens"] <= 3
    assert client.get().json()["frames_ingested"] == 3
    socket.close()


def test_qwen_a_first_lone_frame_is_video_for_a_question(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames")
    socket.send(timed_jpeg(0.0, 0))
    socket.send(json.dumps({"type": "ask", "question": "What is it?", "max_new_tokens": 2, "ref": "q"}))
    done = socket.wait_for(lambda e: e["type"] in ("answer_done", "answer_error"))
    assert done["type"] == "answer_done", done  # not `no_video`: the one frame is paired with itself
    assert done["video_time_s"] == 0.0
    socket.close()

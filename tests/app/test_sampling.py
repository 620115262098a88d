"""Sampling options on every way of asking: the REST API and the stream socket, against a real
gateway and worker. Two sessions that saw the same video and were asked the same questions hold
the same cache, so their answers can be compared."""

import json

import pytest

from tests.support import Client, StreamSocket, sample_video

QUESTION = "What is in the video?"
SAMPLED = {"temperature": 1.5, "top_p": 0.95, "top_k": 50, "seed": 1234}


@pytest.fixture
def twins(stack):
    """Two sessions that ingested the same video."""
    users = [Client(stack.url) for _ in range(2)]
    video = sample_video("carphone_pristine.mp4").read_bytes()
    for user in users:
        user.create(fps=1)
        assert user.upload(video).status_code == 202
    for user in users:
        assert user.wait_for_state("ingested")["frames_ingested"] == 4
    yield users
    for user in users:
        user.delete()
        user.http.close()


def test_temperature_zero_is_the_greedy_answer_and_a_seed_repeats_a_sampled_one(twins):
    first, second = twins
    greedy = first.ask(QUESTION, max_new_tokens=12).json()
    zero = second.ask(QUESTION, max_new_tokens=12, temperature=0).json()
    assert zero["answer"] == greedy["answer"] and zero["tokens"] == greedy["tokens"]
    # both caches now hold the same question and answer: the same seed draws the same answer
    sampled = [user.ask(QUESTION, max_tokens=12, **SAMPLED).json() for user in twins]
    assert sampled[0]["answer"] == sampled[1]["answer"], sampled
    assert sampled[0]["answer"] != greedy["answer"]
    assert sampled[0]["tokens"] <= 12


def test_max_tokens_and_finish_reason(twins):
    user = twins[0]
    answer = user.ask(QUESTION, max_tokens=3).json()
    assert (answer["tokens"], answer["finish_reason"]) == (3, "length")


def test_a_stop_string_ends_the_answer_before_it(twins):
    first, second = twins
    greedy = first.ask(QUESTION, max_new_tokens=12).json()["answer"]
    assert len(greedy) >= 4, greedy
    stop = greedy[2:4]
    expected = greedy[: greedy.index(stop)]
    answer = second.ask(QUESTION, max_new_tokens=12, stop=[stop]).json()
    assert (answer["answer"], answer["finish_reason"]) == (expected, "stop")


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"temperature": 2.5}, "body.temperature", "less than or equal to 2"),
        ({"temperature": -1}, "body.temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "body.top_p", "greater than 0"),
        ({"top_k": 1001}, "body.top_k", "less than or equal to 1000"),
        ({"seed": -5}, "body.seed", "greater than or equal to 0"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "body.stop", "at most 4 items"),
        ({"stop": [""]}, "body.stop.0", "at least 1 character"),
        ({"max_tokens": 2000}, "body.max_tokens", "less than or equal to 1024"),
        ({"max_tokens": 8, "max_new_tokens": 8}, "body", "give max_tokens or max_new_tokens, not both"),
    ],
)
def test_sampling_out_of_bounds_is_422_naming_the_field(client, options, field, message):
    client.create(fps=1)
    reply = client.ask(QUESTION, **options)
    assert (reply.status_code, reply.json()["code"]) == (422, "invalid_request")
    [error] = reply.json()["fields"]
    assert error["field"] == field and message in error["message"], error


def test_a_socket_question_takes_the_same_options(client):
    client.create(fps=1)
    socket = StreamSocket(client, "frames")
    assert socket.send_frames(3) is not None
    socket.send(json.dumps({"type": "ask", "question": QUESTION, "max_tokens": 3, "temperature": 1.0, "seed": 7, "ref": "s"}))
    done = socket.wait_for(lambda e: e["type"] in ("answer_done", "answer_error"))
    assert (done["type"], done["tokens"], done["finish_reason"]) == ("answer_done", 3, "length"), done
    socket.send(json.dumps({"type": "ask", "question": QUESTION, "top_p": 1.5, "ref": "bad"}))
    refused = socket.wait_for(lambda e: e["type"] == "answer_error")
    assert (refused["ref"], refused["code"]) == ("bad", "invalid_request")
    assert refused["message"].startswith("top_p: Input should be less than or equal to 1")
    socket.close()

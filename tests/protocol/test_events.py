"""The one answer model: what a worker's `done` event becomes on each API, written out."""

import json

from streamvqa.client import Answer as ClientAnswer
from streamvqa.protocol import AnswerDoneEvent, DoneEvent

WORKER_DONE = {
    "type": "done", "answer": "A red car.", "tokens": 4, "evidence": [{"time_s": 2.0, "weight": 0.75}],
    "recalled_s": [], "finish_reason": "stop", "prompt_tokens": 17, "video_time_s": 3.0, "cache_tokens": 120,
    "worker_ms": 40.5, "ttft_ms": 12.5, "total_ms": 50.0,
}
ANSWER = (
    '{"answer_id":"abc","answer":"A red car.","tokens":4,"evidence":[{"time_s":2.0,"weight":0.75}],"recalled_s":[],'
    '"finish_reason":"stop","video_time_s":3.0,"cache_tokens":120,"ttft_ms":12.5,"total_ms":50.0}'
)


def test_a_done_event_is_the_answer_that_rest_and_sse_return_under_its_streams_id():
    assert DoneEvent.model_validate(WORKER_DONE).answered("abc").model_dump_json() == ANSWER


def test_a_sockets_answer_done_is_the_answer_after_type_and_ref():
    answer = DoneEvent.model_validate(WORKER_DONE).answered("abc")
    written = AnswerDoneEvent.of(answer, "q1").model_dump_json()
    assert written == '{"type":"answer_done","answer_id":"abc","ref":"q1",' + ANSWER.removeprefix('{"answer_id":"abc",')


def test_a_done_event_keeps_no_answer_id_and_needs_only_what_a_bare_worker_writes():
    bare = {"type": "done", "answer": "a", "tokens": 1, "video_time_s": 0.0, "cache_tokens": 0, "worker_ms": 1.0}
    done = DoneEvent.model_validate(bare)
    assert "answer_id" not in json.loads(done.model_dump_json())
    assert (done.evidence, done.ttft_ms, done.answered("x").total_ms) == ([], None, None)


def test_the_client_reads_the_answer_of_every_api():
    answer = ClientAnswer.from_json(json.loads(ANSWER), "What is it?")
    assert (answer.answer_id, answer.question, answer.evidence[0].time_s, answer.total_ms) == ("abc", "What is it?", 2.0, 50.0)
    from_socket = ClientAnswer.from_json({**json.loads(ANSWER), "type": "answer_done", "ref": "q1"})
    assert from_socket.model_dump(exclude={"question"}) == answer.model_dump(exclude={"question"})

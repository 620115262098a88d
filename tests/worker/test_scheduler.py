"""The worker's choice of what one engine step holds: every question that can start (the oldest
first), a token of every answer under way, and frames of sessions in turn within the step's
token budget; past `batch_sessions`, sessions take turns."""

from dataclasses import dataclass

import pytest

from worker.scheduler import Scheduler, Step


@dataclass
class Work:
    next_question_at: tuple[int, int] | None = None
    answering: bool = False
    ingest_ready: bool = False
    frame_tokens: int = 0
    check_due: bool = False
    check_tokens: int = 100


def test_questions_not_started_go_first_the_oldest_asked_first_beside_the_answers_under_way():
    def sessions() -> dict[str, Work]:
        return {
            "a": Work(answering=True),
            "b": Work(next_question_at=(20, 0), ingest_ready=True),  # its frames wait for its question
            "c": Work(next_question_at=(10, 1)),
            "d": Work(next_question_at=(10, 0)),
        }

    assert Scheduler(batch_sessions=8).next_step(sessions()) == Step(starts=("d", "c", "b"), answers=("a",))
    waiting, two = sessions(), Scheduler(batch_sessions=2)
    assert two.next_step(waiting) == Step(starts=("d", "c"), answers=("a",))
    waiting["c"], waiting["d"] = Work(answering=True), Work(answering=True)
    assert two.next_step(waiting) == Step(starts=("b",), answers=("c", "d"))


def test_every_answer_under_way_and_the_frames_ready_go_in_every_step():
    sessions = {"a": Work(answering=True), "b": Work(ingest_ready=True), "c": Work(answering=True), "d": Work(ingest_ready=True)}
    scheduler = Scheduler(batch_sessions=8)
    steps = [scheduler.next_step(sessions) for _ in range(3)]
    assert steps == [Step(answers=("a", "c"), frames=("b", "d"))] * 3


def test_a_session_answering_takes_no_frames_until_its_answer_ends():
    sessions = {"a": Work(answering=True, ingest_ready=True)}
    scheduler = Scheduler(batch_sessions=8)
    assert [scheduler.next_step(sessions) for _ in range(2)] == [Step(answers=("a",))] * 2
    sessions["a"].answering = False
    assert scheduler.next_step(sessions) == Step(frames=("a",))


def test_past_the_batch_the_sessions_take_turns_and_none_waits_more_than_its_share():
    names = "abcde"
    sessions = {name: Work(answering=True) for name in names}
    scheduler = Scheduler(batch_sessions=2)
    steps = [scheduler.next_step(sessions).answers for _ in range(5)]
    assert steps == [("a", "b"), ("c", "d"), ("e", "a"), ("b", "c"), ("d", "e")]
    # each session runs in 2 of every 5 steps: ceil(5 / 2) steps apart at most
    assert all(sum(name in step for step in steps) == 2 for name in names)


def test_one_session_of_each_kind_a_step_when_batching_is_off():
    sessions = {"a": Work(answering=True), "b": Work(answering=True), "c": Work(ingest_ready=True), "d": Work(ingest_ready=True)}
    scheduler = Scheduler(batch_sessions=1)
    steps = [scheduler.next_step(sessions) for _ in range(3)]
    assert steps == [Step(answers=("a",), frames=("c",)), Step(answers=("b",), frames=("d",)), Step(answers=("a",), frames=("c",))]


def test_frames_join_a_step_within_its_token_budget_and_take_turns():
    # 8 frames of 50 tokens: 400 a session; 1,000 tokens a step holds two sessions' frames and an answer's token
    sessions = {name: Work(ingest_ready=True, frame_tokens=50) for name in "abc"}
    sessions["x"] = Work(answering=True)
    scheduler = Scheduler(batch_sessions=8, step_tokens=1000, frames_per_step=8)
    steps = [scheduler.next_step(sessions) for _ in range(3)]
    assert [step.frames for step in steps] == [("a", "b"), ("c", "a"), ("b", "c")]
    assert all(step.answers == ("x",) for step in steps)
    # a session whose frames alone pass the budget still goes, first in turn, in a step that starts no question
    sessions = {"big": Work(ingest_ready=True, frame_tokens=500), "small": Work(ingest_ready=True, frame_tokens=1)}
    scheduler = Scheduler(batch_sessions=8, step_tokens=1000, frames_per_step=8)
    assert scheduler.next_step(sessions) == Step(frames=("big",))
    assert scheduler.next_step(sessions) == Step(frames=("small",))  # "big" would pass the budget after it
    # a question start counts as 1,024 tokens: no frames beside it in a step of 1,000
    sessions["asking"] = Work(next_question_at=(1, 0))
    assert scheduler.next_step(sessions) == Step(starts=("asking",))


def test_nothing_to_do_is_no_step_and_peeking_takes_no_turn():
    scheduler = Scheduler(batch_sessions=4)
    assert scheduler.next_step({"a": Work()}) is None
    sessions = {"a": Work(answering=True), "b": Work(answering=True), "c": Work(answering=True)}
    scheduler = Scheduler(batch_sessions=2)
    assert scheduler.peek(sessions) == scheduler.peek(sessions) == Step(answers=("a", "b"))
    for name, value in (("batch_sessions", 0), ("step_tokens", 0), ("frames_per_step", 0)):
        with pytest.raises(ValueError, match=name):
            Scheduler(**{"batch_sessions": 1, name: value})


def test_a_watch_due_is_checked_before_its_session_takes_more_frames_and_never_while_it_answers():
    sessions = {
        "a": Work(ingest_ready=True, check_due=True),  # its check first: it sees the video up to its time
        "b": Work(ingest_ready=True),
        "c": Work(answering=True, check_due=True),  # a check would fall inside the answer's turn
        "d": Work(next_question_at=(1, 0), check_due=True),
    }
    scheduler = Scheduler(batch_sessions=8)
    assert scheduler.next_step(sessions) == Step(starts=("d",), answers=("c",), frames=("b",), checks=("a",))
    sessions["a"].check_due = False
    assert scheduler.next_step(sessions).frames == ("a", "b")


def test_checks_take_turns_within_the_step_tokens():
    sessions = {name: Work(check_due=True, check_tokens=1000) for name in "abcde"}
    scheduler = Scheduler(batch_sessions=8, step_tokens=2500)
    assert [scheduler.next_step(sessions).checks for _ in range(3)] == [("a", "b"), ("c", "d"), ("e", "a")]

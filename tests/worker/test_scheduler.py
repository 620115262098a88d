"""The worker's choice of step: questions first, answers and frames in turn, sessions batched up
to `batch_sessions` and taking turns beyond it."""

from dataclasses import dataclass

import pytest

from worker.scheduler import Scheduler, Step


@dataclass
class Work:
    next_question_at: tuple[int, int] | None = None
    answering: bool = False
    ingest_ready: bool = False


def test_questions_not_started_go_first_the_oldest_asked_first_over_every_session():
    def sessions() -> dict[str, Work]:
        return {
            "a": Work(answering=True),
            "b": Work(next_question_at=(20, 0), ingest_ready=True),
            "c": Work(next_question_at=(10, 1)),
            "d": Work(next_question_at=(10, 0)),
        }

    assert Scheduler(batch_sessions=8).next_step(sessions()) == Step("start", ("d", "c", "b"))
    waiting, one_by_one = sessions(), Scheduler(batch_sessions=2)
    assert one_by_one.next_step(waiting) == Step("start", ("d", "c"))
    waiting["c"], waiting["d"] = Work(answering=True), Work(answering=True)
    assert one_by_one.next_step(waiting) == Step("start", ("b",))


def test_every_answer_under_way_advances_in_one_step_and_frames_take_every_other_step():
    sessions = {"a": Work(answering=True), "b": Work(ingest_ready=True), "c": Work(answering=True), "d": Work(ingest_ready=True)}
    scheduler = Scheduler(batch_sessions=8)
    steps = [scheduler.next_step(sessions) for _ in range(4)]
    assert steps == [Step("answer", ("a", "c")), Step("ingest", ("b", "d"))] * 2


def test_a_session_answering_takes_no_frames_until_its_answer_ends():
    sessions = {"a": Work(answering=True, ingest_ready=True)}
    scheduler = Scheduler(batch_sessions=8)
    assert [scheduler.next_step(sessions) for _ in range(2)] == [Step("answer", ("a",))] * 2
    sessions["a"].answering = False
    assert scheduler.next_step(sessions) == Step("ingest", ("a",))


def test_past_the_batch_the_sessions_take_turns_and_none_waits_more_than_its_share():
    names = "abcde"
    sessions = {name: Work(answering=True) for name in names}
    scheduler = Scheduler(batch_sessions=2)
    steps = [scheduler.next_step(sessions).session_ids for _ in range(5)]
    assert steps == [("a", "b"), ("c", "d"), ("e", "a"), ("b", "c"), ("d", "e")]
    # each session runs in 2 of every 5 steps: ceil(5 / 2) steps apart at most
    assert all(sum(name in step for step in steps) == 2 for name in names)


def test_one_session_a_step_when_batching_is_off():
    sessions = {"a": Work(answering=True), "b": Work(answering=True), "c": Work(ingest_ready=True)}
    scheduler = Scheduler(batch_sessions=1)
    steps = [scheduler.next_step(sessions) for _ in range(4)]
    assert steps == [Step("answer", ("a",)), Step("ingest", ("c",)), Step("answer", ("b",)), Step("ingest", ("c",))]


def test_nothing_to_do_is_no_step_and_peeking_takes_no_turn():
    scheduler = Scheduler(batch_sessions=4)
    assert scheduler.next_step({"a": Work()}) is None
    sessions = {"a": Work(answering=True), "b": Work(ingest_ready=True)}
    assert scheduler.peek(sessions) == scheduler.peek(sessions) == Step("answer", ("a",))
    with pytest.raises(ValueError, match="batch_sessions"):
        Scheduler(batch_sessions=0)

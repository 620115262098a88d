"""The engine's session on the built-in tiny model: frames become cache tokens, questions get answers."""

import numpy as np
import pytest

from engine import POLICIES, Session, SessionConfig, UnknownModelError, load_model
from streamvqa import protocol

VISUAL_TOKENS_PER_FRAME = 16  # 64x64 frames in 16x16 patches, CLS dropped
USER_TURN_OPEN_TOKENS = 6  # "<|im_start|>" then "user\n"
MARKER_TOKENS = 6  # "[1.0s]", one token per character


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def frames(count: int, seed: int = 0, shape=(72, 128, 3)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(count)]


def test_each_frame_adds_its_visual_tokens_and_time_marker(model):
    session = Session(model)
    before = session.stats().cache_tokens
    session.append_frames(frames(3), [0.0, 1.0, 2.0])
    stats = session.stats()
    assert stats.cache_tokens - before == USER_TURN_OPEN_TOKENS + 3 * (MARKER_TOKENS + VISUAL_TOKENS_PER_FRAME + 1)
    assert (stats.frames, stats.video_time_s) == (3, 2.0)
    assert stats.tokens_seen == stats.cache_tokens  # the full policy keeps everything
    session.append_frames(frames(1, seed=1), [3.0])
    assert session.stats().cache_tokens - stats.cache_tokens == MARKER_TOKENS + VISUAL_TOKENS_PER_FRAME + 1


def test_frames_of_any_size_are_accepted(model):
    session = Session(model)
    session.append_frames(frames(1, shape=(30, 500, 3)) + frames(1, shape=(480, 64, 3)), [0.0, 0.5])
    assert session.stats().frames == 2


def test_answer_is_generated_streamed_and_kept_as_conversation(model):
    session = Session(model)
    session.append_frames(frames(2), [0.0, 1.0])
    before = session.stats().cache_tokens
    pieces = list(session.ask("What happens?", max_new_tokens=12))
    assert 1 <= len(pieces) <= 12  # one piece per generated token, until <|im_end|> or the cap
    assert all(len(piece) <= 1 for piece in pieces)  # a character, or nothing for <unk>
    question_tokens = len("What happens?")  # the user turn is open: no new opener
    turn_ends = 2 * 2  # "<|im_end|>\n" after the question and after the answer
    assistant_opener = 1 + len("assistant\n")
    grown = session.stats().cache_tokens - before
    assert grown == question_tokens + turn_ends + assistant_opener + len(pieces)


def test_same_video_and_question_give_the_same_answer(model):
    answers = []
    for _ in range(2):
        session = Session(model)
        session.append_frames(frames(2), [0.0, 1.0])
        answers.append("".join(session.ask("Describe it.", max_new_tokens=16)))
    assert answers[0] == answers[1]


def test_frames_after_an_answer_open_a_new_user_turn(model):
    session = Session(model)
    list(session.ask("Anything yet?", max_new_tokens=3))
    before = session.stats().cache_tokens
    session.append_frames(frames(1), [0.0])
    assert session.stats().cache_tokens - before == USER_TURN_OPEN_TOKENS + MARKER_TOKENS + VISUAL_TOKENS_PER_FRAME + 1


def test_questions_cannot_inject_chat_markup(model):
    session = Session(model)
    plain = session.stats().cache_tokens
    list(session.ask("<|im_end|>", max_new_tokens=1))
    # user opener 6, the question as 10 characters (not 1 special token), turn end 2,
    # assistant opener 11, one answer token, turn end 2
    assert session.stats().cache_tokens - plain == 6 + 10 + 2 + 11 + 1 + 2


def test_bad_input_is_refused_clearly(model):
    session = Session(model)
    with pytest.raises(ValueError, match="must not decrease"):
        session.append_frames(frames(2), [1.0, 0.5])
    with pytest.raises(ValueError, match="2 frames but 1 times"):
        session.append_frames(frames(2), [0.0])
    with pytest.raises(ValueError, match="RGB uint8"):
        session.append_frames([np.zeros((8, 8), dtype=np.uint8)], [0.0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(session.ask("?", max_new_tokens=0))
    assert session.stats().frames == 0


def test_unknown_model_and_policy_are_named_in_the_error():
    with pytest.raises(UnknownModelError, match="tiny-random-llava"):
        load_model("no-such-model", "cpu")
    with pytest.raises(ValueError, match="unknown policy 'h3o'"):
        SessionConfig(policy="h3o")


def test_the_gateway_offers_exactly_the_engines_policies():
    assert protocol.POLICIES == POLICIES

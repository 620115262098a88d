"""The engine's session on the built-in tiny models: frames become cache tokens, questions get answers."""

import numpy as np
import pytest
import torch

from engine import POLICIES, ContextFull, Session, SessionConfig, UnknownModelError, load_model
from streamvqa import protocol

VISUAL_TOKENS_PER_FRAME = 16  # every tiny family: 64x64 frames, 16 visual tokens
MARKER_TOKENS = 6  # "[1.0s]", one token per character
FRAME_TOKENS = MARKER_TOKENS + VISUAL_TOKENS_PER_FRAME + 1  # and "\n"
FULL = SessionConfig(policy="full")


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def frames(count: int, seed: int = 0, shape=(72, 128, 3)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(count)]


def test_each_frame_adds_its_visual_tokens_and_time_marker(model):
    session = Session(model, FULL)
    before = session.stats().cache_tokens
    session.append_frames(frames(3), [0.0, 1.0, 2.0])
    stats = session.stats()
    assert stats.cache_tokens - before == 3 * FRAME_TOKENS
    assert (stats.frames, stats.video_time_s) == (3, 2.0)
    assert stats.tokens_seen == stats.cache_tokens  # the full policy keeps everything
    assert stats.max_position == stats.cache_tokens - 1


@pytest.mark.parametrize(("name", "newline"), [("tiny-random-llava-next-video", 0), ("tiny-random-llava-onevision", 1)])
def test_every_family_pools_frames_to_sixteen_tokens(name, newline):
    session = Session(load_model(name, "cpu"), FULL)
    before = session.stats().cache_tokens
    session.append_frames(frames(2), [0.0, 0.5])
    assert session.stats().cache_tokens - before == 2 * (FRAME_TOKENS + newline)  # OneVision: + image_newline


def test_pooling_is_configurable(model):
    session = Session(load_model("tiny-random-llava-next-video", "cpu"), SessionConfig(policy="full", pool=4))
    before = session.stats().cache_tokens
    session.append_frames(frames(1), [0.0])
    assert session.stats().cache_tokens - before == MARKER_TOKENS + 4 + 1  # 8x8 patches pooled 4x4: 2x2


def test_frames_of_any_size_are_accepted(model):
    session = Session(model, FULL)
    session.append_frames(frames(1, shape=(30, 500, 3)) + frames(1, shape=(480, 64, 3)), [0.0, 0.5])
    assert session.stats().frames == 2


def test_answer_is_generated_streamed_and_kept_as_conversation(model):
    session = Session(model, FULL)
    session.append_frames(frames(2), [0.0, 1.0])
    before = session.stats().cache_tokens
    answer = session.ask("What happens?", max_new_tokens=12)
    pieces = list(answer)
    assert 1 <= len(pieces) == answer.tokens <= 12  # one piece per token, until <|im_end|> or the cap
    assert len("".join(pieces)) <= answer.tokens  # a character a token, or nothing for <unk>
    assert all(piece == "" or piece[-1].isalnum() for piece in pieces[:-1])  # what follows the last letter or digit waits
    # the question, "<|im_end|>\n<|im_start|>assistant\n" (1 + 1 + 1 + 10), the answer,
    # and "<|im_end|>\n<|im_start|>user\n" (1 + 1 + 1 + 5)
    assert session.stats().cache_tokens - before == len("What happens?") + 13 + answer.tokens + 8


def test_evidence_names_frame_times_with_weights(model):
    session = Session(model, FULL)
    session.append_frames(frames(5), [0.0, 1.0, 2.0, 3.0, 4.0])
    answer = session.ask("When?", max_new_tokens=4)
    list(answer)
    assert len(answer.evidence) <= 3  # evidence_top_k, less what drew under half the best's excess (a random model: often none)
    assert {e.time_s for e in answer.evidence} <= {0.0, 1.0, 2.0, 3.0, 4.0}
    weights = [e.weight for e in answer.evidence]
    assert weights == sorted(weights, reverse=True) and sum(weights) <= 1


def test_same_video_and_question_give_the_same_answer(model):
    answers = []
    for _ in range(2):
        session = Session(model, FULL)
        session.append_frames(frames(2), [0.0, 1.0])
        answers.append("".join(session.ask("Describe it.", max_new_tokens=16)))
    assert answers[0] == answers[1]


def test_questions_cannot_inject_chat_markup(model):
    session = Session(model, FULL)
    before = session.stats().cache_tokens
    answer = session.ask("<|im_end|>", max_new_tokens=1)
    list(answer)
    # the question as 10 characters, not 1 special token
    assert session.stats().cache_tokens - before == 10 + 13 + answer.tokens + 8


def test_memory_shows_what_each_second_still_holds(model):
    session = Session(model, SessionConfig(policy="sliding", budget_tokens=80, policy_options={"sinks": 4, "recent": 8}))
    session.append_frames(frames(6), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    memory = session.memory()
    assert (memory.policy, memory.budget_tokens, memory.cache_tokens) == ("sliding", 80, 80)
    assert [(s.start_s, s.end_s) for s in memory.spans] == [(t, t + 1) for t in range(6)]
    assert [s.frame_seen for s in memory.spans] == [16] * 6
    # 80 = 4 sinks + the last 76 tokens: 3 whole frames of 23, and the last 7 of frame 2
    # (6 visual tokens and its newline)
    assert [s.frame_held for s in memory.spans] == [0.0, 0.0, 6.0, 16.0, 16.0, 16.0]
    assert memory.frame_tokens == 16 * 3 + 6
    coarse = session.memory(max_spans=2)  # seconds 0-2 and 3-5
    assert [(s.start_s, s.end_s, s.frame_seen, s.frame_held) for s in coarse.spans] == [(0, 3, 48, 6.0), (3, 6, 48, 48.0)]


def test_an_unfinished_answer_ends_its_turn_before_anything_else_enters(model):
    session = Session(model, FULL)
    before = session.stats().cache_tokens
    answer = session.ask("Go on", max_new_tokens=20)
    next(answer), next(answer)  # the caller stops reading after two tokens
    session.append_frames(frames(1), [0.0])
    assert answer.tokens == 2
    # question, user_to_assistant (13), 2 answer tokens, assistant_to_user (8), then the frame
    assert session.stats().cache_tokens - before == len("Go on") + 13 + 2 + 8 + FRAME_TOKENS


def test_a_bfloat16_model_streams_evicts_and_answers(model):
    half = load_model("tiny-random-llava", "cpu")
    half.hf.to(torch.bfloat16)
    session = Session(half, SessionConfig(policy="infmllm", budget_tokens=150, policy_options={"recent": 32}))
    session.append_frames(frames(10), [float(t) for t in range(10)])
    answer = session.ask("What now?", max_new_tokens=4)
    list(answer)
    stats = session.stats()
    assert stats.evictions > 0 and stats.cache_tokens <= 150
    assert session.cache.hf.layers[0].keys.dtype == torch.bfloat16
    assert Session.restore(half, session.snapshot()).stats() == stats


OPENING_TOKENS = 149  # the tiny models' default system prompt with its chat markers
QUESTION_TURN_TOKENS = 13 + 8  # the markers closing a question, then its answer


def test_a_full_cache_stops_at_the_context_and_keeps_room_for_questions(model):
    assert model.context_tokens == 32768
    session = Session(model, SessionConfig(policy="full", context_tokens=314, question_room_tokens=64))
    with pytest.raises(
        ContextFull,
        match=r"^the frame at 4\.0s needs 23 more tokens, but the cache holds 241 of the model's 314-token context "
        r"\(64 of it kept for questions\)$",
    ):
        session.append_frames(frames(5), [0.0, 1.0, 2.0, 3.0, 4.0])
    stats = session.stats()
    assert (stats.frames, stats.video_time_s, stats.cache_tokens) == (4, 3.0, OPENING_TOKENS + 4 * FRAME_TOKENS)
    with pytest.raises(ContextFull, match=r"^the question needs 82 more tokens"):  # 60, its turn, one answer token
        session.ask("x" * 60)
    assert session.stats().cache_tokens == 241  # nothing of it was run
    assert not session.context_full  # 73 left: no frame fits beside the 64 kept, but a question does
    answer = session.ask("hi", max_new_tokens=64)  # "hi" and its turn take 23: 50 left for the answer
    list(answer)
    assert (answer.tokens, answer.finish_reason) == (25, "length")  # half of those 50 left for questions
    assert (session.stats().cache_tokens, session.context_full) == (289, True)
    answers = []
    while True:  # each later answer leaves half of what its question left, until none fits
        try:
            answers.append(session.ask("hi", max_new_tokens=64))
        except ContextFull:
            break
        list(answers[-1])
    assert [a.tokens for a in answers] == [1]
    assert (session.stats().cache_tokens, session.stats().max_position) == (313, 312)


def test_a_long_answer_leaves_the_room_kept_for_questions(model):
    session = Session(model, SessionConfig(policy="full", context_tokens=1000, question_room_tokens=64))
    session.append_frames(frames(2), [0.0, 1.0])  # 149 + 2 x 23 tokens held
    answer = session.ask("hi", max_new_tokens=2000)
    list(answer)
    assert (answer.tokens, answer.finish_reason) == (1000 - 195 - 23 - 64, "length")
    assert session.stats().cache_tokens == 1000 - 64
    later = session.ask("and now?", max_new_tokens=8)  # the room kept takes the next question
    list(later)
    assert later.tokens == 8


# The highest position: the context's last, or for h2o (which evicts down to its budget of 230
# after each answer token) 230, then the last answer token and the 8 markers closing the answer.
@pytest.mark.parametrize(("policy", "max_position"), [("full", 245), ("sliding", 245), ("h2o", 238)])
def test_an_answer_ends_at_the_context_with_finish_reason_length(model, policy, max_position):
    context = OPENING_TOKENS + 3 * FRAME_TOKENS + 2 + QUESTION_TURN_TOKENS + 5  # room for 5 answer tokens
    config = SessionConfig(policy=policy, budget_tokens=230, context_tokens=context, question_room_tokens=0)
    session = Session(model, config)
    session.append_frames(frames(3), [0.0, 1.0, 2.0])
    answer = session.ask("hi", max_new_tokens=64)
    list(answer)
    assert (answer.tokens, answer.finish_reason) == (5, "length")
    assert session.stats().max_position == max_position


def test_bad_input_is_refused_clearly(model):
    session = Session(model, FULL)
    with pytest.raises(ValueError, match="must not decrease"):
        session.append_frames(frames(2), [1.0, 0.5])
    with pytest.raises(ValueError, match="2 frames but 1 times"):
        session.append_frames(frames(2), [0.0])
    with pytest.raises(ValueError, match="RGB uint8"):
        session.append_frames([np.zeros((8, 8), dtype=np.uint8)], [0.0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        session.ask("?", max_new_tokens=0)
    assert session.stats().frames == 0
    text_only = Session(load_model("tiny-random-llama", "cpu"), FULL)
    with pytest.raises(ValueError, match="text-only"):
        text_only.append_frames(frames(1), [0.0])


def test_unknown_model_policy_and_options_are_named_in_the_error():
    with pytest.raises(UnknownModelError, match="tiny-random-llava"):
        load_model("no-such-model", "cpu")
    with pytest.raises(ValueError, match="unknown policy 'h3o'"):
        SessionConfig(policy="h3o")
    with pytest.raises(ValueError, match="has no option beta"):
        SessionConfig(policy="sliding", policy_options={"beta": 1.0})
    with pytest.raises(ValueError, match="must exceed sinks"):
        SessionConfig(policy="infmllm", budget_tokens=100, policy_options={"recent": 100})


def test_the_gateway_offers_exactly_the_engines_policies():
    assert protocol.POLICIES == POLICIES

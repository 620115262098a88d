"""An answer's evidence: the frame times its tokens attend to beyond what its question's tokens did."""

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, load_model
from engine.evidence import Contrast, Evidence, top_evidence
from engine.kv_cache import FrameAttention

TIMES = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])  # the opening, three seconds, the newest
HELD = torch.tensor([10.0, 10.0, 5.0, 10.0, 10.0])  # the second at 2.0 s held in part
# Per query (rows), the attention paid each time's tokens: every query pays the opening and
# the newest second most; the answer's first token pays 2.0 s more than the question did
QUESTION = FrameAttention(TIMES, torch.tensor([[5.0, 1.0, 0.5, 1.0, 2.0], [5.0, 1.0, 0.5, 1.0, 2.0]]), HELD)
ANSWER = FrameAttention(TIMES, torch.tensor([[5.0, 1.0, 1.5, 1.0, 2.0], [6.0, 1.0, 0.5, 1.0, 3.0]]), HELD)


def test_the_answer_s_excess_over_its_question_is_its_evidence_not_what_every_query_attends_to():
    contrast = Contrast()
    contrast.question(QUESTION)
    contrast.answer(ANSWER)
    # Shares of attention per token held: the question's [0.5, 0.1, 0.1, 0.1, 0.2]; the answer's
    # first token's [0.417, 0.083, 0.25, 0.083, 0.167] (0.15 more at 2.0 s), its second's
    # [0.5, 0.083, 0.083, 0.083, 0.25] (0.05 more at 4.0 s, under half of the best)
    assert contrast.top(3) == [Evidence(2.0, 0.75)]


def test_what_the_text_between_frames_paid_weighs_half_in_the_baseline():
    """The times and newlines between frames attend to the newest frames whatever is asked:
    half their shares join the question's, so the newest second is evidence only where the
    answer attends to it more than both together."""
    between = FrameAttention(TIMES, torch.tensor([[0.0, 0.0, 0.0, 0.0, 4.0]]), HELD)  # the newest alone
    question = FrameAttention(TIMES, torch.tensor([[5.0, 1.0, 1.0, 1.0, 2.0]]), HELD)
    answer = FrameAttention(TIMES, torch.tensor([[4.0, 1.0, 2.0, 1.0, 6.0]]), HELD)
    # shares: the question's [0.455, 0.091, 0.182, 0.091, 0.182], the answer's [0.25, 0.0625,
    # 0.25, 0.0625, 0.375]; the text between frames adds 0.5 to the newest second's baseline
    with_between, question_alone = Contrast(), Contrast()
    with_between.question(question, between)
    question_alone.question(question)
    for contrast in (with_between, question_alone):
        contrast.answer(answer)
    assert with_between.top(3) == [Evidence(2.0, 1.0)]  # 0.068 over its baseline
    assert question_alone.top(3) == [Evidence(4.0, 0.7391)]  # 0.193; 2.0 s at 0.068 is under half of it


def test_without_a_question_every_share_is_excess():
    contrast = Contrast()
    contrast.answer(FrameAttention(TIMES[:2], torch.tensor([[3.0, 1.0]]), HELD[:2]))
    assert contrast.top(3) == [Evidence(0.0, 0.75)]  # 1.0 s at a third of the best is left out


def test_top_evidence_keeps_times_of_at_least_half_the_best_excess():
    assert top_evidence({0.0: 0.0, 5.0: 0.3, 6.0: 0.2, 7.0: 0.1}, 3) == [Evidence(5.0, 0.5), Evidence(6.0, 0.3333)]
    assert top_evidence({}, 3) == [] and top_evidence({4.0: 0.0}, 3) == []


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def test_after_each_frame_the_cache_keeps_what_the_text_between_frames_paid(model):
    """The baseline's second part: the queries of the last frame prompt's text ("[4.0s]" and
    the newline, 7 tokens of the tiny model's), not of its frame's 16 visual tokens."""
    session = Session(model, SessionConfig(policy="full"))
    rng = np.random.default_rng(1)
    session.append_frames([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(5)], TIMES.tolist())
    between = session.cache.between_frames
    assert between.times.tolist() == TIMES.tolist() and between.mass.shape == (7, 5)


def test_an_answer_weighs_its_own_tokens_against_its_question_s(model):
    """Through a session: the question's prompt (its tokens and the markers closing it) gives
    the baseline; the answer's tokens and the markers closing its turn give the excess, even
    when the opening and the newest frame draw the most attention of every query."""
    session = Session(model, SessionConfig(policy="full"))
    rng = np.random.default_rng(0)
    session.append_frames([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(5)], TIMES.tolist())
    asked: list[int] = []

    def frame_attention(queries: int | None = None) -> FrameAttention:
        asked.append(queries)
        return QUESTION if len(asked) == 1 else ANSWER

    session.cache.frame_attention = frame_attention
    session.cache.between_frames = None  # the text between frames paid every time alike
    answer = session.ask("What changed?", max_new_tokens=3)
    text = "".join(answer)
    assert answer.evidence == [Evidence(2.0, 0.75)]
    closing = len(model.tokenize(model.chat.assistant_to_user))
    assert asked == [answer.prompt_tokens, answer.tokens + closing], text

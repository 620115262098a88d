"""An answer's evidence: the frame times its question and answer attend to beyond what a question
about nothing in particular and an answer's first words to it (the probe, run read only before
the question) did."""

import sys

import numpy as np
import pytest
import torch

import engine.step  # noqa: F401 (the module: `engine.step` is the function `engine/__init__.py` exports)
from engine import Session, SessionConfig, load_model
from engine.evidence import PROBE, PROBE_ANSWER, Contrast, Evidence, FrameAttention, Observed, top_evidence

TIMES = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])  # the opening, three seconds, the newest
HELD = torch.tensor([10.0, 10.0, 5.0, 10.0, 10.0])  # the second at 2.0 s held in part
# Per query (rows), the attention paid each time's tokens: every query pays the opening and
# the newest second most; the question pays 2.0 s more than the probe did, the answer's token
# the opening and the newest a little more
PROBED = FrameAttention(TIMES, torch.tensor([[5.0, 1.0, 0.5, 1.0, 2.0], [5.0, 1.0, 0.5, 1.0, 2.0]]), HELD)
QUESTION = FrameAttention(TIMES, torch.tensor([[5.0, 1.0, 1.5, 1.0, 2.0]]), HELD)
ANSWER = FrameAttention(TIMES, torch.tensor([[6.0, 1.0, 0.5, 1.0, 3.0]]), HELD)


def test_the_excess_of_question_and_answer_over_the_probe_is_the_evidence_not_what_every_query_attends_to():
    contrast = Contrast()
    contrast.probe(PROBED)
    contrast.add(QUESTION)
    contrast.add(ANSWER)
    # Shares of attention per token held: the probe's [0.5, 0.1, 0.1, 0.1, 0.2]; the question's
    # [0.417, 0.083, 0.25, 0.083, 0.167], the answer's [0.5, 0.083, 0.083, 0.083, 0.25]: their
    # mean less 1.1 times the probe's is [-0.092, -0.027, 0.057, -0.027, -0.012]: 2.0 s alone
    # (the newest, 4% over the probe's share, is not)
    assert contrast.top(3) == [Evidence(2.0, 1.0)]


def test_an_answer_that_attends_as_the_probe_did_cites_nothing():
    """The opening and the newest draw the most attention, from the probe as from the answer:
    nothing stands out, so no time is evidence (the opening is not cited for want of another)."""
    contrast = Contrast()
    contrast.probe(PROBED)
    contrast.add(PROBED)
    assert contrast.top(3) == []


def test_a_time_is_evidence_where_it_draws_a_tenth_more_than_the_probe_did_else_where_it_draws_more():
    """A time the question and answer attend to a little more than a question about nothing
    (the newest second, 6% more) is not evidence beside one they attend to a tenth more; alone,
    it is."""
    probed = FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.0, 1.0, 4.0]]), HELD)  # shares .2, .1, .2, .1, .4
    answer = FrameAttention(TIMES, torch.tensor([[1.0, 1.0, 1.2, 0.9, 3.9]]), HELD)  # .109, .109, .261, .098, .424
    contrast = Contrast()
    contrast.probe(probed)
    contrast.add(answer)
    # excess over 1.1 times the probe's: -.111, -.001, .041, -.012, -.016
    assert contrast.top(3) == [Evidence(2.0, 1.0)]
    newest = Contrast()
    newest.probe(probed)
    newest.add(FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.0, 0.9, 4.3]]), HELD))  # .196, .098, .196, .088, .422
    # over 1.1 times the probe's nothing (4.0 s: .422 < .44); over the probe's, 4.0 s alone (.022)
    assert newest.top(3) == [Evidence(4.0, 1.0)]


def test_an_answer_is_weighed_against_the_probe_s_answer_and_a_question_against_its_question():
    """Answers read the newest second more than questions do, whatever was asked: the probe's
    answer (its last query) too. Against the probe's question alone, the answer's share of the
    newest second stood out; against the mean of the probe's question and answer, only what the
    question asked for does."""
    probed = FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.0, 1.0, 2.0], [2.0, 1.0, 1.0, 1.0, 6.0]]), HELD)
    # shares: the probe's question .25, .125, .25, .125, .25; its answer .167, .083, .167, .083, .5;
    # an answer's baseline their mean, .208, .104, .208, .104, .375
    question = FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.6, 1.0, 2.0]]), HELD)  # .217, .109, .348, .109, .217
    answer = FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.0, 1.0, 3.5]]), HELD)  # .211, .105, .211, .105, .368
    against_both = Contrast()
    against_both.probe(probed, answer_queries=1)
    against_both.add(question)
    against_both.add(answer, answer=True)
    # excess: 2.0 s (.348 - 1.1 x .25 + .211 - 1.1 x .208) / 2 = .027; 4.0 s (-.058 - .044) / 2 < 0
    assert against_both.top(3) == [Evidence(2.0, 1.0)]
    against_question = Contrast()  # a probe of a question alone, as before
    against_question.probe(FrameAttention(TIMES, probed.mass[:1], HELD))
    against_question.add(question)
    against_question.add(answer, answer=True)
    # 4.0 s: (.217 - .275 + .368 - .275) / 2 = .018; 2.0 s: (.073 - .064) / 2 = .004, under half of it
    assert [e.time_s for e in against_question.top(3)] == [4.0]


def test_without_a_probe_every_share_is_excess():
    contrast = Contrast()
    contrast.add(FrameAttention(TIMES[:2], torch.tensor([[3.0, 1.0]]), HELD[:2]))
    assert contrast.top(3) == [Evidence(0.0, 0.75)]  # 1.0 s at a third of the best is left out


def test_top_evidence_keeps_times_of_at_least_half_the_best_excess():
    assert top_evidence({0.0: 0.0, 5.0: 0.3, 6.0: 0.2, 7.0: 0.1}, 3) == [Evidence(5.0, 0.5), Evidence(6.0, 0.3333)]
    assert top_evidence({}, 3) == [] and top_evidence({4.0: 0.0}, 3) == []


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def test_an_answer_weighs_its_question_and_its_own_tokens_against_its_probe(model, monkeypatch):
    """Through a session: the probe runs read only before the question (what it paid the frames
    is read, nothing of it stays in the cache); the question's prompt and the answer's tokens
    with the markers closing its turn give the excess over it."""
    session = Session(model, SessionConfig(policy="full"))
    rng = np.random.default_rng(0)
    session.append_frames([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(5)], TIMES.tolist())
    before = session.cache.tokens
    asked: list[int] = []
    probed = []
    read = Observed.read

    def frame_attention(cache, queries: int | None = None) -> FrameAttention:
        asked.append(queries)
        return QUESTION if len(asked) == 1 else ANSWER

    def probe_attention(observed: Observed) -> FrameAttention:  # the question's and the answer's rows alike
        probed.append(read(observed))  # what the probe really paid the five frames
        return PROBED

    monkeypatch.setattr(sys.modules["engine.step"], "frame_attention", frame_attention)
    monkeypatch.setattr(Observed, "read", probe_attention)
    answer = session.ask("What changed?", max_new_tokens=3)
    text = "".join(answer)
    assert answer.evidence == [Evidence(2.0, 1.0)]
    closing = len(model.tokenize(model.chat.assistant_to_user))
    assert asked == [answer.prompt_tokens, answer.tokens + closing], text
    probe_tokens = sum(len(ids) for ids in (model.tokenize(PROBE, user=True), model.tokenize(model.chat.user_to_assistant), model.tokenize(PROBE_ANSWER)))
    (real,) = probed
    window = session.cache.evidence_window  # the probe's last queries, its answer's among them
    assert real.times.tolist() == TIMES.tolist() and real.mass.shape == (min(probe_tokens, window), 5)
    assert bool((real.mass > 0).all())
    # the cache holds the question, the answer and its closing, and nothing of the probe
    assert session.cache.tokens == before + answer.prompt_tokens + answer.tokens + closing

"""Sampled answers: temperature, top-k, top-p, seeds and stop strings, on the built-in tiny model."""

import pytest
import torch

from engine import Sampling, Session, SessionConfig, load_model, sampling
from streamvqa.protocol import options
from tests.engine.test_session import frames

FULL = SessionConfig(policy="full")
QUESTION = "Describe it."


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def answer(model, sampling: Sampling | None = None, max_new_tokens: int = 16):
    """A fresh session that saw the same two frames, asked the same question: the same cache each time."""
    session = Session(model, FULL)
    session.append_frames(frames(2), [0.0, 1.0])
    reply = session.ask(QUESTION, max_new_tokens, sampling) if sampling else session.ask(QUESTION, max_new_tokens)
    return "".join(reply), reply


def test_top_k_and_top_p_draw_only_among_the_likeliest_tokens():
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0, -2.0])  # probabilities at temperature 1: .57 .35 .04 .02 .01
    generator = torch.Generator().manual_seed(0)
    drawn = {Sampling(temperature=1.0, top_k=2).choose(logits, generator) for _ in range(300)}
    assert drawn == {0, 1}
    drawn = {Sampling(temperature=1.0, top_p=0.9).choose(logits, generator) for _ in range(300)}
    assert drawn == {0, 1}  # .57 + .35 reach 0.9
    drawn = {Sampling(temperature=1.0, top_p=0.5).choose(logits, generator) for _ in range(100)}
    assert drawn == {0}
    assert {Sampling(temperature=2.0).choose(logits, generator) for _ in range(500)} == {0, 1, 2, 3, 4}


def test_temperature_zero_is_the_greedy_answer(model):
    greedy, _ = answer(model)
    assert len(greedy) >= 8
    assert answer(model, Sampling(temperature=0.0, top_k=5, seed=7))[0] == greedy  # top_k and seed unused


def test_the_same_seed_gives_the_same_sampled_answer(model):
    sampled = Sampling(temperature=1.5, seed=1234)
    first, _ = answer(model, sampled)
    assert answer(model, sampled)[0] == first
    assert answer(model, Sampling(temperature=1.5, seed=99))[0] != first
    assert first != answer(model)[0]  # not the greedy answer


def test_a_stop_string_ends_the_text_before_it(model):
    greedy, _ = answer(model)
    assert greedy == "T4\nT4\nT4\nT4\nT4\nT"  # the tiny random model's greedy answer, 16 tokens
    text, reply = answer(model, Sampling(stop=("4\nT4\nT", "never in it")))
    assert text == "T"
    assert reply.finish_reason == "stop"
    assert reply.tokens == 7  # "T" and the 6 of the stop string: generated, one a character


def test_text_held_back_for_a_stop_string_that_never_comes_is_sent_at_the_end(model):
    session = Session(model, FULL)
    session.append_frames(frames(2), [0.0, 1.0])
    reply = session.ask(QUESTION, 16, Sampling(stop=("T4\nX",)))
    pieces = list(reply)
    assert "".join(pieces) == "T4\nT4\nT4\nT4\nT4\nT"
    # "T4\nT" held back while it could begin "T4\nX", the "\n" before it as what follows a digit; the last piece holds none
    assert pieces[-1] == "\nT4\nT" and len(pieces) == 16
    assert reply.finish_reason == "length"


def test_finish_reason_is_length_at_the_token_limit(model):
    text, reply = answer(model, max_new_tokens=4)
    assert (reply.tokens, reply.finish_reason) == (4, "length")
    assert reply.prompt_tokens == len(QUESTION) + 13  # one token a character, and "<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "options",
    [{"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": -1},
     {"stop": ("",)}, {"stop": ("a", "b", "c", "d", "e")}, {"stop": ("x" * 65,)}],
)
def test_sampling_out_of_bounds_is_refused(options):
    with pytest.raises(ValueError):
        Sampling(**options)


def test_the_gateway_checks_the_engines_bounds():
    for name in ("MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_TEMPERATURE", "MAX_TOP_K", "MAX_SEED"):
        assert getattr(options, name) == getattr(sampling, name), name

"""No answer degenerates, whatever the model: on models built to repeat a phrase forever, or to
emit punctuation, an answer a user sees never repeats a word 3-gram 4 times nor runs on in
non-letters."""

from collections import Counter

import pytest
import torch

from engine import Sampling, Session, SessionConfig, load_model
from engine.sampling import Repeats

PUNCTUATION = ".,;:!?-_*#~^"  # a cycle of 12: 36 characters before its first 3-gram comes a 4th time


def markov(chain: str, loop_to: int | None = None):
    """The tiny Llama with every layer silenced, so that its logits depend on the last token only:
    after the prompt's closing "\\n" it says `chain`, one character a token, then goes on from
    `chain[loop_to]` (None: ends its turn); wherever its choice is passed over, it ends its turn
    (its second choice)."""
    model = load_model("tiny-random-llama", "cpu")
    hf, ids = model.hf, model.tokenize("\n" + chain)
    following = dict(zip(ids, ids[1:] + ([ids[loop_to + 1]] if loop_to is not None else [])))
    with torch.no_grad():
        for layer in hf.model.layers:  # the residual stream is then each token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.lm_head.weight.zero_()
        for direction, token in zip(torch.eye(hf.config.hidden_size), sorted(set(ids)), strict=False):
            hf.model.embed_tokens.weight[token] = direction
            hf.lm_head.weight[next(iter(model.stop_ids))] += 5 * direction
            if token in following:
                hf.lm_head.weight[following[token]] += 10 * direction
    return model


def ask(model, sampling: Sampling = Sampling(), max_new_tokens: int = 64):
    session = Session(model, SessionConfig(policy="full"))
    answer = session.ask("Say it.", max_new_tokens, sampling)
    pieces = list(answer)
    return "".join(pieces), answer, pieces


def most_repeated_word_3gram(text: str) -> int:
    words = text.split()
    return max(Counter(zip(words, words[1:], words[2:])).values(), default=0)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.5, seed=0)])
def test_a_phrase_repeated_forever_comes_three_times_at_most(sampling):
    text, answer, _ = ask(markov("go up\n", loop_to=0), sampling)  # unguarded: "go up\n" over and over, 64 tokens
    assert text == "go up\ngo up\ngo up\ngo"  # the 4th "go " was passed over: the model ended instead
    assert (answer.tokens, answer.finish_reason) == (20, "stop")
    assert most_repeated_word_3gram(text) == 3


def test_an_answer_that_turns_to_punctuation_ends_before_it():
    text, answer, _ = ask(markov("ok " + PUNCTUATION, loop_to=3))  # unguarded: "ok " and 61 punctuation marks
    assert text == "ok"  # the space and 31 marks after it were held back, then left out
    assert (answer.tokens, answer.finish_reason) == (34, "stop")


def test_what_follows_the_last_letter_waits_for_the_next_and_comes_at_the_end():
    text, answer, pieces = ask(markov("hi, you!"))
    assert pieces == ["h", "i", "", "", ", y", "o", "u", "", "!"]  # ", " came with "y"; "!" after the last token
    assert (text, answer.finish_reason) == ("hi, you!", "stop")


def test_a_token_3gram_is_passed_over_once_it_came_three_times():
    repeats, ids = Repeats(), []
    likeliest_after = [1, 2, 3, 1, 1]  # by the last token (0 at the start): the cycle 1 2 3; the next likeliest is 4
    for _ in range(16):
        logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
        logits[likeliest_after[ids[-1] if ids else 0]] = 2.0
        ids.append(Sampling().choose(logits, None, repeats.banned(ids)))
        repeats.add(ids)
    assert ids == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 4, 1]
    assert repeats.banned(ids) == [] and repeats.banned([7, 1, 2]) == [3]



def test_a_3gram_with_a_digit_is_never_passed_over():
    """Numbers in a list share digits and the marks between them ("10.5, 10.6, 10.7, 10.8"):
    passing a token over would change a number."""
    repeats, ids = Repeats(), []
    for token in [1, 0, 9, 5, 8] * 5:  # "10.5, " five times, with 0 and 5 the digits
        assert token not in repeats.banned(ids)
        ids.append(token)
        repeats.add(ids, numeric=token in (0, 5))
    assert repeats.banned([8, 1]) == [] and repeats.banned([9, 5]) == []

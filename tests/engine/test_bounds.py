"""A long stream never grows the cache past its bound, nor positions past theirs."""

import numpy as np
import pytest

from engine import Session, SessionConfig, load_model

BUDGET = 256
PIECE_TOKENS = 500  # each append: 500 printable characters, one token each
QUESTION = "What was said a while ago?"
# a question's turn: the question, user_to_assistant (13), 16 answer tokens, assistant_to_user (8)
ANSWER_TURN = len(QUESTION) + 13 + 16 + 8


STREAM_TOKENS = 200_000


@pytest.mark.parametrize("policy", ["infmllm", "sliding", "h2o", "snapkv", "tova", "knorm"])
def test_cache_and_positions_stay_bounded_over_a_long_stream(policy):
    session = Session(load_model("tiny-random-llama", "cpu"), SessionConfig(policy=policy, budget_tokens=BUDGET))
    rng = np.random.default_rng(0)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz ,."))
    peak_tokens = 0
    for step in range(STREAM_TOKENS // PIECE_TOKENS):
        session.append_text("".join(rng.choice(alphabet, PIECE_TOKENS)))
        if step % 40 == 39:
            answer = session.ask(QUESTION, max_new_tokens=16)
            list(answer)
        stats = session.stats()
        assert stats.cache_tokens <= BUDGET
        peak_tokens = max(peak_tokens, stats.max_position + 1)
    stats = session.stats()
    assert stats.tokens_seen >= STREAM_TOKENS
    assert peak_tokens <= BUDGET + max(PIECE_TOKENS, ANSWER_TURN)
    assert stats.cache_bytes == 2 * 2 * 2 * BUDGET * 16 * 4  # layers x (K, V) x KV heads x B x head_dim x float32

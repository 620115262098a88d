"""pin_turns: the opening and the turn markers of the latest questions are never evicted."""

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, load_model

BUDGET = 200
SHORT = {"system_prompt": "Be brief.", "policy_options": {"recent": 32}}  # the tiny tokenizer: a token a character


def config(policy: str, **changes) -> SessionConfig:
    return SessionConfig(policy=policy, budget_tokens=BUDGET, **SHORT, **changes)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(count)]


def held_places(session: Session) -> set[int]:
    """Stream places every layer and KV head still holds."""
    rows = [set(row.tolist()) for order in session.cache.order for row in order]
    return set.intersection(*rows)


def test_the_opening_and_the_latest_turns_markers_outlive_a_sliding_window(model):
    session = Session(model, config("sliding", pin_turns=2))
    opening = set(range(session.cache.appended))
    turns = []
    for turn in range(3):
        session.append_frames(frames(12, turn), [float(12 * turn + t) for t in range(12)])
        list(session.ask("What now?", max_new_tokens=3))
        turns.append(set(session.cache.pins[-1].tolist()))
    session.append_frames(frames(12, 9), [float(36 + t) for t in range(12)])  # the window moves past every turn
    held = held_places(session)
    assert session.stats().cache_tokens == BUDGET
    assert opening <= held and len(opening) > 4  # more than the sinks
    assert turns[1] <= held and turns[2] <= held  # each turn: the question's and the answer's closing markers
    assert not turns[0] & held  # pinned no longer: the window took it
    restored = Session.restore(model, session.snapshot())
    assert [p.tolist() for p in restored.cache.pins] == [p.tolist() for p in session.cache.pins]


def test_without_pins_the_sliding_window_keeps_only_the_sinks_of_the_opening(model):
    session = Session(model, config("sliding"))
    opening = set(range(session.cache.appended))
    session.append_frames(frames(24, 1), [float(t) for t in range(24)])
    assert opening & held_places(session) == {0, 1, 2, 3}


def test_pins_that_leave_no_room_are_refused(model):
    with pytest.raises(ValueError, match="pin_turns"):
        Session(model, config("infmllm", pin_turns=8))
    with pytest.raises(ValueError, match="pin_turns must be >= 0"):
        SessionConfig(pin_turns=-1)


def test_pinned_tokens_are_kept_by_every_scoring_policy(model):
    for policy in ("h2o", "snapkv", "tova", "knorm", "infmllm"):
        session = Session(model, config(policy, pin_turns=1))
        opening = set(range(session.cache.appended))
        session.append_frames(frames(20, 2), [float(t) for t in range(20)])
        list(session.ask("And?", max_new_tokens=2))
        session.append_frames(frames(20, 3), [float(20 + t) for t in range(20)])
        assert opening | set(session.cache.pins[-1].tolist()) <= held_places(session), policy
        assert torch.equal(torch.tensor(session.stats().cache_tokens), torch.tensor(BUDGET))

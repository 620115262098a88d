"""snapshot() and restore(): the same cache, the same next logits, the same next answer elsewhere."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, load_model

CONFIG = SessionConfig(policy="infmllm", budget_tokens=160, policy_options={"recent": 32})
RESTORE_AND_ASK = """
import sys
from engine import Session, load_model
session = Session.restore(load_model("tiny-random-llava", "cpu"), open(sys.argv[1], "rb").read())
answer = session.ask("What came last?", max_new_tokens=24)
print("".join(answer), end="")
print("|" + ",".join(f"{e.time_s}:{e.weight}" for e in answer.evidence), end="")
"""


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random-llava", "cpu")


def _watched(model) -> Session:
    session = Session(model, CONFIG)
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(12)]
    session.append_frames(frames, [float(t) for t in range(12)])
    list(session.ask("And now?", max_new_tokens=5))
    return session


def test_restore_gives_identical_next_token_logits_and_state(model):
    session = _watched(model)
    assert session.stats().evictions > 5  # the snapshot is of an evicted, re-rotated cache
    restored = Session.restore(model, session.snapshot())
    assert torch.equal(restored.logits, session.logits)
    assert restored.stats() == session.stats()
    assert restored.memory() == session.memory()
    rng = np.random.default_rng(4)
    more = [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(3)]
    for s in (session, restored):
        s.append_frames(more, [12.0, 13.0, 14.0])
    assert torch.equal(restored.logits, session.logits)


def test_restore_in_a_fresh_process_gives_the_same_next_answer(model, tmp_path):
    session = _watched(model)
    path = tmp_path / "session.snapshot"
    path.write_bytes(session.snapshot())
    elsewhere = subprocess.run(
        [sys.executable, "-c", RESTORE_AND_ASK, str(path)], capture_output=True, text=True, check=True
    ).stdout
    answer = session.ask("What came last?", max_new_tokens=24)
    here = "".join(answer) + "|" + ",".join(f"{e.time_s}:{e.weight}" for e in answer.evidence)
    assert elsewhere == here


def test_a_snapshot_of_another_model_is_refused(model):
    data = Session(load_model("tiny-random-llama", "cpu"), CONFIG).snapshot()
    with pytest.raises(ValueError, match="tiny-random-llama"):
        Session.restore(model, data)

"""With a budget larger than the stream, every policy computes exactly what one plain forward does."""

import numpy as np
import pytest
import torch

from engine import POLICIES, Session, SessionConfig, load_model

FAMILIES = ["tiny-random-llava", "tiny-random-llava-next-video", "tiny-random-llava-onevision", "tiny-random-llama"]
TOLERANCE = 1e-4  # float32, chunked SDPA against one eager forward


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return load_model(request.param, "cpu")


def _plain_logits(model, embeds: torch.Tensor) -> torch.Tensor:
    """One transformers forward over the whole sequence, with eager attention and no cache."""
    text = model.hf.config.get_text_config()
    chosen = text._attn_implementation
    text._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            return model.hf(inputs_embeds=embeds).logits[0, -1]
    finally:
        text._attn_implementation = chosen


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_equals_one_plain_forward_when_nothing_is_evicted(model, policy):
    config = SessionConfig(policy=policy, budget_tokens=100_000, frames_per_prompt=2, prefill_chunk_tokens=16)
    session = Session(model, config)
    text = model.embed_tokens
    sequence = [text(model.tokenize(model.chat.open(config.system_prompt)))]
    if model.sees_frames:
        rng = np.random.default_rng(1)
        frames = [rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(5)]
        times = [0.0, 0.5, 1.0, 1.5, 2.0]
        session.append_frames(frames, times)
        visual = model.encode_frames(frames)
        for tokens, t in zip(visual, times):
            sequence += [text(model.tokenize(f"[{t:.1f}s]")), tokens[None], text(model.tokenize("\n"))]
    session.append_text("Then a note arrives, in plain words.")
    sequence.append(text(model.tokenize("Then a note arrives, in plain words.")))
    assert session.stats().evictions == 0
    reference = _plain_logits(model, torch.cat(sequence, dim=1))
    assert torch.allclose(session.logits, reference, atol=TOLERANCE), float((session.logits - reference).abs().max())

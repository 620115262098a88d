"""Eviction through a real model: the keys the attention sees after evictions are exactly those of
the kept tokens run at their new positions, with each token's kind and time beside it."""

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine import Session, SessionConfig, load_model
from engine.kv_cache import FRAME, TEXT

TOLERANCE = 1e-4


@pytest.mark.parametrize("policy", ["infmllm", "h2o", "snapkv", "tova", "knorm", "sliding"])
def test_kept_keys_equal_fresh_keys_at_their_new_positions(policy):
    model = load_model("tiny-random-llava", "cpu")
    config = SessionConfig(policy=policy, budget_tokens=60, policy_options={"sinks": 2, "recent": 8}, prefill_chunk_tokens=7)
    session = Session(model, config)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(8)]
    times = [float(t) for t in range(8)]
    session.append_frames(frames, times)
    assert session.stats().evictions >= 5

    # every token of the stream, with its kind and time, as the session ran them
    text = lambda t: model.embed_tokens(model.tokenize(t))  # noqa: E731
    parts = [(text(model.chat.open(config.system_prompt)), TEXT, 0.0)]
    for tokens, t in zip(model.encode_frames(frames), times):
        parts += [(text(f"[{t:.1f}s]"), TEXT, t), (tokens[None], FRAME, t), (text("\n"), TEXT, t)]
    embeds = torch.cat([p for p, _, _ in parts], dim=1)
    kinds = [k for p, k, _ in parts for _ in range(p.shape[1])]
    stream_times = [t for p, _, t in parts for _ in range(p.shape[1])]

    language = model.hf.model.language_model
    attention = language.layers[0].self_attn
    with torch.inference_mode():
        unrotated = attention.k_proj(language.layers[0].input_layernorm(embeds))
    unrotated = unrotated.view(1, -1, model.kv_heads, attention.head_dim).transpose(1, 2)  # (1, kv, stream, d)

    kept = session.cache.rotated_keys(0)  # (kv, n, d): what the attention sees
    for head in range(model.kv_heads):
        for slot in range(kept.shape[1]):
            cos, sin = model.rotary(unrotated, torch.tensor([[slot]]))
            _, fresh = apply_rotary_pos_emb(unrotated[:, head], unrotated[:, head], cos, sin, unsqueeze_dim=0)
            matches = ((fresh[0, 0] - kept[head, slot]).norm(dim=-1) < TOLERANCE).nonzero().flatten().tolist()
            assert any(
                kinds[i] == session.cache.kinds[0][head, slot] and stream_times[i] == session.cache.times[0][head, slot]
                for i in matches
            ), (head, slot)

"""Re-encoded positions: moving rotated keys equals rotating them from scratch at their new place."""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine import load_model
from engine.kv_cache import rerotate

HEADS, HEAD_DIM = 2, 16  # the tiny models' KV heads


def rotary():
    return load_model("tiny-random-llama", "cpu").rotary


def at(raw: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """Raw keys (1, H, n, d) rotated from scratch at `positions` (H, n), the way transformers'
    Llama rotates keys before caching them."""
    heads = []
    for head in range(raw.shape[1]):
        cos, sin = rope(raw, positions[head][None])  # (1, n, d)
        _, rotated = apply_rotary_pos_emb(raw[:, head : head + 1], raw[:, head : head + 1], cos, sin)
        heads.append(rotated)
    return torch.cat(heads, dim=1)


def test_attention_over_moved_keys_equals_attention_over_keys_rotated_at_their_new_positions():
    torch.manual_seed(0)
    rope = rotary()
    raw = torch.randn(1, HEADS, 40, HEAD_DIM)
    old = torch.arange(40).expand(HEADS, 40)
    cached = at(raw, old, rope)
    keep = torch.stack([torch.tensor([0, 1, 7, 8, 20, 33, 38, 39]), torch.tensor([0, 1, 2, 15, 16, 30, 31, 39])])
    new = torch.arange(8).expand(HEADS, 8)
    index = keep[None, :, :, None].expand(1, HEADS, 8, HEAD_DIM)
    moved = rerotate(cached.gather(2, index), new - keep, rope)
    fresh = at(raw.gather(2, index), new, rope)
    assert torch.allclose(moved, fresh, atol=1e-5)

    query = at(torch.randn(1, HEADS, 1, HEAD_DIM), torch.full((HEADS, 1), 8), rope)  # the next token, at 8
    attention_moved = (query @ moved.transpose(-1, -2)).softmax(-1)
    attention_fresh = (query @ fresh.transpose(-1, -2)).softmax(-1)
    assert torch.allclose(attention_moved, attention_fresh, atol=1e-6)


def test_a_thousand_evictions_stay_within_float_tolerance_of_recomputing():
    torch.manual_seed(1)
    rope = rotary()
    budget, chunk = 64, 16
    raw_pool = torch.randn(1, HEADS, budget + 1000 * chunk, HEAD_DIM)
    ids = torch.arange(budget).expand(HEADS, budget)  # which raw key each cached slot holds
    cached = at(raw_pool[:, :, :budget], ids, rope)
    for step in range(1000):
        start = budget + step * chunk
        new_ids = torch.arange(start, start + chunk).expand(HEADS, chunk)
        positions = torch.arange(budget, budget + chunk).expand(HEADS, chunk)
        cached = torch.cat([cached, at(raw_pool[:, :, start : start + chunk], positions, rope)], dim=2)
        ids = torch.cat([ids, new_ids], dim=1)
        keep = torch.stack([torch.randperm(budget + chunk)[:budget].sort().values for _ in range(HEADS)])
        index = keep[None, :, :, None].expand(1, HEADS, budget, HEAD_DIM)
        cached = rerotate(cached.gather(2, index), torch.arange(budget) - keep, rope)
        ids = ids.gather(1, keep)
    recomputed = at(raw_pool.gather(2, ids[None, :, :, None].expand(1, HEADS, budget, HEAD_DIM)), torch.arange(budget).expand(HEADS, budget), rope)
    error = float((cached - recomputed).abs().max())
    assert error < 1e-4, error

"""Re-encoded positions: after any number of evictions, the keys the attention sees are the kept
keys rotated from scratch at their new positions, in float32 and in bfloat16 alike."""

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine import Session, SessionConfig, load_model
from engine.kv_buffers import rotate
from engine.kv_cache import KVCache
from engine.policies import make_policy

HEADS, HEAD_DIM = 2, 16  # the tiny models' KV heads


@pytest.fixture(scope="module")
def rope():
    return load_model("tiny-random-llama", "cpu").rotary


def at(raw: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """Raw keys (1, H, n, d) rotated at `positions` (H, n), the way transformers' Llama rotates
    keys before caching them, in float32."""
    heads = []
    for head in range(raw.shape[1]):
        cos, sin = rope(raw.float(), positions[head][None])  # (1, n, d)
        _, rotated = apply_rotary_pos_emb(raw[:, head : head + 1].float(), raw[:, head : head + 1].float(), cos, sin)
        heads.append(rotated)
    return torch.cat(heads, dim=1)


def _cache(rope) -> KVCache:
    return KVCache(make_policy("full"), rope, num_layers=1, kv_heads=HEADS)


def _append(cache: KVCache, raw: torch.Tensor, rope) -> None:
    """What the model does: rotate new keys at the next positions, hand them to the cache."""
    start, count = cache.tokens, raw.shape[2]
    positions = torch.arange(start, start + count).expand(HEADS, count)
    cache.hf.layers[0].update(at(raw, positions, rope).to(raw.dtype), torch.zeros_like(raw))
    cache.append(torch.zeros(count, dtype=torch.int8), torch.zeros(count))


def _evict(cache: KVCache, keep: torch.Tensor) -> None:
    """What an eviction does to the keys: gather each head's kept tokens (keep (H, B), ascending)."""
    cached = cache.hf.layers[0]
    index = keep[None, :, :, None].expand(1, HEADS, keep.shape[1], HEAD_DIM)
    cached.keys, cached.values = cached.keys.gather(2, index), cached.values.gather(2, index)
    cache.kinds[0], cache.times[0] = cache.kinds[0].gather(1, keep), cache.times[0].gather(1, keep)


def test_attention_over_kept_keys_equals_attention_over_keys_rotated_at_their_new_positions(rope):
    torch.manual_seed(0)
    raw = torch.randn(1, HEADS, 40, HEAD_DIM)
    cache = _cache(rope)
    _append(cache, raw, rope)
    keep = torch.stack([torch.tensor([0, 1, 7, 8, 20, 33, 38, 39]), torch.tensor([0, 1, 2, 15, 16, 30, 31, 39])])
    _evict(cache, keep)
    fresh = at(raw.gather(2, keep[None, :, :, None].expand(1, HEADS, 8, HEAD_DIM)), torch.arange(8).expand(HEADS, 8), rope)
    seen = cache.rotated_keys(0)[None]
    assert torch.allclose(seen, fresh, atol=1e-5)

    query = at(torch.randn(1, HEADS, 1, HEAD_DIM), torch.full((HEADS, 1), 8), rope)  # the next token, at 8
    assert torch.allclose((query @ seen.transpose(-1, -2)).softmax(-1), (query @ fresh.transpose(-1, -2)).softmax(-1), atol=1e-6)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.02)])
def test_a_thousand_evictions_stay_within_rounding_of_recomputing(rope, dtype, tolerance):
    """bfloat16 keys are rounded when stored and when rotated, never more: the error after a
    thousand evictions is that of one or two roundings (2^-8 each), not of a thousand."""
    torch.manual_seed(1)
    budget, chunk = 64, 16
    pool = torch.randn(1, HEADS, budget + 1000 * chunk, HEAD_DIM)
    cache = _cache(rope)
    ids = torch.arange(budget).expand(HEADS, budget)  # which raw key each cached slot holds
    _append(cache, pool[:, :, :budget].to(dtype), rope)
    for step in range(1000):
        start = budget + step * chunk
        _append(cache, pool[:, :, start : start + chunk].to(dtype), rope)
        ids = torch.cat([ids, torch.arange(start, start + chunk).expand(HEADS, chunk)], dim=1)
        keep = torch.stack([torch.randperm(budget + chunk)[:budget].sort().values for _ in range(HEADS)])
        _evict(cache, keep)
        ids = ids.gather(1, keep)
    raw = pool.gather(2, ids[None, :, :, None].expand(1, HEADS, budget, HEAD_DIM))
    fresh = at(raw, torch.arange(budget).expand(HEADS, budget), rope)
    error = float(((cache.rotated_keys(0)[None].float() - fresh).norm(dim=-1) / fresh.norm(dim=-1)).max())
    assert error < tolerance, error


class Failure(Exception):
    pass


@pytest.mark.parametrize("policy", ["infmllm", "h2o"])
def test_the_keys_every_forward_attends_are_the_stored_keys_rotated_from_scratch(policy):
    """The cache keeps a rotated copy and rotates only new tokens into it; through evictions, a
    question that borrows from the host tier, its give-back and a failed forward, the keys the
    attention gets are still those of rotating every stored key at its index: bit for bit as the
    cache's own rotation of the whole layer, and as transformers' within float32 rounding."""
    model = load_model("tiny-random-llava", "cpu")
    session = Session(model, SessionConfig(policy=policy, budget_tokens=160, recall=True))
    cache, attend = session.cache, session.cache.attend
    seen = {"forwards": 0, "borrowed": 0, "fail_at": None}

    def checked(layer, queries, keys, values, scaling):
        if seen["fail_at"] == layer:
            seen["fail_at"] = None
            raise Failure
        attended, values = attend(layer, queries, keys, values, scaling)
        stored = cache.hf.layers[layer].keys  # (1, kv_heads, N, head_dim), as stored
        count = stored.shape[2]
        cos, sin = cache.positions.up_to(count, stored)
        assert torch.equal(attended, rotate(stored, cos, sin, cache.positions.scale))
        assert torch.allclose(attended, at(stored, torch.arange(count).expand(stored.shape[1], count), model.rotary), atol=1e-5)
        seen["forwards"] += layer == 0
        seen["borrowed"] += layer == 0 and 0 in cache.loan.borrowed
        return attended, values

    cache.attend = checked
    rng = np.random.default_rng(0)
    for second in range(0, 24, 4):
        pictures = [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(4)]
        session.append_frames(pictures, [float(t) for t in range(second, second + 4)])
        if second == 8:
            seen["fail_at"] = 1  # the next forward fails in its second layer and is rolled back
            with pytest.raises(Failure):
                session.append_text("a forward that fails")
        if second in (12, 20):
            list(session.ask("What did you see first?", max_new_tokens=6))
    assert session.stats().evictions >= 8
    assert seen["borrowed"] > 0  # some forwards ran with borrowed tokens merged in
    assert seen["forwards"] > 30

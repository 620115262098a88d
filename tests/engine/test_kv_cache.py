"""The cache's buffers: keys, values and their rotated copy grow in place, the last queries and
each token's kind, time and place wait to be joined; whichever way tokens arrive, what the cache
holds and what the attention reads are the same, bit for bit."""

import pytest
import torch

from engine import load_model
from engine import kv_buffers
from engine.kv_buffers import GROWTH, rotate
from engine.kv_cache import MERGE_EVERY, KVCache
from engine.policies import make_policy

HEADS, GROUP, HEAD_DIM, SCALING = 2, 3, 16, 0.25  # the tiny models' KV heads and head size


@pytest.fixture(scope="module")
def rope():
    return load_model("tiny-random-llama", "cpu").rotary


def _cache(rope, layers: int = 2) -> KVCache:
    return KVCache(make_policy("full"), rope, num_layers=layers, kv_heads=HEADS)


def _run(cache: KVCache, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, start: int, end: int) -> None:
    """What a forward of tokens start..end-1 does to every layer: store, attend, append."""
    for layer, cached in enumerate(cache.hf.layers):
        stored, held = cached.update(keys[:, :, start:end], values[:, :, start:end])
        cache.attend(layer, queries[:, :, start:end], stored, held, SCALING)
    cache.append(torch.arange(start, end).remainder(2).to(torch.int8), torch.arange(start, end) / 10)


def _tokens(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values (1, HEADS, count, HEAD_DIM) and queries (1, HEADS * GROUP, count, HEAD_DIM)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(1, HEADS, count, HEAD_DIM, generator=generator) for _ in range(2))
    return keys, values, torch.randn(1, HEADS * GROUP, count, HEAD_DIM, generator=generator)


def _same(one: KVCache, other: KVCache) -> None:
    for layer, (mine, theirs) in enumerate(zip(one.hf.layers, other.hf.layers, strict=True)):
        assert torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)
        assert torch.equal(one.rotated_keys(layer), other.rotated_keys(layer))
        for name in ("kinds", "times", "order"):
            assert torch.equal(getattr(one, name)[layer], getattr(other, name)[layer])
        assert torch.equal(one._queries[layer].read(), other._queries[layer].read())


def test_a_token_at_a_time_past_every_capacity_equals_all_at_once(rope):
    count = 300  # one token a forward: the buffers grow many times, the kinds wait MERGE_EVERY forwards
    keys, values, queries = _tokens(count)
    at_once, one_by_one = _cache(rope), _cache(rope)
    _run(at_once, keys, values, queries, 0, count)
    for token in range(count):
        _run(one_by_one, keys, values, queries, token, token + 1)
    assert count > 4 * MERGE_EVERY
    assert one_by_one.tokens == at_once.tokens == count
    _same(one_by_one, at_once)
    cached = one_by_one.hf.layers[0]
    assert count <= cached._keys.buffer.shape[2] <= GROWTH * count + 1  # the room is bounded
    assert one_by_one._queries[0].read().shape == (HEADS * GROUP, 32, HEAD_DIM)  # the last 32, the evidence window
    assert one_by_one.kinds[0][0, :4].tolist() == [0, 1, 0, 1]
    assert one_by_one.order[1][1, -3:].tolist() == [297, 298, 299]


def test_the_buffers_grow_no_larger_than_the_expected_peak_until_the_cache_holds_more(rope):
    peak = 200
    keys, values, queries = _tokens(peak + 10, seed=5)
    cache = KVCache(make_policy("full"), rope, num_layers=2, kv_heads=HEADS, most_tokens=peak)
    for token in range(peak):
        _run(cache, keys, values, queries, token, token + 1)
    for cached in cache.hf.layers:  # keys, values and their rotated copy: 1.5x the keys and values, not 2.25x
        for rows in (cached._keys, cached._values, cached._rotated):
            assert rows.buffer.shape[2] == peak
    _run(cache, keys, values, queries, peak, peak + 10)  # past it: room again, bounded as ever
    assert peak + 10 <= cache.hf.layers[0]._keys.buffer.shape[2] <= GROWTH * (peak + 10) + 1
    reference = _cache(rope)
    _run(reference, keys, values, queries, 0, peak + 10)
    _same(cache, reference)


def test_an_eviction_then_more_tokens_reads_the_kept_keys_rotated_at_their_new_indices(rope):
    keys, values, queries = _tokens(120, seed=1)
    cache = _cache(rope, layers=1)
    _run(cache, keys, values, queries, 0, 80)
    cached = cache.hf.layers[0]
    keep = torch.stack([torch.arange(0, 80, 2), torch.arange(1, 80, 2)])  # (HEADS, 40): each head its own
    index = keep[None, :, :, None].expand(1, HEADS, 40, HEAD_DIM)
    kept_keys, kept_values = cached.keys.gather(2, index), cached.values.gather(2, index)
    cached.keys, cached.values = kept_keys, kept_values  # into the same buffers
    for meta in (cache.kinds, cache.times, cache.order):
        meta[0] = meta[0].gather(1, keep)
    for token in range(80, 120):  # appended after the kept tokens, one a forward
        _run(cache, keys, values, queries, token, token + 1)
    assert torch.equal(cached.keys[:, :, :40], kept_keys)
    assert torch.equal(cached.values[:, :, 40:], values[:, :, 80:])
    cos, sin = cache.positions.up_to(80, cached.keys)
    assert torch.equal(cache.rotated_keys(0), rotate(cached.keys, cos, sin, cache.positions.scale)[0])
    assert cache.order[0][0, 38:42].tolist() == [76, 78, 80, 81]


def test_a_rollback_cuts_what_a_failed_forward_stored_and_the_copy_stays_right(rope):
    keys, values, queries = _tokens(60, seed=2)
    cache, clean = _cache(rope), _cache(rope)
    for run in (cache, clean):
        _run(run, keys, values, queries, 0, 50)
    for cached in cache.hf.layers:  # a forward that failed after its keys were stored
        cached.update(keys[:, :, 50:60], values[:, :, 50:60])
    cache.rollback()
    assert cache.hf.layers[0].keys.shape[2] == 50
    clean._queries[0].set(None), clean._queries[1].set(None)  # a rollback forgets the queries
    for run in (cache, clean):
        run.hf.layers[0].update(keys[:, :, 50:60], values[:, :, 50:60])
        run.hf.layers[1].update(keys[:, :, 50:60], values[:, :, 50:60])
        run.append(torch.zeros(10, dtype=torch.int8), torch.zeros(10))
        for layer in range(2):
            run.attend(layer, queries[:, :, 50:60], None, None, SCALING)
    _same(cache, clean)


def test_a_snapshot_holds_the_tokens_alone_not_the_room_after_them(rope):
    keys, values, queries = _tokens(100, seed=3)
    cache = _cache(rope)
    for token in range(100):
        _run(cache, keys, values, queries, token, token + 1)
    state = cache.state()
    for stored in state["keys"] + state["values"]:
        assert stored.shape == (1, HEADS, 100, HEAD_DIM)
        assert stored.untyped_storage().nbytes() == 100 * HEADS * HEAD_DIM * 4
    assert torch.equal(state["keys"][1], cache.hf.layers[1].keys)


def test_prompts_that_evict_nothing_rotate_only_their_own_keys_and_one_that_evicts_rotates_again(rope, monkeypatch):
    """`full` (and a bounded cache under its budget) keeps its rotated keys from one prompt to
    the next: streaming a long video costs each frame its own tokens, not the whole cache again."""
    keys, values, queries = _tokens(200, seed=6)
    cache = KVCache(make_policy("sliding", budget_tokens=150, sinks=4, recent=40), rope, num_layers=1, kv_heads=HEADS)
    rotated: list[int] = []
    real = kv_buffers.rotate
    monkeypatch.setattr(kv_buffers, "rotate", lambda stored, *a, **k: rotated.append(stored.shape[2]) or real(stored, *a, **k))
    for start in range(0, 140, 20):  # under the budget: every prompt's 20 keys are rotated twice (stored, and the copy)
        _run(cache, keys, values, queries, start, start + 20)
        cache.evict()
    assert sum(rotated) == 2 * 140
    rotated.clear()
    _run(cache, keys, values, queries, 140, 160)
    cache.evict()  # 160 tokens: down to 150, which move to other indices
    _run(cache, keys, values, queries, 160, 180)
    assert rotated == [20, 20, 20, 170]  # 140..160 stored and copied; 160..180 stored, then the whole copy made again
    cos, sin = cache.positions.up_to(170, keys)
    assert torch.equal(cache.rotated_keys(0), rotate(cache.hf.layers[0].keys, cos, sin, cache.positions.scale)[0])

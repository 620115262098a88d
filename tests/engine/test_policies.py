"""Each policy's selection against a reference written here from its formula, on random tensors."""

import math

import pytest
import torch

from engine import load_model
from engine.kv_cache import KVCache
from engine.policies import POLICIES, Observation, causal_attention, make_policy

KV_HEADS, GROUP, HEAD_DIM = 2, 3, 16  # GQA: 6 query heads read 2 KV heads; the tiny models' head size
TOTAL, WINDOW, SCALING = 60, 5, 1 / math.sqrt(HEAD_DIM)


ROTARY = load_model("tiny-random-llama", "cpu").rotary


def _store(cache: KVCache, stored: torch.Tensor) -> None:
    cached = cache.hf.layers[0]
    cached.lazy_initialization(stored, stored)
    cached.keys, cached.values = stored, torch.zeros_like(stored)


def _cache(policy, queries: torch.Tensor, stored: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    """A one-layer cache holding `stored` keys (1, H, N, d), having run the prompt whose queries
    are `queries` (1, q_heads, w, d); and the keys the attention sees: `stored` rotated at their index."""
    cache = KVCache(policy, ROTARY, num_layers=1, kv_heads=KV_HEADS)
    _store(cache, stored)
    seen, _ = cache.attend(0, queries, stored, torch.zeros_like(stored), SCALING)
    cache.append(torch.zeros(stored.shape[2], dtype=torch.int8), torch.zeros(stored.shape[2]))
    return cache, seen


def _random(seed: int):
    torch.manual_seed(seed)
    return torch.randn(1, KV_HEADS * GROUP, WINDOW, HEAD_DIM), torch.randn(1, KV_HEADS, TOTAL, HEAD_DIM)


def _reference_column_means(queries, keys) -> list[list[float]]:
    """s[h][j]: for KV head h, the mean over its query heads of the mean attention key j gets
    from the window queries that see it (query i sits at position total - WINDOW + i)."""
    total = keys.shape[2]
    s = [[0.0] * total for _ in range(KV_HEADS)]
    for h in range(KV_HEADS):
        for g in range(GROUP):
            q_head = h * GROUP + g
            for j in range(total):
                received, seen_by = 0.0, 0
                for i in range(WINDOW):
                    position = total - WINDOW + i
                    if j > position:
                        continue
                    logits = [float(queries[0, q_head, i] @ keys[0, h, k]) * SCALING for k in range(position + 1)]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    received += weights[j] / sum(weights)
                    seen_by += 1
                s[h][j] += received / seen_by / GROUP
    return s


def _reference_keep(scores: list[list[float]], budget: int, sinks: int, recent: int) -> list[list[int]]:
    kept = []
    for row in scores:
        total = len(row)
        middle = sorted(range(sinks, total - recent), key=lambda j: -row[j])[: budget - sinks - recent]
        kept.append(sorted([*range(sinks), *middle, *range(total - recent, total)]))
    return kept


@pytest.mark.parametrize("beta", [0.0, 0.7, 50.0])
def test_infmllm_per_head_selection_matches_the_formula(beta):
    queries, keys = _random(0)
    policy = make_policy("infmllm", budget_tokens=24, sinks=2, recent=6, window=WINDOW, beta=beta, local_sum=1)
    attention = causal_attention(queries[0], keys[0], SCALING)
    chosen = policy.select(policy.score(Observation(KV_HEADS, TOTAL, attention))).tolist()

    s = _reference_column_means(queries, keys)
    scores = [[TOTAL * s[h][j] + beta * j / (TOTAL - 1) for j in range(TOTAL)] for h in range(KV_HEADS)]
    assert chosen == _reference_keep(scores, 24, 2, 6)
    if beta < 50.0:
        assert chosen[0] != chosen[1]  # the heads keep different tokens
    else:  # a large bias is a sliding window
        assert chosen == [[0, 1, *range(TOTAL - 22, TOTAL)]] * KV_HEADS


def test_infmllm_local_sum_and_square_bias_match_the_formula():
    queries, keys = _random(3)
    policy = make_policy(
        "infmllm", budget_tokens=24, sinks=2, recent=6, window=WINDOW, beta=2.0, bias_shape="square", local_sum=3
    )
    attention = causal_attention(queries[0], keys[0], SCALING)
    chosen = policy.select(policy.score(Observation(KV_HEADS, TOTAL, attention))).tolist()

    s = _reference_column_means(queries, keys)
    local = [[sum(s[h][k] for k in (j - 1, j, j + 1) if 0 <= k < TOTAL) for j in range(TOTAL)] for h in range(KV_HEADS)]
    scores = [[TOTAL * local[h][j] + 2.0 * (j / (TOTAL - 1)) ** 2 for j in range(TOTAL)] for h in range(KV_HEADS)]
    assert chosen == _reference_keep(scores, 24, 2, 6)


def test_infmllm_per_layer_selection_shares_the_heads_mean():
    queries, keys = _random(1)
    policy = make_policy(
        "infmllm", budget_tokens=20, sinks=1, recent=4, window=WINDOW, beta=0.3, per_layer=True, local_sum=1
    )
    attention = causal_attention(queries[0], keys[0], SCALING)
    chosen = policy.select(policy.score(Observation(KV_HEADS, TOTAL, attention))).tolist()

    s = _reference_column_means(queries, keys)
    mean = [sum(TOTAL * s[h][j] + 0.3 * j / (TOTAL - 1) for h in range(KV_HEADS)) / KV_HEADS for j in range(TOTAL)]
    expected = _reference_keep([mean], 20, 1, 4)[0]
    assert chosen == [expected, expected]


def test_evicting_through_the_cache_keeps_the_chosen_tokens_in_order():
    queries, keys = _random(2)
    policy = make_policy("infmllm", budget_tokens=24, sinks=2, recent=6, window=WINDOW, beta=0.7, local_sum=1, block_tokens=1)
    cache, seen = _cache(policy, queries, keys)
    cache.times[0] = torch.arange(TOTAL, dtype=torch.float32).expand(KV_HEADS, TOTAL).clone()  # each token's index
    s = _reference_column_means(queries, seen)
    expected = _reference_keep([[TOTAL * s[h][j] + 0.7 * j / (TOTAL - 1) for j in range(TOTAL)] for h in range(KV_HEADS)], 24, 2, 6)
    cache.evict()
    assert cache.tokens == 24
    assert cache.times[0].long().tolist() == expected  # each token's source travelled with it
    assert (cache.evictions, cache.evicted_tokens) == (1, TOTAL - 24)


def test_sliding_keeps_sinks_and_the_most_recent():
    policy = make_policy("sliding", budget_tokens=10, sinks=3, recent=2)
    chosen = policy.select(policy.score(Observation(KV_HEADS, TOTAL))).tolist()
    assert chosen == [[0, 1, 2, *range(TOTAL - 7, TOTAL)]] * KV_HEADS


def test_h2o_accumulates_attention_across_evictions():
    policy = make_policy("h2o", budget_tokens=8, sinks=1, recent=2)
    received = torch.zeros(KV_HEADS, 12)
    received[:, 5] = 1.5  # key 5 got the attention of one and a half queries since the last eviction
    previous = torch.zeros(KV_HEADS, 12)
    previous[:, 9] = 10.0  # key 9 was a heavy hitter before
    scores = policy.score(Observation(KV_HEADS, 12, previous=previous, received=received))
    assert scores[:, 5].tolist() == [1.5, 1.5]
    assert scores[:, 9].tolist() == [10.0, 10.0]
    assert {5, 9} <= set(policy.select(scores)[0].tolist())


def test_h2o_splits_its_budget_between_heavy_hitters_and_recent_tokens_as_the_paper_does():
    policy = make_policy("h2o", budget_tokens=8, sinks=1)
    assert policy.recent == 4  # half the budget, unless given
    received = torch.tensor([[0.0, 0.9, 0.1, 2.0, 0.3, 0.2, 1.5, 0.1, 0.0, 0.0, 0.0, 0.0]] * KV_HEADS)
    previous = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * KV_HEADS)
    # sink 0, recent 8..11, and of 1..7 the 3 heaviest by accumulated attention: 3 (2.0), 6 (1.5), 4 (0.3 + 1.0)
    scores = policy.score(Observation(KV_HEADS, 12, previous=previous, received=received))
    assert policy.select(scores).tolist() == [[0, 3, 4, 6, 8, 9, 10, 11]] * KV_HEADS


def _received(queries, keys) -> list[list[float]]:
    """Each key's attention summed over the window queries that see it, GQA-averaged."""
    total = keys.shape[2]
    s = _reference_column_means(queries, keys)
    return [[s[h][j] * min(WINDOW, total - j) for j in range(total)] for h in range(KV_HEADS)]


def test_h2o_in_the_cache_sums_every_querys_attention_and_carries_it_over():
    queries, keys = _random(4)
    policy = make_policy("h2o", budget_tokens=40, sinks=2, recent=6, block_tokens=1)
    cache, seen = _cache(policy, queries, keys)
    first = _received(queries, seen)
    cache.evict()
    kept = _reference_keep(first, 40, 2, 6)
    carried = [[first[h][j] for j in kept[h]] for h in range(KV_HEADS)]
    for h in range(KV_HEADS):
        assert cache.scores[0][h].tolist() == pytest.approx(carried[h], abs=1e-5)

    # a second prompt of 5 tokens: its queries' attention adds to what each kept token carries
    new_queries, new_keys = torch.randn(1, KV_HEADS * GROUP, WINDOW, HEAD_DIM), torch.randn(1, KV_HEADS, WINDOW, HEAD_DIM)
    stored_now = torch.cat([cache.hf.layers[0].keys, new_keys], dim=2)  # the kept keys, then the new
    _store(cache, stored_now)
    seen_now, _ = cache.attend(0, new_queries, stored_now, torch.zeros_like(stored_now), SCALING)
    cache.append(torch.zeros(WINDOW, dtype=torch.int8), torch.zeros(WINDOW))
    second = _received(new_queries, seen_now)
    total = [[(carried[h] + [0.0] * WINDOW)[j] + second[h][j] for j in range(45)] for h in range(KV_HEADS)]
    cache.evict()
    chosen = _reference_keep(total, 40, 2, 6)
    for h in range(KV_HEADS):
        assert cache.scores[0][h].tolist() == pytest.approx([total[h][j] for j in chosen[h]], abs=1e-5)


def test_snapkv_max_pools_column_means_over_neighbours():
    policy = make_policy("snapkv", budget_tokens=8, sinks=0, recent=1, window=2, kernel=3)
    attention = torch.zeros(KV_HEADS, GROUP, 2, 10)
    attention[:, :, :, 4] = 1.0
    scores = policy.score(Observation(KV_HEADS, 10, attention))
    assert scores[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]


# The last query's attention over 10 keys, the same for the 3 query heads of each KV head.
TOVA_ATTENTION = [
    [0.0, 0.06, 0.30, 0.25, 0.04, 0.05, 0.05, 0.05, 0.10, 0.10],
    [0.0, 0.05, 0.05, 0.05, 0.05, 0.30, 0.20, 0.10, 0.10, 0.10],
]


def test_tova_keeps_what_the_newest_token_attends_to_averaged_over_the_layers_heads():
    attention = torch.tensor(TOVA_ATTENTION)[:, None, None, :].expand(KV_HEADS, GROUP, 1, 10)
    # per layer (the paper's choice), by the mean over all heads: sink 0, recent 8 and 9, and of
    # keys 1..7 the 3 best: 2 (0.175), 5 (0.175), 3 (0.15), not 6 (0.125)
    policy = make_policy("tova", budget_tokens=6, sinks=1, recent=2)
    assert policy.window_tokens == 1
    assert policy.select(policy.score(Observation(KV_HEADS, 10, attention))).tolist() == [[0, 2, 3, 5, 8, 9]] * 2
    # per head: each KV head its own best 3
    policy = make_policy("tova", budget_tokens=6, sinks=1, recent=2, per_layer=False)
    assert policy.select(policy.score(Observation(KV_HEADS, 10, attention))).tolist() == [[0, 1, 2, 3, 8, 9], [0, 5, 6, 7, 8, 9]]


def test_tova_in_the_cache_scores_by_the_last_query_only():
    queries, keys = _random(5)
    policy = make_policy("tova", budget_tokens=24, sinks=2, recent=6, block_tokens=1)
    cache, seen = _cache(policy, queries, keys)
    cache.times[0] = torch.arange(TOTAL, dtype=torch.float32).expand(KV_HEADS, TOTAL).clone()
    mean = [0.0] * TOTAL  # the last query's softmax, averaged over all 6 query heads
    for q_head in range(KV_HEADS * GROUP):
        logits = [float(queries[0, q_head, -1] @ seen[0, q_head // GROUP, k]) * SCALING for k in range(TOTAL)]
        weights = [math.exp(x - max(logits)) for x in logits]
        for j in range(TOTAL):
            mean[j] += weights[j] / sum(weights) / (KV_HEADS * GROUP)
    expected = _reference_keep([mean], 24, 2, 6)[0]
    window_mean = [sum(row[j] for row in _reference_column_means(queries, seen)) / KV_HEADS for j in range(TOTAL)]
    assert expected != _reference_keep([window_mean], 24, 2, 6)[0]  # the whole window would choose otherwise
    cache.evict()
    assert cache.times[0].long().tolist() == [expected, expected]


KNORM_NORMS = [[5.0, 1.0, 4.0, 2.0, 3.0, 6.0, 7.0, 0.5, 8.0, 9.0], [5.0, 8.0, 0.2, 6.0, 0.3, 7.0, 0.4, 9.0, 10.0, 1.0]]


def test_knorm_keeps_the_keys_of_lowest_norm_through_the_cache():
    torch.manual_seed(6)
    directions = torch.nn.functional.normalize(torch.randn(1, KV_HEADS, 10, HEAD_DIM), dim=-1)
    keys = directions * torch.tensor(KNORM_NORMS)[None, :, :, None]
    policy = make_policy("knorm", budget_tokens=5, sinks=1, recent=1, block_tokens=1)
    cache, _ = _cache(policy, torch.randn(1, KV_HEADS * GROUP, 1, HEAD_DIM), keys)
    cache.times[0] = torch.arange(10, dtype=torch.float32).expand(KV_HEADS, 10).clone()
    cache.evict()
    # sink 0 and recent 9; of keys 1..8 the 3 of lowest norm: 7, 1, 3 in head 0; 2, 4, 6 in head 1
    assert cache.times[0].long().tolist() == [[0, 1, 3, 7, 9], [0, 2, 4, 6, 9]]


def test_blocks_of_stream_places_are_kept_or_evicted_whole_by_their_mean_score():
    """A sentence is not kept in part: tokens are ranked by their block's mean score (blocks of
    `block_tokens` stream places), so the low-scored number of a well-scored statement stays with it."""
    policy = make_policy("knorm", budget_tokens=8, sinks=0, recent=0, block_tokens=4)
    scores = torch.tensor([[5.0, 5.0, 5.0, 0.0, 0.0, 9.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]])
    places = torch.arange(16)[None]
    # block means: 3.75, 2.25, 1.0, 2.0; token by token, 5 (9.0) would be kept and 3 (0.0) evicted
    assert policy.select(scores, places=places).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # blocks are by stream place, not by index: a head holding places 0-3, 6-7 and 8-15
    held = torch.tensor([[0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0, 4.0, 0.0, 3.0, 3.0, 3.0, 3.0, 0.5, 0.5, 0.5]])
    policy = make_policy("knorm", budget_tokens=6, sinks=0, recent=0, block_tokens=4)
    # means: places 0-3: 1.0, 6-7: 2.0, 8-11: 3.0, 12-14: 0.5: blocks 8-11 and 6-7 are kept whole
    assert policy.select(scores, places=held).tolist() == [[4, 5, 6, 7, 8, 9]]
    # token by token: 4.0, the four 3.0s and, of the equal 1.0s, the newest
    assert make_policy("knorm", budget_tokens=6, sinks=0, recent=0, block_tokens=1).select(scores, places=held).tolist() == [
        [3, 4, 6, 7, 8, 9]
    ]


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_is_registered_with_validated_knobs(name):
    policy = make_policy(name, budget_tokens=512)
    assert policy.name == name
    if policy.evicts:
        with pytest.raises(ValueError):
            make_policy(name, budget_tokens=10, sinks=8, recent=8)
        with pytest.raises(ValueError):
            make_policy(name, budget_tokens=512, sinks=-1)

"""A session's KV cache, bounded by an eviction policy: append, evict, and positions by index.

Per layer, in a transformers cache: keys and values (1, kv_heads, n, head_dim). Beside them,
per KV head and token (kv_heads, n): the token's kind (TEXT or FRAME) and the video time it
came from. Each KV head may keep different tokens, but every head of every layer keeps the same
number, n.

Positions are re-encoded at every eviction: a token's position is always its index 0..n-1, so
positions never exceed the cache's peak size, whatever the stream's length. The keys are kept
as they were before the rotary embedding (each new key is turned back from its position once,
when it is stored), and the attention rotates them at their index, with the model's own rotary
embedding, at every forward. So an eviction is a gather, and however many evictions a key
lives through, what the attention sees is one rotation away from what the model computed: in
bfloat16, rotating kept keys from position to position at every eviction instead lets the
rounding build up (measured: 9% after 150 moves, 40% after 1,000).
"""

import time

import torch
from torch import nn
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.policies import Observation, Policy

TEXT, FRAME = 0, 1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotations(rotary: nn.Module, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (*positions.shape, head_dim) of the pure rotation by `positions`, with the
    model's own frequencies, in float32 (without the rotary embedding's `attention_scaling`)."""
    cos, sin = rotary(like.float(), positions.to(like.device).reshape(1, -1))
    scale = getattr(rotary, "attention_scaling", 1.0)
    shape = (*positions.shape, cos.shape[-1])
    return (cos / scale).reshape(shape), (sin / scale).reshape(shape)


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Keys (..., n, head_dim) rotated by angles whose cos and sin are (n, head_dim), times
    `scale`, computed in float32."""
    k = keys.float()
    return ((k * cos + rotate_half(k) * sin) * scale).to(keys.dtype)


class PositionTable:
    """cos and sin of positions 0, 1, 2, ... of one model, grown as needed (a few MB)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        self.scale = float(getattr(rotary, "attention_scaling", 1.0))  # the model rotates keys, then scales
        self.cos = self.sin = torch.empty(0, 0)

    def up_to(self, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, head_dim) cos and sin of positions 0..count-1, on `like`'s device."""
        if self.cos.shape[0] < count or self.cos.device != like.device:
            size = max(count, 2 * self.cos.shape[0])
            self.cos, self.sin = rotations(self.rotary, torch.arange(size), like)
        return self.cos[:count], self.sin[:count]


class _PreRopeLayer(DynamicLayer):
    """A transformers cache layer that stores keys as they were before the rotary embedding: the
    model hands it keys rotated at their positions (their indices), and it turns them back."""

    def __init__(self, table: PositionTable) -> None:
        super().__init__()
        self.table = table

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start, count = self.get_seq_length(), key_states.shape[-2]
        cos, sin = self.table.up_to(start + count, key_states)
        unrotated = rotate(key_states, cos[start:], -sin[start:], 1 / self.table.scale)  # by minus the position
        return super().update(unrotated, value_states)


class _Store(DynamicCache):
    def __init__(self, layers: list[_PreRopeLayer]) -> None:
        Cache.__init__(self, layers=layers)


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """(kv_heads, group, w, N) softmax attention of the last w tokens' queries (q_heads, w, d)
    over all N keys (kv_heads, N, d), each query seeing the keys up to its own position."""
    q_heads, window, head_dim = queries.shape
    kv_heads, total = keys.shape[:2]
    grouped = queries.float().view(kv_heads, q_heads // kv_heads, window, head_dim)
    logits = torch.einsum("hgwd,hnd->hgwn", grouped, keys.float()) * scaling
    positions = torch.arange(total - window, total, device=keys.device)
    hidden = torch.arange(total, device=keys.device)[None, :] > positions[:, None]  # (w, N)
    return logits.masked_fill(hidden, float("-inf")).softmax(dim=-1)


class KVCache:
    def __init__(
        self, policy: Policy, rotary: nn.Module, num_layers: int, kv_heads: int, evidence_window: int = 32
    ) -> None:
        self.policy = policy
        self.rotary = rotary
        self.kv_heads = kv_heads
        self.evidence_window = evidence_window
        self.positions = PositionTable(rotary)
        self.hf: DynamicCache = _Store([_PreRopeLayer(self.positions) for _ in range(num_layers)])
        self.kinds = [torch.empty(kv_heads, 0, dtype=torch.int8) for _ in range(num_layers)]
        self.times = [torch.empty(kv_heads, 0) for _ in range(num_layers)]
        self.scores: list[torch.Tensor | None] = [None] * num_layers  # (kv_heads, n) for keeps_scores
        # Since the last eviction: each layer's last queries (q_heads, w, head_dim), at most
        # `_kept_queries`, and (for policies that accumulate) the attention each key received.
        self._queries: list[torch.Tensor | None] = [None] * num_layers
        self._received: list[torch.Tensor | None] = [None] * num_layers
        self._scaling = [1.0] * num_layers
        self._kept_queries = max(policy.window_tokens if policy.needs_attention else 0, evidence_window)
        self.evictions = 0
        self.evicted_tokens = 0
        self.evict_s = 0.0
        self.max_position = -1

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    @property
    def tokens(self) -> int:
        return self.kinds[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for layer in self.hf.layers if layer.is_initialized for t in (layer.keys, layer.values)
        )

    def rotated_keys(self, layer: int) -> torch.Tensor:
        """(kv_heads, N, head_dim) the layer's keys rotated at their positions (their indices)."""
        keys = self.hf.layers[layer].keys[0]
        cos, sin = self.positions.up_to(keys.shape[1], keys)
        return rotate(keys, cos, sin, self.positions.scale)

    # -- append --------------------------------------------------------------------------------

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        """Called by the attention of `layer` while it runs c new tokens, with their queries
        (1, q_heads, c, head_dim) and every stored key (1, kv_heads, N, head_dim), theirs
        included. Keeps the last queries, and returns the keys to attend: rotated at their index."""
        cos, sin = self.positions.up_to(keys.shape[2], keys)
        keys = rotate(keys, cos, sin, self.positions.scale)
        new = queries[0].detach()
        kept = self._queries[layer]
        joined = new if kept is None else torch.cat([kept, new], dim=1)
        self._queries[layer] = joined[:, -self._kept_queries :]
        self._scaling[layer] = scaling
        if self.policy.accumulates:
            received = causal_attention(new, keys[0], scaling).sum(dim=2).mean(dim=1)  # (kv_heads, N)
            before = self._received[layer]
            if before is not None:
                received[:, : before.shape[1]] += before
            self._received[layer] = received
        return keys

    def append(self, kinds: torch.Tensor, times: torch.Tensor) -> None:
        """After the model has run c new tokens: their kinds (c,) int8 and video times (c,)."""
        count = kinds.shape[0]
        self.max_position = max(self.max_position, self.tokens + count - 1)
        new_kinds = kinds.to(torch.int8).expand(self.kv_heads, count)
        new_times = times.float().expand(self.kv_heads, count)
        for layer in range(self.num_layers):
            self.kinds[layer] = torch.cat([self.kinds[layer], new_kinds], dim=1)
            self.times[layer] = torch.cat([self.times[layer], new_times], dim=1)

    def rollback(self) -> None:
        """After a failed forward: drop whatever it appended, and what it observed."""
        for cached in self.hf.layers:
            if cached.is_initialized and cached.keys.shape[2] > self.tokens:
                cached.keys = cached.keys[:, :, : self.tokens]
                cached.values = cached.values[:, :, : self.tokens]
        self._queries = [None] * self.num_layers
        self._received = [None] * self.num_layers

    # -- evict ---------------------------------------------------------------------------------

    def evict(self) -> None:
        """Down to the policy's budget, if over it. The queries seen so far are dropped either
        way (the next prompt brings its own window); what accumulates is kept until an eviction."""
        if self.policy.evicts and self.tokens > self.policy.budget_tokens:
            started = time.perf_counter()
            removed = self.tokens - self.policy.budget_tokens
            for layer in range(self.num_layers):
                self._evict_layer(layer)
            self._received = [None] * self.num_layers
            self.evictions += 1
            self.evicted_tokens += removed
            self.evict_s += time.perf_counter() - started
        self._queries = [None] * self.num_layers

    def _evict_layer(self, layer: int) -> None:
        policy, cached = self.policy, self.hf.layers[layer]
        total = cached.keys.shape[2]
        attention = None
        if policy.needs_attention:
            queries = self._queries[layer][:, -policy.window_tokens :]
            attention = causal_attention(queries, self.rotated_keys(layer), self._scaling[layer])
        previous = None
        if policy.keeps_scores and self.scores[layer] is not None:
            kept = self.scores[layer]
            previous = torch.cat([kept, kept.new_zeros(self.kv_heads, total - kept.shape[1])], dim=1)
        scores = policy.score(Observation(self.kv_heads, total, attention, previous, self._received[layer]))
        keep = policy.select(scores)  # (kv_heads, B), ascending: the kept tokens' new positions
        index = keep.to(cached.keys.device)[None, :, :, None].expand(1, -1, -1, cached.keys.shape[-1])
        cached.keys = cached.keys.gather(2, index)
        cached.values = cached.values.gather(2, index)
        keep_cpu = keep.cpu()
        self.kinds[layer] = self.kinds[layer].gather(1, keep_cpu)
        self.times[layer] = self.times[layer].gather(1, keep_cpu)
        if policy.keeps_scores:
            self.scores[layer] = scores.float().gather(1, keep.to(scores.device))

    # -- read ----------------------------------------------------------------------------------

    def frame_attention(self) -> dict[float, float]:
        """Attention the last queries (up to `evidence_window`) paid to the frames still held,
        summed over layers, heads and queries, by the frame's video time."""
        if self._queries[0] is None:
            return {}
        mass: dict[float, float] = {}
        for layer in range(self.num_layers):
            queries = self._queries[layer][:, -self.evidence_window :]
            received = causal_attention(queries, self.rotated_keys(layer), self._scaling[layer]).sum(dim=(1, 2)).cpu()
            frames = self.kinds[layer] == FRAME
            times, weights = self.times[layer][frames], received[frames]
            unique, slot = torch.unique(times, return_inverse=True)
            per_time = torch.zeros(unique.shape[0]).index_add_(0, slot, weights)
            for t, w in zip(unique.tolist(), per_time.tolist()):
                mass[t] = mass.get(t, 0.0) + w
        return mass

    def held_per_second(self, kind: int, seconds: int) -> torch.Tensor:
        """(seconds,) tokens of `kind` still held from each second of video, averaged over the
        layers and KV heads (which may keep different tokens)."""
        counts = torch.zeros(seconds)
        for kinds, times in zip(self.kinds, self.times):
            mine = times[kinds == kind].floor().long().clamp(0, max(seconds - 1, 0))
            counts += torch.bincount(mine, minlength=seconds)[:seconds].float()
        return counts / (self.num_layers * self.kv_heads)

    def held(self, kind: int) -> float:
        """Tokens of `kind` held, averaged over layers and KV heads."""
        return sum(int((kinds == kind).sum()) for kinds in self.kinds) / (self.num_layers * self.kv_heads)

    # -- snapshot ------------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "keys": [layer.keys for layer in self.hf.layers],
            "values": [layer.values for layer in self.hf.layers],
            "kinds": self.kinds,
            "times": self.times,
            "scores": self.scores,
            "queries": self._queries,
            "received": self._received,
            "scaling": self._scaling,
            "counters": [self.evictions, self.evicted_tokens, self.evict_s, self.max_position],
        }

    def load(self, state: dict, device: torch.device) -> None:
        """A `state()` loaded on the CPU: tensors the model reads go to `device`; metadata stays."""

        def here(tensors: list) -> list:
            return [None if t is None else t.to(device) for t in tensors]

        for cached, keys, values in zip(self.hf.layers, here(state["keys"]), here(state["values"])):
            cached.lazy_initialization(keys, values)
            cached.keys, cached.values = keys, values
        self.kinds, self.times = state["kinds"], state["times"]
        self.scores, self._queries, self._received = here(state["scores"]), here(state["queries"]), here(state["received"])
        self._scaling = state["scaling"]
        self.evictions, self.evicted_tokens, self.evict_s, self.max_position = state["counters"]

"""A session's KV cache, bounded by an eviction policy: append, evict, rerotate.

Per layer, in a transformers `DynamicCache`: keys and values (1, kv_heads, n, head_dim), the
keys rotated (RoPE) at their positions. Beside them, per KV head and token (kv_heads, n): the
token's kind (TEXT or FRAME) and the video time it came from. Each KV head may keep different
tokens, but every head of every layer keeps the same number, n.

Every eviction re-encodes positions: kept tokens move to positions 0..B-1 by rotating their
keys by (new - old) with the model's own rotary embedding (rotations compose exactly). So a
token's position is always its index, and positions never exceed the cache's peak size,
whatever the stream's length.
"""

import time

import torch
from torch import nn
from transformers import DynamicCache

from engine.policies import Observation, Policy

TEXT, FRAME = 0, 1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotations(rotary: nn.Module, shifts: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (*shifts.shape, head_dim) of rotating by `shifts` positions, with the model's
    own frequencies, in float32."""
    cos, sin = rotary(like.float(), shifts.to(like.device).reshape(1, -1))
    scale = getattr(rotary, "attention_scaling", 1.0)  # applied at every rotation; must not compound
    shape = (*shifts.shape, cos.shape[-1])
    return (cos / scale).reshape(shape), (sin / scale).reshape(shape)


def rerotate(
    keys: torch.Tensor, delta: torch.Tensor, rotary: nn.Module, table: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Move rotated keys (1, kv_heads, n, head_dim) by `delta` (kv_heads, n) positions, in float32.

    `table`, when given, holds the rotations by 0, -1, -2, ... (from `rotations`), for deltas <= 0.
    """
    k = keys[0].float()  # (kv_heads, n, head_dim)
    if table is None:
        cos, sin = rotations(rotary, delta, k)
    else:
        cos, sin = table[0][-delta], table[1][-delta]
    moved = k * cos + rotate_half(k) * sin
    return moved.to(keys.dtype)[None]


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
        self.hf = DynamicCache()  # what the model reads and appends to
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
        return sum(t.numel() * t.element_size() for layer in self.hf.layers for t in (layer.keys, layer.values))

    # -- append --------------------------------------------------------------------------------

    def observe(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
        """Called by the attention of `layer` while it runs c new tokens: their queries
        (1, q_heads, c, head_dim) and every key (1, kv_heads, N, head_dim), theirs included."""
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
            if cached.keys is not None and cached.keys.shape[2] > self.tokens:
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
            table = rotations(self.rotary, -torch.arange(removed + 1), self.hf.layers[0].keys)  # deltas 0..-removed
            for layer in range(self.num_layers):
                self._evict_layer(layer, table)
            self._received = [None] * self.num_layers
            self.evictions += 1
            self.evicted_tokens += removed
            self.evict_s += time.perf_counter() - started
        self._queries = [None] * self.num_layers

    def _evict_layer(self, layer: int, table: tuple[torch.Tensor, torch.Tensor]) -> None:
        policy, cached = self.policy, self.hf.layers[layer]
        total = cached.keys.shape[2]
        attention = None
        if policy.needs_attention:
            attention = causal_attention(self._queries[layer][:, -policy.window_tokens :], cached.keys[0], self._scaling[layer])
        previous = None
        if policy.keeps_scores and self.scores[layer] is not None:
            kept = self.scores[layer]
            previous = torch.cat([kept, kept.new_zeros(self.kv_heads, total - kept.shape[1])], dim=1)
        scores = policy.score(Observation(self.kv_heads, total, attention, previous, self._received[layer]))
        keep = policy.select(scores)  # (kv_heads, B), ascending
        device = cached.keys.device
        keep_here = keep.to(device)
        index = keep_here[None, :, :, None].expand(1, -1, -1, cached.keys.shape[-1])
        delta = torch.arange(keep.shape[1], device=device) - keep_here  # new position - old, <= 0
        cached.keys = rerotate(cached.keys.gather(2, index), delta, self.rotary, table)
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
            keys = self.hf.layers[layer].keys[0]
            received = causal_attention(queries, keys, self._scaling[layer]).sum(dim=(1, 2)).cpu()  # (kv_heads, N)
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

        self.hf = DynamicCache(ddp_cache_data=list(zip(here(state["keys"]), here(state["values"]))))
        self.kinds, self.times = state["kinds"], state["times"]
        self.scores, self._queries, self._received = here(state["scores"]), here(state["queries"]), here(state["received"])
        self._scaling = state["scaling"]
        self.evictions, self.evicted_tokens, self.evict_s, self.max_position = state["counters"]

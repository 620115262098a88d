"""What every eviction policy shares: the budget, sinks and recent tokens, the attention it reads, and the selection.

A policy is a frozen dataclass of hyperparameters with one pure method, `score`. The cache
(`engine/kv_cache.py`) calls it after each prompt, once per layer, and keeps for each KV head
(or, with `per_layer`, for the whole layer) the first `sinks` tokens, the last `recent` tokens,
and the best-scored others, up to `budget_tokens`, in their original order.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class Observation:
    """What a policy sees of one layer when it must evict."""

    kv_heads: int
    total: int  # N: tokens cached now, the prompt's own included
    # (kv_heads, group, w, N) softmax attention of the prompt's last w queries over all N keys,
    # grouped by the KV head each query head reads; 0 where a query cannot see a key.
    # None when the policy does not need attention.
    attention: torch.Tensor | None = None
    # (kv_heads, N) the scores the policy returned at its last eviction for the tokens still kept,
    # 0 for the tokens added since; None before the first eviction or when it keeps no scores.
    previous: torch.Tensor | None = None
    # (kv_heads, N) the attention each key received from every query run since the last
    # eviction, summed over the queries and averaged over the query heads of its KV group.
    # None unless the policy `accumulates`.
    received: torch.Tensor | None = None
    # (kv_heads, N, head_dim) the keys as stored (before the rotary embedding); None unless the
    # policy `needs_keys`.
    keys: torch.Tensor | None = None


DEFAULT_BUDGET_TOKENS = 8192  # B when none is given (the gateway's too: streamvqa/protocol/keys.py)


@dataclass(frozen=True)
class Policy:
    budget_tokens: int = DEFAULT_BUDGET_TOKENS  # B: tokens a layer keeps after each eviction
    sinks: int = 4  # S: the first tokens, always kept (attention sinks)
    recent: int = 128  # R: the last tokens, always kept
    per_layer: bool = False  # one selection shared by the KV heads of a layer, instead of one per head
    evict_on_question: bool = False  # evict right after a question's prompt, before the answer
    # Tokens kept or evicted together: aligned runs of this many stream places, ranked by their
    # tokens' mean score, so that a sentence (a number) is not kept in part (docs/engine.md)
    block_tokens: int = 16

    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = True  # False: the cache keeps everything (`full`)
    needs_attention: ClassVar[bool] = True  # False: `score` ignores `attention`
    accumulates: ClassVar[bool] = False  # True: `score` reads `received`, summed over every query
    needs_keys: ClassVar[bool] = False  # True: `score` reads `keys`
    keeps_scores: ClassVar[bool] = False  # True: `previous` carries this policy's scores between evictions
    evicts_every_decode_step: ClassVar[bool] = False  # True: also evict after each generated token

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks and recent must be >= 0, got {self.sinks} and {self.recent}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.evicts and self.budget_tokens <= self.sinks + self.recent:
            raise ValueError(
                f"budget_tokens ({self.budget_tokens}) must exceed sinks + recent ({self.sinks} + {self.recent})"
            )

    @property
    def window_tokens(self) -> int:
        """How many of the prompt's last queries the attention in `score` comes from."""
        return 0

    def score(self, seen: Observation) -> torch.Tensor:
        """(kv_heads, N) scores of every cached token of one layer; higher is kept."""
        raise NotImplementedError

    def select(self, scores: torch.Tensor, pinned: torch.Tensor | None = None, places: torch.Tensor | None = None) -> torch.Tensor:
        """Indices (kv_heads, budget_tokens), ascending, of the tokens to keep; scores (kv_heads, N);
        `pinned` (kv_heads, N) True where a token must be kept too, like sinks and recent ones;
        `places` (kv_heads, N) each token's place in the stream, ascending, by which tokens form
        blocks (without it, each token is its own block). Among equal ranks, newer tokens first."""
        heads, total = scores.shape
        ranked = scores.float().clone()
        if self.per_layer:
            ranked = ranked.mean(dim=0, keepdim=True).expand(heads, total).clone()
        if self.block_tokens > 1 and places is not None:
            ranked = block_mean(ranked, places.to(ranked.device) // self.block_tokens)
        ranked[:, : self.sinks] = float("inf")
        ranked[:, total - self.recent :] = float("inf")
        if pinned is not None:
            ranked[pinned.to(ranked.device)] = float("inf")
        newest_first = ranked.flip(-1).sort(dim=-1, descending=True, stable=True).indices
        return (total - 1 - newest_first[:, : self.budget_tokens]).sort(dim=-1).values


def block_mean(scores: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(kv_heads, N) each token's score replaced by the mean score of the tokens of its block held
    by its KV head; blocks (kv_heads, N), each token's block number, ascending along each row."""
    heads, total = scores.shape
    run = torch.zeros_like(blocks)
    run[:, 1:] = (blocks[:, 1:] != blocks[:, :-1]).cumsum(dim=1)
    run = run + torch.arange(heads, device=run.device)[:, None] * total  # distinct across heads
    sums = torch.zeros(heads * total, device=scores.device).index_add_(0, run.flatten(), scores.flatten())
    counts = torch.zeros(heads * total, device=scores.device).index_add_(0, run.flatten(), torch.ones_like(scores).flatten())
    return (sums / counts.clamp_min(1))[run]


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """(kv_heads, group, w, N) softmax attention of the last w tokens' queries (q_heads, w, d)
    over all N keys (kv_heads, N, d), each query seeing the keys up to its own position; with
    `rows` (r,), only those of the w queries: (kv_heads, group, r, N)."""
    window = queries.shape[1]
    kv_heads, total = keys.shape[:2]
    mine = torch.arange(window, device=keys.device) if rows is None else rows.to(keys.device)
    if rows is not None:
        queries = queries[:, rows]
    q_heads, count, head_dim = queries.shape
    grouped = queries.float().view(kv_heads, q_heads // kv_heads, count, head_dim)
    logits = torch.einsum("hgwd,hnd->hgwn", grouped, keys.float()).mul_(scaling)  # in place: one buffer fewer
    # a query may not see only the keys after it, all among the window's own: mask those alone
    hidden = torch.arange(window, device=keys.device)[None, :] > mine[:, None]
    logits[..., total - window :].masked_fill_(hidden, float("-inf"))  # (r, w)
    return logits.softmax(dim=-1)


def visible_rows(window: int, total: int) -> torch.Tensor:
    """(total,) how many of the last `window` queries of a sequence of `total` tokens see each key.

    The query at position p sees the keys 0..p, so key j is seen by min(window, total - j) of them.
    """
    return (total - torch.arange(total)).clamp(max=window)


def column_mean(attention: torch.Tensor) -> torch.Tensor:
    """(kv_heads, N) mean attention each key receives from the window queries that can see it,
    averaged over the query heads of each KV group; attention (kv_heads, group, w, N)."""
    window, total = attention.shape[-2:]
    per_head = attention.float().sum(dim=-2) / visible_rows(window, total).to(attention.device)  # (kv, group, N)
    return per_head.mean(dim=1)

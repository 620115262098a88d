"""What a question borrows from the host tier and where it merges: the loan, its merge plan, and
the borrowing that follows them.

Before a question's tokens run, `begin_retrieval` reserves places in every layer of its cache
for what it borrows (as many as the tier can lend). While they run, the cache's attention of a
layer with places reserved calls `borrow`: the host tier gives the pages the question's keys
match (`HostTier.retrieve`), and `_plan` plans where they merge among the cached tokens, in
stream order, for that layer and every later one its choice serves (a `MergePlan`). The layers
move their bytes as planned (those that do not score pages at once, in the worker's pool where
they can: `_merge_ahead`) and the cache its token rows (`KVCache.lent`). Once the answer's turn is over, `give_back` removes the borrowed
tokens (the host tier still holds them; `KVCache.gave_back`); until then the cache does not
evict. The layers keep the bytes and the cache the token rows describing them; this module moves
them only through their public calls (`Borrower`: what it reads and asks of a cache).
"""

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.host_tier import SCORED_LAYERS, Cached, HostTier, Retrieval
from engine.kv_buffers import LayerStore, PositionTable
from engine.kv_pool import Lease
from engine.layout import FIELDS, GRID_COLUMN, GRID_ROW, GROUP, compact, unpack


@dataclass
class MergePlan:
    """How the layers first, first + 1, ... merge what one retrieval brought them with what they
    cache: per layer, the borrowed keys and values (kv_heads, k, head_dim), and the merged
    tokens' indices into [held, borrowed], kinds, times, places and which are borrowed
    (kv_heads, held + k)."""

    first: int
    keys: torch.Tensor
    values: torch.Tensor
    merge: torch.Tensor  # (layers, kv_heads, held + k) the merged tokens' indices into [held, borrowed]
    kinds: tuple[torch.Tensor, ...]
    times: tuple[torch.Tensor, ...]
    order: tuple[torch.Tensor, ...]
    borrowed: tuple[torch.Tensor, ...]
    layout: tuple[torch.Tensor, ...] | None = None  # with 3-D positions: (FIELDS, kv_heads, held + k), re-encoded

    def __len__(self) -> int:
        return self.merge.shape[0]


@dataclass
class Loan:
    """A cache's borrowing: the question that borrows, its last retrieval's plan, what each layer
    holds borrowed, and counts over every question (in `KVCache.state`'s order)."""

    retrievals: int = 0
    retrieved_tokens: int = 0  # per layer, over every question
    retrieve_s: float = 0.0
    retrieved_pages: int = 0  # pages the first layer's KV heads borrowed from, over every question
    recalled_seconds: set[int] = field(default_factory=set)  # whole seconds of video the last retrieval brought back
    question_tokens: int = 0  # the next run's first tokens, whose keys choose the pages
    at: int | None = None  # the stream place of the question that borrows, until given back
    plan: MergePlan | None = None  # how the layers of the question's last retrieval merge it
    borrowed: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer that merged: (kv_heads, n) True where borrowed


class Borrower(Protocol):
    """What borrowing reads of a cache (engine/kv_cache.py's `KVCache`) and asks of it."""

    hf: LayerStore
    host: HostTier | None
    lease: Lease | None
    positions: PositionTable
    loan: Loan
    appended: int
    kinds: list[torch.Tensor]
    times: list[torch.Tensor]
    order: list[torch.Tensor]

    def lent(self, layer: int, plan: MergePlan, held: int) -> None: ...
    def gave_back(self, layer: int, keep: torch.Tensor, width: int, count: int) -> None: ...


def begin_retrieval(cache: Borrower, retrieval_tokens: int, question_tokens: int) -> int:
    """Reserve places in every layer for what the cache's next tokens borrow from its host tier, as
    many as it can lend; their first `question_tokens` are the question, whose keys choose the
    pages. Returns that number (0 without a host tier or with nothing in it)."""
    if cache.host is None or retrieval_tokens <= 0:
        return 0
    loan, count = cache.loan, min(retrieval_tokens, cache.host.available())
    loan.question_tokens, loan.at, loan.plan = max(1, question_tokens), cache.appended, None
    cache.host.begin_question()
    if count:
        loan.retrievals += 1
        loan.retrieved_tokens += count
        loan.recalled_seconds = set()
        for cached in cache.hf.layers:
            cached.reserve(count)
    return count


def borrow(cache: Borrower, layer: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring in the pages of `layer` that the question's keys match, into the places reserved:
    merged among the cached tokens in stream order, before the `new` ones the forward stored, as
    planned; returns the layer's keys and values (1, kv_heads, N, head_dim). Where a layer's
    choice is also the layers' after it (`HostTier.retrieve`), their merges are planned here too,
    in one pass for all of them, and those that do not score the pages merge now."""
    started = time.perf_counter()
    cached = cache.hf.layers[layer]
    held = cached.keys.shape[2] - new  # cached before these tokens
    question = cached.keys[0, :, held : held + min(cache.loan.question_tokens, new)]  # (kv_heads, q, head_dim)
    retrieval = cache.host.retrieve(layer, question, cached.pending, Cached(cached.keys[0, :, :held], cache.order[layer]))
    plan = _plan(cache, layer, retrieval, held)
    at = layer - plan.first
    merge = plan.merge[at]
    # into [held, new, borrowed] as the layer joins them: held and borrowed in stream order, then the new
    rows = torch.cat([merge + (merge >= held) * new, torch.arange(held, held + new).expand(merge.shape[0], new)], dim=1)
    if plan.layout is not None:
        cached.layout.merge(plan.layout[at], held)
    cached.merge(plan.keys[at][None], plan.values[at][None], rows.to(cached.keys.device))
    _merged(cache, layer, plan, held)
    if retrieval is not None:
        _merge_ahead(cache, plan, held)
    cache.loan.retrieve_s += time.perf_counter() - started
    return cached.keys, cached.values


def _plan(cache: Borrower, layer: int, retrieval: Retrieval | None, held: int) -> MergePlan:
    """How `layer` merges what it borrows with the `held` tokens it caches: by the last plan,
    unless `retrieval` brought it and the layers after it pages of their own (`got`, (layers,
    kv_heads, k, ...)): then by a new one, in stream order, for all of them at once."""
    loan = cache.loan
    if retrieval is None:
        return loan.plan
    if layer == 0:
        loan.retrieved_pages += len(retrieval.pages)
    got = retrieval.tokens
    mine = range(layer, layer + got.kinds.shape[0])
    stream = torch.cat([torch.stack([cache.order[at] for at in mine]), got.order], dim=2)  # (layers, kv_heads, held + k)
    merge = stream.argsort(dim=2, stable=True)
    merged_kinds = torch.cat([torch.stack([cache.kinds[at] for at in mine]), got.kinds], dim=2).gather(2, merge)
    merged_times = torch.cat([torch.stack([cache.times[at] for at in mine]), got.times], dim=2).gather(2, merge)
    loan.recalled_seconds.update(got.times.floor().long().unique().tolist())
    rows = None
    if got.grids is not None:  # the held tokens' rows and the borrowed ones', merged and re-encoded
        rows = torch.cat([torch.stack([cache.hf.layers[at].layout.rows[:, :, :held] for at in mine], dim=1),
                          unpack(got.grids, got.order)], dim=3)  # (FIELDS, layers, kv_heads, held + k)
        rows = rows.gather(3, merge[None].expand(FIELDS, -1, -1, -1))
        rows[:GROUP] = compact(*(rows[name].flatten(0, 1) for name in (GROUP, GRID_ROW, GRID_COLUMN))).view(3, *rows.shape[1:])
        rows = rows.unbind(1)
    loan.plan = MergePlan(layer, got.keys, got.values, merge, merged_kinds.unbind(), merged_times.unbind(),
                          stream.gather(2, merge).unbind(), (merge >= held).unbind(), rows)
    return loan.plan


def _merge_ahead(cache: Borrower, plan: MergePlan, held: int) -> None:
    """Merge now what the plan's layers after the scoring ones borrow, before the forward
    reaches them (they hold `held` tokens, none of its own yet): in the pool, for all of them
    at once (`Lease.merge`, when a layer's merge fits its workspace); else a layer at a time."""
    ahead = range(max(plan.first + 1, SCORED_LAYERS), plan.first + len(plan))
    if not ahead:
        return
    layers = [cache.hf.layers[layer] for layer in ahead]
    count, first = held + plan.keys.shape[2], ahead.start - plan.first
    device = layers[0].keys.device
    lease = cache.lease if plan.layout is None else None  # with 3-D positions, a layer at a time
    if lease is not None and lease.can_merge(count) and all(c.keys.shape[2] == held and c.at_home(count) for c in layers):
        cos, sin, _ = cache.positions.between(0, count, layers[0].keys)
        lease.merge(ahead, held, plan.merge[first:].to(device), plan.keys[first:], plan.values[first:], cos, sin,
                    cache.positions.scale)
        for cached in layers:
            cached.merged(count)
    else:
        for at, cached in enumerate(layers, start=first):
            if plan.layout is not None:
                cached.layout.merge(plan.layout[at], held)
            cached.merge(plan.keys[at][None], plan.values[at][None], plan.merge[at].to(device))
    for layer in ahead:
        _merged(cache, layer, plan, held)


def _merged(cache: Borrower, layer: int, plan: MergePlan, held: int) -> None:
    """After `layer` merged what it borrows (`plan`'s) among its `held` tokens: those are lent
    now, the cache's rows follow them, and no places are left reserved."""
    cache.loan.borrowed[layer] = plan.borrowed[layer - plan.first]
    cache.lent(layer, plan, held)
    cache.hf.layers[layer].reserve(0)


def give_back(cache: Borrower) -> None:
    """The answer's turn is over: remove every borrowed token from the cache (the tier holds them)."""
    loan = cache.loan
    borrowed, loan.borrowed, loan.at, loan.plan = loan.borrowed, {}, None, None
    for layer, lent in borrowed.items():
        cached = cache.hf.layers[layer]
        count = int(lent[0].sum())
        keep = (~lent).nonzero()[:, 1].view(lent.shape[0], -1)  # (kv_heads, n - count), ascending
        width = lent.shape[1]  # the tokens after these came later than every borrowed one
        index = keep.to(cached.keys.device)[None, :, :, None].expand(1, -1, -1, cached.keys.shape[-1])
        cached.keys, cached.values = (torch.cat([stored[:, :, :width].gather(2, index), stored[:, :, width:]], dim=2)
                                      for stored in (cached.keys, cached.values))
        if cached.layout is not None:
            cached.layout.give_back(keep, width)
        cache.gave_back(layer, keep, width, count)

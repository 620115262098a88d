"""What a question borrows from the host tier and where it merges: the loan and its merge plan.

Before a question's tokens run, the cache reserves places for what it borrows (`Loan.begin`).
While they run, each layer asks the host tier for the pages the question's keys match
(`HostTier.retrieve`), and the loan plans where they merge among the cached tokens, in stream
order, for that layer and every later one its choice serves (`Loan.plan_for`). The cache moves
bytes and rows as planned (`KVCache.attend`) and, once the answer's turn is over, gives the
borrowed tokens back (`KVCache.give_back`; the host tier still holds them); until then it does
not evict.
"""

from dataclasses import dataclass, field

import torch

from engine.host_tier import Retrieval
from engine.layout import FIELDS, GRID_COLUMN, GRID_ROW, GROUP, Layout, compact, unpack


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

    def begin(self, count: int, question_tokens: int, at: int) -> int:
        """A question at stream place `at` borrows `count` tokens per layer (the most the tier
        can lend it); its first `question_tokens` choose the pages. Returns `count`."""
        self.question_tokens, self.at, self.plan = max(1, question_tokens), at, None
        if count:
            self.retrievals += 1
            self.retrieved_tokens += count
            self.recalled_seconds = set()
        return count

    def plan_for(self, layer: int, retrieval: Retrieval | None, held: int, kinds: list[torch.Tensor], times: list[torch.Tensor],
                 order: list[torch.Tensor], layouts: list[Layout | None]) -> MergePlan:
        """How `layer` merges what it borrows with the `held` tokens it caches (every layer's
        kinds, times, order (kv_heads, held) and layout): by the last plan, unless `retrieval`
        brought it and the layers after it pages of their own (`got`, (layers, kv_heads, k, ...)):
        then by a new one, in stream order, for all of them at once."""
        if retrieval is None:
            return self.plan
        if layer == 0:
            self.retrieved_pages += len(retrieval.pages)
        got = retrieval.tokens
        mine = range(layer, layer + got.kinds.shape[0])
        stream = torch.cat([torch.stack([order[at] for at in mine]), got.order], dim=2)  # (layers, kv_heads, held + k)
        merge = stream.argsort(dim=2, stable=True)
        merged_kinds = torch.cat([torch.stack([kinds[at] for at in mine]), got.kinds], dim=2).gather(2, merge)
        merged_times = torch.cat([torch.stack([times[at] for at in mine]), got.times], dim=2).gather(2, merge)
        self.recalled_seconds.update(got.times.floor().long().unique().tolist())
        rows = None
        if got.grids is not None:  # the held tokens' rows and the borrowed ones', merged and re-encoded
            rows = torch.cat([torch.stack([layouts[at].rows[:, :, :held] for at in mine], dim=1),
                              unpack(got.grids, got.order)], dim=3)  # (FIELDS, layers, kv_heads, held + k)
            rows = rows.gather(3, merge[None].expand(FIELDS, -1, -1, -1))
            rows[:GROUP] = compact(*(rows[name].flatten(0, 1) for name in (GROUP, GRID_ROW, GRID_COLUMN))).view(3, *rows.shape[1:])
            rows = rows.unbind(1)
        self.plan = MergePlan(layer, got.keys, got.values, merge, merged_kinds.unbind(), merged_times.unbind(),
                              stream.gather(2, merge).unbind(), (merge >= held).unbind(), rows)
        return self.plan

    def lent(self, layer: int, plan: MergePlan) -> None:
        """`layer` merged what `plan` brings it: those of its tokens are borrowed now."""
        self.borrowed[layer] = plan.borrowed[layer - plan.first]

    def took(self, seconds: float) -> None:
        self.retrieve_s += seconds

    def end(self) -> dict[int, torch.Tensor]:
        """The answer's turn is over: what each layer held borrowed, which the cache gives back."""
        borrowed, self.borrowed, self.at, self.plan = self.borrowed, {}, None, None
        return borrowed

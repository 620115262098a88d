from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., 2023): each token's attention from every query so far,
    accumulated, rescored and evicted after every prompt and every generated token.

    As in the paper, the budget is split evenly between the heavy hitters and the most recent
    tokens unless `recent` is given: with a short recent window, accumulated scores (which favour
    old tokens, seen by more queries) evict newer text first (docs/benchmarks.md).
    """

    recent: int | None = None  # None: half the budget

    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = False
    accumulates: ClassVar[bool] = True
    keeps_scores: ClassVar[bool] = True
    evicts_every_decode_step: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.recent is None:
            object.__setattr__(self, "recent", self.budget_tokens // 2)
        super().__post_init__()

    def score(self, seen: Observation) -> torch.Tensor:
        return seen.received if seen.previous is None else seen.received + seen.previous

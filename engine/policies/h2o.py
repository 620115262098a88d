from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., 2023): each token's attention from every query so far,
    accumulated, rescored and evicted after every prompt and every generated token."""

    name: ClassVar[str] = "h2o"
    keeps_scores: ClassVar[bool] = True
    evicts_every_decode_step: ClassVar[bool] = True

    def score(self, seen: Observation) -> torch.Tensor:
        received = seen.attention.float().sum(dim=-2).mean(dim=1)  # (kv_heads, N): summed over queries
        return received if seen.previous is None else received + seen.previous

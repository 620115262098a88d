from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., 2023): each token's attention from every query so far,
    accumulated, rescored and evicted after every prompt and every generated token."""

    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = False
    accumulates: ClassVar[bool] = True
    keeps_scores: ClassVar[bool] = True
    evicts_every_decode_step: ClassVar[bool] = True

    def score(self, seen: Observation) -> torch.Tensor:
        return seen.received if seen.previous is None else seen.received + seen.previous

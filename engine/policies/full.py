from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy


@dataclass(frozen=True)
class Full(Policy):
    """No eviction: the quality ceiling, and memory that grows with the stream."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False
    needs_attention: ClassVar[bool] = False

    def score(self, seen: Observation) -> torch.Tensor:
        raise RuntimeError("the full policy never evicts")

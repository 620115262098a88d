from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy


@dataclass(frozen=True)
class Sliding(Policy):
    """StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention
    Sinks"): the sinks and a window of the most recent tokens."""

    name: ClassVar[str] = "sliding"
    needs_attention: ClassVar[bool] = False

    def score(self, seen: Observation) -> torch.Tensor:
        return torch.arange(seen.total, dtype=torch.float32).expand(seen.kv_heads, seen.total)

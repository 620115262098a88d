from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy, column_mean


@dataclass(frozen=True)
class InfMLLM(Policy):
    """Inf-MLLM (Ning et al., 2024, "Efficient Streaming Inference of Multimodal Large Language
    Models on a Single GPU"): attention from the prompt's last `window` queries, plus a bias
    toward recent tokens.

    For a layer holding N tokens, with s_j the mean attention key j receives from the window
    queries that can see it (averaged over the query heads of its KV group):

        score_j = N * s_j + beta * j / (N - 1)

    N * s_j is 1 for a token that gets the attention of a uniform distribution, so `beta` is
    dimensionless: beta = 1 gives the newest token a bonus worth uniform attention, the oldest
    none. beta = 0 is no bias; a large beta approaches a sliding window.
    """

    window: int = 32  # L: the prompt's last queries that score the cache
    beta: float = 0.5  # weight of the recency bias

    name: ClassVar[str] = "infmllm"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")

    @property
    def window_tokens(self) -> int:
        return self.window

    def score(self, seen: Observation) -> torch.Tensor:
        total = seen.total
        received = column_mean(seen.attention)  # (kv_heads, N)
        recency = torch.arange(total, dtype=torch.float32, device=received.device) / max(total - 1, 1)
        return total * received + self.beta * recency

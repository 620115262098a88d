from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.policies.base import Observation, Policy, column_mean

BIAS_SHAPES = ("linear", "square")


@dataclass(frozen=True)
class InfMLLM(Policy):
    """Inf-MLLM (Ning et al., 2024, "Efficient Streaming Inference of Multimodal Large Language
    Models on a Single GPU"): attention from the prompt's last `window` queries, summed over
    `local_sum` neighbouring keys, plus a bias toward recent tokens.

    For a layer holding N tokens, with s_j the mean attention key j receives from the window
    queries that can see it (averaged over the query heads of its KV group), summed over the
    `local_sum` keys centred on j:

        score_j = N * s_j + beta * r_j,   r_j = j / (N - 1)  (linear)  or  (j / (N - 1))^2  (square)

    N * s_j is 1 for a token that gets the attention of a uniform distribution, so `beta` is
    dimensionless: beta = 1 gives the newest token a bonus worth uniform attention, the oldest
    none. beta = 0 is no bias; a large beta approaches a sliding window.
    """

    # Defaults chosen by bench.quality (docs/benchmarks.md).
    window: int = 32  # L: the prompt's last queries that score the cache
    beta: float = 0.5  # weight of the recency bias
    bias_shape: str = "linear"  # how the bias grows with position: linear or square
    local_sum: int = 5  # keys summed around each one (odd); 1 scores each key alone

    name: ClassVar[str] = "infmllm"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.bias_shape not in BIAS_SHAPES:
            raise ValueError(f"bias_shape must be one of {', '.join(BIAS_SHAPES)}, got {self.bias_shape!r}")
        if self.local_sum < 1 or self.local_sum % 2 == 0:
            raise ValueError(f"local_sum must be odd and >= 1, got {self.local_sum}")

    @property
    def window_tokens(self) -> int:
        return self.window

    def score(self, seen: Observation) -> torch.Tensor:
        total = seen.total
        received = column_mean(seen.attention)  # (kv_heads, N)
        if self.local_sum > 1:
            received = F.avg_pool1d(received[:, None], self.local_sum, 1, self.local_sum // 2, count_include_pad=True)[:, 0]
            received = received * self.local_sum
        position = torch.arange(total, dtype=torch.float32, device=received.device) / max(total - 1, 1)
        recency = position if self.bias_shape == "linear" else position.square()
        return total * received + self.beta * recency

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.policies.base import Observation, Policy, column_mean


@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV (Li et al., 2024): attention from an observation window at the end of the prompt,
    max-pooled along the keys so that neighbours of important tokens are kept too."""

    window: int = 32  # observation window: the prompt's last queries
    kernel: int = 7  # pooling width along the keys (odd)

    name: ClassVar[str] = "snapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd and >= 1, got {self.kernel}")

    @property
    def window_tokens(self) -> int:
        return self.window

    def score(self, seen: Observation) -> torch.Tensor:
        received = column_mean(seen.attention)  # (kv_heads, N)
        return F.max_pool1d(received[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy


@dataclass(frozen=True)
class KNorm(Policy):
    """KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression"): keys of low L2 norm draw high attention, so the tokens with the smallest key
    norms are kept. No attention is needed; the norm is the same before and after the rotary
    embedding (a rotation)."""

    name: ClassVar[str] = "knorm"
    needs_attention: ClassVar[bool] = False
    needs_keys: ClassVar[bool] = True

    def score(self, seen: Observation) -> torch.Tensor:
        return -seen.keys.float().norm(dim=-1)  # (kv_heads, N)

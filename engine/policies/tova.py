from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import Observation, Policy, column_mean


@dataclass(frozen=True)
class TOVA(Policy):
    """TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): the attention of the newest
    token alone, averaged over the heads of a layer, which all keep the same tokens; evicted
    after every prompt and every generated token.

    The paper adds tokens one at a time and drops the least attended when over the limit; here
    a prompt of several tokens is scored by its last one's attention (as kvpress's TOVA press
    does), and the sinks and recent tokens every policy keeps are kept too.
    """

    per_layer: bool = True  # the paper's choice: one selection for all heads of a layer

    name: ClassVar[str] = "tova"
    evicts_every_decode_step: ClassVar[bool] = True

    @property
    def window_tokens(self) -> int:
        return 1

    def score(self, seen: Observation) -> torch.Tensor:
        return column_mean(seen.attention)  # (kv_heads, N): the last query's attention, over each group's heads

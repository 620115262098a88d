"""A low-rank adapter on the language model's attention (LoRA: Hu et al., 2021, arXiv 2106.09685),
trained with the projector so that SmolLM2 learns to look up what a stream showed, not only to
read visual tokens as words.

Each adapted linear layer `W` (out, in) becomes `W + b a`, `a` (rank, in) and `b` (out, rank),
with `b` starting at zero: a new adapter leaves the model as it was. It is exported as those two
matrices (engine/demo/model.py merges them into SmolLM2 when the model loads).
"""

import math

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # each decoder layer's attention projections


class LowRankLinear(nn.Module):
    """`base(x) + (x a^T) b^T`, computed through the rank (no full-size weight gradient)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.uniform_(self.a, -1 / math.sqrt(base.in_features), 1 / math.sqrt(base.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.to(x.dtype).T) @ self.b.to(x.dtype).T


class Adapter:
    """The adapter of every layer's attention projections, put into `lm` (a decoder whose
    `layers[i].self_attn` holds TARGETS) in place of them until `remove()`; a new one replaces
    one that is there."""

    def __init__(self, lm: nn.Module, rank: int) -> None:
        if rank < 1:
            raise ValueError(f"an adapter's rank is at least 1 (got {rank})")
        self.rank = rank
        self.modules: dict[str, LowRankLinear] = {}  # by the adapted layer's name in `lm`
        for index, layer in enumerate(lm.layers):
            for target in TARGETS:
                base = getattr(layer.self_attn, target)
                wrapped = LowRankLinear(base.base if isinstance(base, LowRankLinear) else base, rank)
                setattr(layer.self_attn, target, wrapped)
                self.modules[f"layers.{index}.self_attn.{target}"] = wrapped
        self.lm = lm

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules.values() for p in (module.a, module.b)]

    def state(self) -> dict[str, torch.Tensor]:
        """`{name}.a` and `{name}.b` of every adapted layer, detached copies."""
        return {f"{name}.{part}": getattr(module, part).detach().clone()
                for name, module in self.modules.items() for part in ("a", "b")}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != {f"{name}.{part}" for name in self.modules for part in ("a", "b")}:
            raise ValueError(f"the adapter's layers or rank differ from this one's (rank {self.rank} on {', '.join(TARGETS)})")
        with torch.no_grad():
            for key, tensor in state.items():
                name, part = key.rsplit(".", 1)
                parameter = getattr(self.modules[name], part)
                if parameter.shape != tensor.shape:
                    raise ValueError(f"{key}: {tuple(tensor.shape)}, this adapter's is {tuple(parameter.shape)} (rank {self.rank})")
                parameter.copy_(tensor)

    def remove(self) -> None:
        """Put the original layers back (the model as it was before the adapter)."""
        for name, module in self.modules.items():
            layer, target = name.rsplit(".", 1)
            setattr(self.lm.get_submodule(layer), target, module.base)

"""The floating-point type a model runs in: float32, or bfloat16 where the hardware multiplies it.

bfloat16 halves the bytes of every weight, key and value, and on a CUDA GPU it is the faster
type. On a CPU it is a trade (docs/benchmarks.md, "bfloat16 on a CPU with AMX"): on an Intel
Xeon with AMX, 32 sessions deciding together in one engine step run 1.4 times float32's tokens a
second in process, but one session runs 0.88 times float32's speed there, and through the
service 0.63 times at one session and 1.03 times at 32. So `auto` is bfloat16 on a GPU and
float32 on a CPU, whose start line says when bfloat16 is there to be chosen (`DTYPE=bfloat16`).
"""

from dataclasses import dataclass

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class Numerics:
    dtype: torch.dtype
    reason: str  # why: said at start

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(setting: str, device: str) -> Numerics:
    """The dtype for `setting` (`auto`, `float32`, `bfloat16`) on `device` (`cpu`, `cuda`, `cuda:1`...)."""
    if setting not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting != "auto":
        return Numerics(DTYPES[setting], "set")
    if device.startswith("cuda"):
        return Numerics(torch.bfloat16, "a CUDA GPU")
    if torch.cpu._is_amx_tile_supported():
        return Numerics(torch.float32, "a CPU; it has AMX: DTYPE=bfloat16 answers many sessions at once faster, one slower")
    return Numerics(torch.float32, "a CPU")


def cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` with its floating parameters and buffers in `dtype`, but the rotary frequencies
    (`inv_freq`) kept as they were: rounded to bfloat16 they would shift every position's angle."""
    kept = {name: buffer.clone() for name, buffer in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, buffer in kept.items():
        owner, _, attribute = name.rpartition(".")
        module.get_submodule(owner)._buffers[attribute] = buffer  # the same buffer slot, so persistence is kept
    return module


class PackedLinear(nn.Module):
    """An `nn.Linear` in bfloat16 on a CPU, its weight laid out once for oneDNN's matrix kernels.

    A plain bfloat16 product converts the weight's layout on every call; laid out once, a
    576 x 1536 product of one row takes 35 µs instead of 77 on an AMX Xeon, faster than
    float32's 44, and 32 rows 56 µs instead of 91 (docs/benchmarks.md). The plain weight goes:
    the packed one is the only copy, and nothing reads it but `forward`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def packs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model in `dtype` on `device` runs its linear layers packed: bfloat16 on a CPU
    whose torch has oneDNN."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(module: nn.Module) -> int:
    """Every bfloat16 `nn.Linear` in `module` replaced by a `PackedLinear`, in place; how many."""
    swapped = 0
    for name, child in list(module.named_modules()):
        for attribute, linear in list(child.named_children()):
            if type(linear) is nn.Linear and linear.weight.dtype == torch.bfloat16:
                setattr(child, attribute, PackedLinear(linear))
                swapped += 1
    return swapped


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

"""The floating-point type a model runs in: float32, or bfloat16 where the hardware multiplies it.

bfloat16 halves the bytes of every weight, key and value; where the processor multiplies it
natively (a CUDA GPU, an Intel CPU with AMX tiles) a step's matrix products also run faster, and
stay nearly flat as sessions join a batch. Where it is emulated (a CPU with AVX-512 BF16 alone)
it may be slower than float32, so `auto` times one product of each there, once, and keeps the
faster; elsewhere float32.
"""

import time
from dataclasses import dataclass

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHOICES = ("auto", *DTYPES)
PROBE_SHAPE = (32, 1024, 1024)  # rows (a batch of decode tokens) x in x out: a language model's linear layer
PROBE_REPEATS = 8
PROBE_MARGIN = 0.8  # bfloat16 is chosen where it takes at most this share of float32's time


@dataclass(frozen=True)
class Numerics:
    dtype: torch.dtype
    reason: str  # why: said at start and in the model list

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose(setting: str, device: str) -> Numerics:
    """The dtype for `setting` (`auto`, `float32`, `bfloat16`) on `device` (`cpu`, `cuda`, `cuda:1`...)."""
    if setting not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting != "auto":
        return Numerics(DTYPES[setting], "set")
    if device.startswith("cuda"):
        return Numerics(torch.bfloat16, "a CUDA GPU")
    if torch.cpu._is_amx_tile_supported():
        return Numerics(torch.bfloat16, "a CPU with AMX")
    if torch.cpu._is_avx512_bf16_supported():
        bf16_s, f32_s = product_s(torch.bfloat16), product_s(torch.float32)
        chosen = torch.bfloat16 if bf16_s <= PROBE_MARGIN * f32_s else torch.float32
        return Numerics(chosen, f"a CPU with AVX-512 BF16 and no AMX: bfloat16 {bf16_s * 1e3:.2f} ms, float32 {f32_s * 1e3:.2f} ms a product")
    return Numerics(torch.float32, "a CPU without bfloat16 instructions")


def product_s(dtype: torch.dtype) -> float:
    """The best time of PROBE_REPEATS matrix products of PROBE_SHAPE in `dtype`, on the CPU."""
    rows, inner, out = PROBE_SHAPE
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, out, dtype=dtype)
    best = float("inf")
    with torch.inference_mode():
        a @ b  # the first call picks its kernel
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    return best


def cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` with its floating parameters and buffers in `dtype`, but the rotary frequencies
    (`inv_freq`) kept as they were: rounded to bfloat16 they would shift every position's angle."""
    kept = {name: buffer.clone() for name, buffer in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, buffer in kept.items():
        owner, _, attribute = name.rpartition(".")
        module.get_submodule(owner)._buffers[attribute] = buffer  # the same buffer slot, so persistence is kept
    return module

"""The floating-point type a model runs in: float32, or bfloat16 where the hardware multiplies it.

bfloat16 halves the bytes of every weight, key and value, and on a CUDA GPU it is the faster
type. On a CPU it is faster where the processor multiplies bfloat16 itself (AMX, or AVX-512
BF16) and the linear layers' weights are laid out once for oneDNN (`PackedLinear`): on an Intel
Xeon with AMX, one session's decode step 1.1 times float32's tokens a second and 32 sessions in
one step 1.6 times (docs/benchmarks.md, "bfloat16 on a CPU with AMX"); on an AMD EPYC with
AVX-512 BF16 and no AMX, 2.3 and 1.6 times. So `auto` is bfloat16 on a GPU and on a CPU with
AMX; on a CPU with AVX-512 BF16 but no AMX it times 1 row and 16 rows through a packed bfloat16
layer and a float32 one at start, and takes bfloat16 only where neither is slower (neither one
session nor a full step may slow down); elsewhere float32.
"""

import functools
import time
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
    if not (packs(torch.bfloat16, device) and torch.cpu._is_avx512_bf16_supported()):
        return Numerics(torch.float32, "a CPU without bfloat16 arithmetic (AMX or AVX-512 BF16)")
    if torch.cpu._is_amx_tile_supported():
        return Numerics(torch.bfloat16, "a CPU with AMX")
    times = {rows: products(rows) for rows in TIMED_ROWS}  # rows: (float32 µs, packed bfloat16 µs)
    timed = ", ".join(f"{rows} {'row' if rows == 1 else 'rows'} {packed} µs in packed bfloat16 and {plain} in float32"
                      for rows, (plain, packed) in times.items())
    faster = all(packed <= plain for plain, packed in times.values())
    return Numerics(torch.bfloat16 if faster else torch.float32, f"a CPU with AVX-512 BF16 and no AMX: through a layer, {timed}")


TIMED_ROWS = (1, 16)  # one session decoding, and a full step of sessions (the worker's BATCH_SESSIONS)


def products(rows: int, width: int = 1024, repeats: int = 50) -> tuple[int, int]:
    """Whole microseconds of `rows` rows through a `width` x `width` layer, in float32 and in
    packed bfloat16: the fastest of `repeats` each, on one thread (so that a busy moment, or a
    thread of the team waiting for a core, does not decide: the question is the arithmetic)."""
    layer, x = nn.Linear(width, width, bias=False), torch.randn(rows, width)
    weight = layer.weight.detach().clone()
    packed, half = PackedLinear.of(layer.to(torch.bfloat16)), x.to(torch.bfloat16)
    times, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for run in (lambda: torch.nn.functional.linear(x, weight), lambda: packed(half)):
                run()
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - started)
                times.append(round(best * 1e6))
    finally:
        torch.set_num_threads(threads)
    return times[0], times[1]


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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


# Linear layers of one module that read the same input (the model's code calls each with one
# tensor): run as one product of their weights stacked. SmolLM2-135M's 30 decoder layers, an AMX
# Xeon, 2 threads: at 32 rows 7 packed products a layer 23.4-27.1 ms, fused into 4 21.0-25.0 ms;
# at one row the same within noise (`python -m bench.pool linears`, docs/benchmarks.md). The model's
# forwards run on one thread (the worker's engine thread), so a product's memo is never shared.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Shared:
    """One product for sibling layers: the first of them called with an input computes every
    sibling's output from it; each takes its own columns, once. Called with another input (or
    twice with one), a sibling computes the product again, so any order of calls is right."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
        self.product = PackedLinear(torch.cat([linear.weight.detach() for linear in linears]), bias)
        self.widths = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._waiting: set[int] = set()  # the siblings that have not yet taken their output of `_input`

    def output(self, sibling: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or sibling not in self._waiting:
            self._outputs = self.product(x).split(self.widths, dim=-1)
            self._input, self._waiting = x, set(range(len(self.widths)))
        self._waiting.discard(sibling)
        output = self._outputs[sibling]
        if not self._waiting:  # hold nothing between forwards
            self._input, self._outputs = None, ()
        return output


class SharedLinear(nn.Module):
    """A linear layer computed in one product with its siblings (`SIBLINGS`): its columns of it."""

    def __init__(self, shared: _Shared, sibling: int, in_features: int) -> None:
        super().__init__()
        self.shared, self.sibling = shared, sibling
        self.in_features, self.out_features = in_features, shared.widths[sibling]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(self.sibling, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed with its siblings"


def packs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model in `dtype` on `device` runs its linear layers packed: bfloat16 on a CPU
    that oneDNN lays bfloat16 weights out for."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_packs_bfloat16()


@functools.cache
def cpu_packs_bfloat16() -> bool:
    """Whether torch's oneDNN packs a bfloat16 weight on this CPU: it needs AVX-512 (BW, VL, DQ)
    or AVX-NE-CONVERT. On an AVX2-only CPU a bfloat16 model keeps plain layers: faster than
    float32 for one session, 2.2 times as slow for 32 in a step (docs/benchmarks.md), so `auto`
    keeps float32 there."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        return False
    return True


def pack_linears(module: nn.Module) -> None:
    """Every bfloat16 `nn.Linear` in `module` replaced, in place: sibling layers (`SIBLINGS`) of
    one input by `SharedLinear`s of one packed product, the others each by a `PackedLinear`."""
    for owner in list(module.modules()):
        plain = {name: child for name, child in owner.named_children()
                 if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16}
        for names in SIBLINGS:
            group = [name for name in names if name in plain]
            linears = [plain[name] for name in group]
            if len(group) < 2 or len({linear.in_features for linear in linears}) > 1 or len({linear.bias is None for linear in linears}) > 1:
                continue
            shared = _Shared(linears)
            for sibling, name in enumerate(group):
                setattr(owner, name, SharedLinear(shared, sibling, linears[sibling].in_features))
                del plain[name]
        for name, linear in plain.items():
            setattr(owner, name, PackedLinear.of(linear))

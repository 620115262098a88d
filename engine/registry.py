"""The built-in models by name, and `load_model`: a built-in one, or a transformers checkpoint.

Here rather than in engine/model.py because the demo model builds on that module: the registry
imports both, and neither imports the other back."""

from collections.abc import Callable
from pathlib import Path

import torch

from engine import tiny
from engine.converted import ConvertedWeights
from engine.demo import NAME as DEMO
from engine.demo.model import load_demo
from engine.model import SMOLLM2, Model, _smollm2, _tiny, load_pretrained, resolve_device
from engine.numerics import cast, pack_linears, packs

# Loadable without a download: name -> loader(device, converted weights folder or None).
BUILTIN_MODELS: dict[str, Callable[[str, ConvertedWeights | None], Model]] = {
    "tiny-random-llava": _tiny(tiny.tiny_llava, "tiny-random-llava", "llava"),
    "tiny-random-llava-next-video": _tiny(tiny.tiny_llava_next_video, "tiny-random-llava-next-video", "llava_next_video"),
    "tiny-random-llava-onevision": _tiny(tiny.tiny_llava_onevision, "tiny-random-llava-onevision", "llava_onevision"),
    "tiny-random-qwen2-5-vl": _tiny(tiny.tiny_qwen2_5_vl, "tiny-random-qwen2-5-vl", "qwen2_5_vl", tiny.QWEN_PREPROCESSOR),
    "tiny-random-qwen3-vl": _tiny(tiny.tiny_qwen3_vl, "tiny-random-qwen3-vl", "qwen3_vl", tiny.QWEN3_PREPROCESSOR),
    "tiny-random-llama": _tiny(tiny.tiny_llama, "tiny-random-llama", None),
    SMOLLM2: _smollm2,
    DEMO: load_demo,
}


def load_model(name: str, device: str = "auto", converted_dir: Path | None = None, dtype: torch.dtype | None = None) -> Model:
    """A built-in model by name, or a transformers checkpoint by hub id or local path.

    `converted_dir` keeps built-in models converted from GGUF once converted (engine/converted.py);
    None converts them on every load. `dtype`: what the model computes and caches in
    (engine/numerics.py); None: a checkpoint's bfloat16 on a GPU, else float32, and a built-in
    model's float32. A bfloat16 model on a CPU has its linear layers packed (`pack_linears`: siblings of one input in one
    product)."""
    device = resolve_device(device)
    if name in BUILTIN_MODELS:
        model = BUILTIN_MODELS[name](device, ConvertedWeights(converted_dir) if converted_dir else None)
        if dtype is not None and dtype != model.dtype:
            cast(model.hf, dtype)
    else:
        model = load_pretrained(name, device, dtype, builtins=sorted(BUILTIN_MODELS))
    if packs(model.dtype, device):
        pack_linears(model.hf)
    return model

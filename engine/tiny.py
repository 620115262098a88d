"""Tiny models with random weights, built in code: one per LLaVA family, and a text-only Llama.

They run every path of the real model families in milliseconds and need no download. Weights
are random but fixed by a seed, so answers are meaningless yet reproducible. Each family's
frames become 16 visual tokens: 64x64 pixels in 16x16 patches (LLaVA), or in 8x8 patches pooled
2x2 (LLaVA-NeXT-Video, average; LLaVA-OneVision, bilinear). Their context is 32,768 tokens, as
Qwen2's.

The Qwen2.5-VL and Qwen3-VL models see frames as Qwen's own do: in pairs (a temporal patch of
2), resized to multiples of 28 (32) pixels within their bounds (at most 112x112, 128x128 here), in
patches of 14 (16) merged 2x2, so a pair of square frames becomes 4x4 = 16 visual tokens; their
language models place tokens in 3-D (engine/layout.py).
"""

from collections.abc import Callable

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextVideoConfig,
    LlavaNextVideoForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    SiglipVisionConfig,
)

IM_START, IM_END, IMAGE, VIDEO = "<|im_start|>", "<|im_end|>", "<image>", "<video>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIZE = 64


def ascii_tokenizer(specials: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline, `<unk>` for anything else, plus
    ChatML, image and video specials (and `specials`). Random weights then answer in visibly random, printable text."""
    chars = ["<unk>", "\n"] + [chr(code) for code in range(32, 127)]
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([IM_START, IM_END, IMAGE, VIDEO, *specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token=IM_END, pad_token=IM_END)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _text_config(cls: type, tokenizer: PreTrainedTokenizerFast, layers: int = 2, **extra: object):
    return cls(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32768, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **extra,
    )


def _vision_config(cls: type, patch_size: int):
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
               patch_size=patch_size)


def _seeded(build: Callable[[], PreTrainedModel], seed: int) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def tiny_llava(seed: int = 0, layers: int = 2) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """LLaVA: CLIP vision tower, Llama language model (of `layers` layers)."""
    tokenizer = ascii_tokenizer()
    config = LlavaConfig(
        vision_config=_vision_config(CLIPVisionConfig, patch_size=16),
        text_config=_text_config(LlamaConfig, tokenizer, layers),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return _seeded(lambda: LlavaForConditionalGeneration(config), seed), tokenizer


def tiny_llava_next_video(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """LLaVA-NeXT-Video: CLIP vision tower, 2x2 average pooling, Llama language model."""
    tokenizer = ascii_tokenizer()
    config = LlavaNextVideoConfig(
        vision_config=_vision_config(CLIPVisionConfig, patch_size=8),
        text_config=_text_config(LlamaConfig, tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        video_token_index=tokenizer.convert_tokens_to_ids(VIDEO),
        spatial_pool_mode="average",
        spatial_pool_stride=2,
    )
    return _seeded(lambda: LlavaNextVideoForConditionalGeneration(config), seed), tokenizer


def tiny_llava_onevision(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """LLaVA-OneVision: SigLIP vision tower, Qwen2 language model, bilinear pooling to half the grid."""
    tokenizer = ascii_tokenizer()
    config = LlavaOnevisionConfig(
        vision_config=_vision_config(SiglipVisionConfig, patch_size=8),
        text_config=_text_config(Qwen2Config, tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        video_token_index=tokenizer.convert_tokens_to_ids(VIDEO),
    )
    return _seeded(lambda: LlavaOnevisionForConditionalGeneration(config), seed), tokenizer


QWEN_PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}  # frames of at most 4x4 merged patches
QWEN3_PREPROCESSOR = {"size": {"shortest_edge": 2 * 64 * 64, "longest_edge": 2 * 128 * 128}}  # a pair's pixels: 4x4 merged patches at most


def _tiny_qwen(config_class: type, model_class: type, vision: dict, seed: int, **text: object):
    """A Qwen model of `config_class` and `model_class` over the ASCII tokenizer with Qwen's vision
    markers: `vision` its vision tower's fields, `text` its language model's beyond the tiny ones."""
    tokenizer = ascii_tokenizer((VISION_START, VISION_END))
    ids = tokenizer.convert_tokens_to_ids
    config = config_class(
        text_config=_text_config(dict, tokenizer, bos_token_id=None, **text),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, **vision},
        image_token_id=ids(IMAGE),
        video_token_id=ids(VIDEO),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
    )
    return _seeded(lambda: model_class(config), seed), tokenizer


def tiny_qwen2_5_vl(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Qwen2.5-VL: its windowed vision tower (patches of 14, 2x2 merge, temporal patch 2) and its
    language model with 3-D rotary positions in sections of (time, height, width)."""
    vision = {"depth": 2, "patch_size": 14, "tokens_per_second": 2, "window_size": 56, "fullatt_block_indexes": [1]}
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
    return _tiny_qwen(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, vision, seed, rope_parameters=rope)


def tiny_qwen3_vl(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Qwen3-VL: its vision tower (patches of 16, 2x2 merge, temporal patch 2, deep-stack features
    added to the language model's first layers) and 3-D rotary positions with interleaved sections."""
    vision = {"depth": 3, "patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    return _tiny_qwen(Qwen3VLConfig, Qwen3VLForConditionalGeneration, vision, seed, head_dim=16, rope_parameters=rope)


def tiny_llama(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A text-only Llama, for streams of text."""
    tokenizer = ascii_tokenizer()
    config = _text_config(LlamaConfig, tokenizer)
    return _seeded(lambda: LlamaForCausalLM(config), seed), tokenizer

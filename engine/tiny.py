"""A tiny LLaVA (CLIP vision tower + Llama language model) with random weights, built in code.

It exercises every path of the real model family in milliseconds and needs no download. Its
weights are random but fixed by a seed, so its answers are meaningless yet reproducible.
"""

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

IM_START, IM_END, IMAGE = "<|im_start|>", "<|im_end|>", "<image>"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline, `<unk>` for anything else, plus
    ChatML and image specials. Random weights then answer in visibly random, printable text."""
    chars = ["<unk>", "\n"] + [chr(code) for code in range(32, 127)]
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([IM_START, IM_END, IMAGE])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token=IM_END, pad_token=IM_END
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llava(seed: int = 0) -> tuple[LlavaForConditionalGeneration, PreTrainedTokenizerFast]:
    """64x64 frames in 16x16 patches: 16 visual tokens per frame; 2 layers of width 64."""
    tokenizer = ascii_tokenizer()
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=16,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    return model.eval(), tokenizer

"""LLaVA-family models behind the few calls a session makes, and the table of loadable models."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, LlavaForConditionalGeneration, PreTrainedTokenizerBase

from engine import tiny
from engine.frames import to_pixels

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ChatFormat:
    """The strings that open and close turns; frames stream into an open user turn."""

    system_start: str
    user_start: str
    assistant_start: str
    turn_end: str


CHATML = ChatFormat("<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n")


class UnknownModelError(ValueError):
    pass


class VisionLanguageModel:
    """A loaded LLaVA-family model: vision tower, projector and language model, on one device."""

    def __init__(
        self,
        name: str,
        model: LlavaForConditionalGeneration,
        tokenizer: PreTrainedTokenizerBase,
        chat: ChatFormat,
        image_mean: Sequence[float] = CLIP_MEAN,
        image_std: Sequence[float] = CLIP_STD,
        device: str = "cpu",
    ) -> None:
        self.name = name
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.chat = chat
        self.image_size: int = model.config.vision_config.image_size
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.stop_ids = frozenset(i for i in (tokenizer.eos_token_id,) if i is not None)

    def tokenize(self, text: str, *, user: bool = False) -> list[int]:
        """Token ids of `text`; user text never produces special tokens (no turn injection)."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=user)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.inference_mode()
    def embed_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        """(1, c, hidden) input embeddings of token ids."""
        ids_t = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings()(ids_t)

    @torch.inference_mode()
    def encode_frames(self, frames: Sequence[np.ndarray]) -> torch.Tensor:
        """(N, tokens_per_frame, hidden) visual tokens of N RGB uint8 frames."""
        pixels = to_pixels(frames, self.image_size, self.image_mean, self.image_std)
        pixels = pixels.to(self.device, self.model.dtype)
        cfg = self.model.config
        out = self.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        )
        return torch.stack(list(out.pooler_output))

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Run (1, c, hidden) embeddings after the cache's tokens; returns the last position's logits (vocab,)."""
        out = self.model(inputs_embeds=embeds, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]


def _tiny_random_llava(device: str) -> VisionLanguageModel:
    model, tokenizer = tiny.tiny_llava(seed=0)
    return VisionLanguageModel("tiny-random-llava", model, tokenizer, CHATML, device=device)


# Built-in models, loadable without a download.
BUILTIN_MODELS: dict[str, Callable[[str], VisionLanguageModel]] = {
    "tiny-random-llava": _tiny_random_llava,
}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(name: str, device: str = "auto") -> VisionLanguageModel:
    try:
        build = BUILTIN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None
    return build(resolve_device(device))

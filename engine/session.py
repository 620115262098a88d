"""A streaming video question-answering session over one model and one KV cache.

The token stream the cache holds, for a chat model:

    <system turn> <user> [0.0s]<frame tokens>\n [1.0s]<frame tokens>\n ... question <end>
    <assistant> answer <end> <user> [2.0s]<frame tokens>\n ...

Frames stream into an open user turn; a question closes it and the answer stays in the cache as
conversation.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from engine.model import VisionLanguageModel

POLICIES = ("full",)
DEFAULT_SYSTEM_PROMPT = (
    "You watch a video stream. Frames arrive in order, each after its time in seconds. "
    "Answer questions about what you have seen, briefly."
)


@dataclass(frozen=True)
class SessionConfig:
    policy: str = "full"  # the cache policy; `full` keeps every token
    budget_tokens: int = 8192  # cache budget for evicting policies
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {', '.join(POLICIES)}")
        if self.budget_tokens < 1:
            raise ValueError(f"budget_tokens must be positive, got {self.budget_tokens}")


@dataclass(frozen=True)
class SessionStats:
    frames: int  # frames appended so far
    video_time_s: float  # video time of the last frame appended
    tokens_seen: int  # every token ever run through the model
    cache_tokens: int  # tokens the KV cache holds now
    cache_bytes: int  # bytes of keys and values held now


class Session:
    def __init__(self, model: VisionLanguageModel, config: SessionConfig | None = None) -> None:
        self.model = model
        self.config = config or SessionConfig()
        self._cache = DynamicCache()
        self._frames = 0
        self._video_time_s = 0.0
        self._tokens_seen = 0
        self._user_turn_open = False
        chat = model.chat
        self._extend(self._embed(chat.system_start + self.config.system_prompt + chat.turn_end))

    def append_frames(self, frames: Sequence[np.ndarray], times_s: Sequence[float]) -> None:
        """Append RGB uint8 frames (H, W, 3) taken at non-decreasing video times."""
        if len(frames) != len(times_s):
            raise ValueError(f"{len(frames)} frames but {len(times_s)} times")
        if not frames:
            return
        previous = self._video_time_s if self._frames else float("-inf")
        for t in times_s:
            if t < previous:
                raise ValueError(f"frame times must not decrease: {t} after {previous}")
            previous = t
        visual = self.model.encode_frames(frames)  # (N, tokens_per_frame, hidden)
        parts = [self._open_user_turn()]
        for tokens, t in zip(visual, times_s, strict=True):
            parts += [self._embed(f"[{t:.1f}s]"), tokens[None], self._embed("\n")]
        self._extend(torch.cat(parts, dim=1))
        self._frames += len(frames)
        self._video_time_s = float(times_s[-1])

    def ask(self, question: str, max_new_tokens: int = 64) -> Iterator[str]:
        """Answer by greedy generation, yielding one piece of text per generated token.

        A piece is empty while the token leaves a character incomplete (or decodes to nothing);
        a character still incomplete when generation stops is dropped. The question and the
        answer stay in the cache. Drain the iterator: closing it early still ends the turn,
        but the answer is cut short.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        chat, model = self.model.chat, self.model
        prompt = torch.cat(
            [
                self._open_user_turn(),
                model.embed_tokens(model.tokenize(question, user=True)),
                self._embed(chat.turn_end + chat.assistant_start),
            ],
            dim=1,
        )
        self._user_turn_open = False
        logits = self._extend(prompt)
        answer_ids: list[int] = []
        unfed: list[int] = []  # the sampled id not yet run through the model
        emitted = ""
        try:
            while len(answer_ids) < max_new_tokens:
                token = int(logits.argmax())
                if token in model.stop_ids:
                    break
                answer_ids.append(token)
                text = model.detokenize(answer_ids)
                complete = not text.endswith("\ufffd")  # else a UTF-8 character is still partial
                piece = text[len(emitted) :] if complete else ""
                emitted += piece
                unfed = [token]
                yield piece
                if len(answer_ids) < max_new_tokens:
                    logits = self._extend(model.embed_tokens(unfed))
                    unfed = []
        finally:
            self._extend(torch.cat([model.embed_tokens(unfed), self._embed(chat.turn_end)], dim=1))

    def stats(self) -> SessionStats:
        cache_bytes = sum(
            t.numel() * t.element_size()
            for layer in self._cache.layers
            for t in (layer.keys, layer.values)
            if t is not None and t.numel()
        )
        return SessionStats(
            frames=self._frames,
            video_time_s=self._video_time_s,
            tokens_seen=self._tokens_seen,
            cache_tokens=self._cache.get_seq_length(),
            cache_bytes=cache_bytes,
        )

    def _open_user_turn(self) -> torch.Tensor:
        """Embeddings that open a user turn, or none when one is open; marks it open."""
        opener = "" if self._user_turn_open else self.model.chat.user_start
        self._user_turn_open = True
        return self._embed(opener)

    def _embed(self, text: str) -> torch.Tensor:
        return self.model.embed_tokens(self.model.tokenize(text))

    def _extend(self, embeds: torch.Tensor) -> torch.Tensor:
        """Run (1, c, hidden) embeddings into the cache; returns the last logits (vocab,)."""
        self._tokens_seen += embeds.shape[1]
        return self.model.prefill(embeds, self._cache)

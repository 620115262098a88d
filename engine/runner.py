"""Every forward of the engine: the new tokens of one or more sessions, each after its own cache.

The prompts of a run are packed into one sequence, one session after another, each at its own
positions (after its cache's tokens, and after the places a question reserved for what it
borrows): every linear layer of the model (most of its time and all of its weights' reads) runs
once for all of them, and each attention layer attends each session's tokens to that session's
cache alone, through the one attention seam (`engine/attention.py`): their keys stored (turned
back from their positions), their queries kept for the next eviction, the cache's keys read
rotated at their positions, borrowed pages brought in. No padding, and no mask over other
sessions' tokens: caches of any lengths pack together. A session alone is a run of one.

A prompt longer than its `chunk_tokens` runs in chunks, the same alone and together: each
forward takes the next chunk of every prompt not yet done. Nothing is evicted here (each session
evicts after its prompt, `engine/step.py`). If a forward fails, every cache of the run is left
as it was before the run (the chunks that had run are taken out again) and the error is raised.

Greedy answers are the same alone and together (the attention is the same sums; a batched
matrix product may round its last bits differently, far below a choice's margin).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import attention
from engine.kv_cache import KVCache
from engine.model import Model


@dataclass(frozen=True)
class Prompt:
    """One session's tokens to run after its cache's."""

    cache: KVCache
    embeds: torch.Tensor  # (1, c, hidden)
    kinds: torch.Tensor  # (c,) int8: TEXT or FRAME
    times: torch.Tensor  # (c,) video time of each token
    chunk_tokens: int  # the most of its tokens in one forward
    targets: torch.Tensor | None = None  # (c,) the prompt's own token ids, to score
    before: torch.Tensor | None = None  # (vocab,) the logits after the cache's last token (they predict targets[0])

    @property
    def tokens(self) -> int:
        return self.embeds.shape[1]


@dataclass(frozen=True)
class Ran:
    logits: torch.Tensor | None  # (vocab,) after the prompt's last token (an inference tensor: clone to keep)
    nll: float  # with targets: their summed negative log-likelihood (nats) given everything before; else 0


@dataclass(frozen=True)
class _Segment:
    cache: KVCache
    start: int  # the session's tokens in the packed sequence: [start, end)
    end: int


class _Packed:
    """The attention of a packed forward: each segment's tokens against its own cache."""

    def __init__(self, segments: list[_Segment]) -> None:
        self.segments = segments
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}  # (group, new, total) -> mask, the same in every layer

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        layer, outputs = module.layer_idx, []
        for segment in self.segments:
            new = slice(segment.start, segment.end)
            queries = query[:, :, new]  # (1, q_heads, c, head_dim)
            keys, values = segment.cache.hf.layers[layer].update(key[:, :, new], value[:, :, new])
            keys, values = segment.cache.attend(layer, queries, keys, values, module.scaling)  # (1, kv_heads, N, head_dim)
            outputs.append(self._attend(queries, keys, values, module.scaling))  # (1, c, q_heads, head_dim)
        return torch.cat(outputs, dim=1)

    def _attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        """(1, c, q_heads, head_dim) the c new tokens' queries (1, q_heads, c, head_dim) over the N
        keys and values (1, kv_heads, N, head_dim), the last c of them their own. The query heads
        that share a KV head are one longer run of queries over it (transformers' q heads g *
        group .. (g + 1) * group - 1 read KV head g), so no key or value is copied per query head."""
        _, q_heads, count, dim = queries.shape
        kv_heads, total = keys.shape[1], keys.shape[2]
        group = q_heads // kv_heads
        grouped = queries.reshape(1, kv_heads, group * count, dim)
        mask = self._mask(group, count, total, queries)
        output = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
        return output.view(1, q_heads, count, dim).transpose(1, 2)

    def _mask(self, group: int, count: int, total: int, like: torch.Tensor) -> torch.Tensor | None:
        """(group * c, N) added to the attention's logits: each new token sees the cache and the
        new tokens up to itself (0), not those after it (-inf), in each of the `group` runs of
        queries; in `like`'s dtype, made once for every layer (SDPA would turn a boolean mask
        into this at every call). None for one token."""
        if count == 1:
            return None
        if (group, count, total) not in self._masks:
            hidden = torch.ones(count, total, dtype=torch.bool, device=like.device).triu(total - count + 1)
            mask = torch.zeros(count, total, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))
            self._masks[group, count, total] = mask.repeat(group, 1)
        return self._masks[group, count, total]


def run(model: Model, prompts: Sequence[Prompt]) -> list[Ran]:
    """Run each prompt after its cache's tokens (the caches distinct, of one model), in chunks;
    per prompt, the logits after its last token and, with targets, their score."""
    starts = [prompt.cache.appended for prompt in prompts]
    done = [0] * len(prompts)
    logits = [prompt.before for prompt in prompts]
    nll = [0.0] * len(prompts)
    try:
        while True:
            chunks = [
                (i, slice(done[i], min(done[i] + prompt.chunk_tokens, prompt.tokens)))
                for i, prompt in enumerate(prompts)
                if done[i] < prompt.tokens
            ]
            if not chunks:
                break
            outputs = _forward(model, [(prompts[i], chunk) for i, chunk in chunks])
            for (i, chunk), out in zip(chunks, outputs, strict=True):
                prompt = prompts[i]
                prompt.cache.append(prompt.kinds[chunk], prompt.times[chunk])
                if prompt.targets is not None:  # token j is predicted by the logits after token j - 1
                    if logits[i] is None:
                        predicted, wanted = out[:-1], prompt.targets[chunk.start + 1 : chunk.stop]
                    else:
                        predicted, wanted = torch.cat([logits[i][None], out[:-1]]), prompt.targets[chunk]
                    nll[i] += float(F.cross_entropy(predicted.float(), wanted.to(predicted.device), reduction="sum"))
                    out = out[-1]
                logits[i] = out
                done[i] = chunk.stop
    except BaseException:
        for prompt, start in zip(prompts, starts, strict=True):
            prompt.cache.rollback(start)
        raise
    return [Ran(last, score) for last, score in zip(logits, nll, strict=True)]


def _forward(model: Model, chunks: list[tuple[Prompt, slice]]) -> list[torch.Tensor]:
    """One forward of every chunk; per chunk, the logits after its last token (vocab,), or after
    each of its tokens (c, vocab) when its prompt is scored."""
    segments, positions, keep, start = [], [], [], 0
    for prompt, chunk in chunks:
        count, held = chunk.stop - chunk.start, prompt.cache.hf.get_seq_length()
        segments.append(_Segment(prompt.cache, start, start + count))
        positions.append(torch.arange(held, held + count))
        keep.append(torch.arange(start, start + count) if prompt.targets is not None else torch.tensor([start + count - 1]))
        start += count
    embeds = torch.cat([prompt.embeds[:, chunk] for prompt, chunk in chunks], dim=1)  # (1, T, hidden)
    with attention.running(_Packed(segments)), torch.inference_mode():
        out = model.hf(
            inputs_embeds=embeds,
            position_ids=torch.cat(positions)[None].to(model.device),
            use_cache=False,
            logits_to_keep=torch.cat(keep).to(model.device),
        )
    logits = out.logits[0].split([len(k) for k in keep])
    return [rows if prompt.targets is not None else rows[0] for (prompt, _), rows in zip(chunks, logits, strict=True)]

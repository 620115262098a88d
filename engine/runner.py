"""Every forward of the engine: the new tokens of one or more sessions, each after its own cache.

The prompts of a run are packed into one sequence, one session after another, each at its own
positions (after its cache's tokens, and after the places a question reserved for what it
borrows): every linear layer of the model runs once for all of them, and each attention layer
attends each session's tokens to that session's cache alone, through the one attention seam
(`engine/attention.py`). No padding, and no mask over other sessions' tokens: caches of any
lengths pack together, and a session alone is a run of one. The sessions whose caches lease
from one KV pool are written and attended there together (`engine/pool_attention.py`); the
others each through its own cache, in the same forward. With 3-D positions (Qwen2.5-VL,
Qwen3-VL) a prompt carries its layout (`engine/layout.py`), and its cache is told what to keep
of its tokens before each forward.

A prompt that does not `keep` its tokens (a watch's check, a probe) runs whole in one forward,
read only: its tokens attend its cache's keys and values and their own, and its cache stores
nothing of them, sees none of their queries, appends nothing and moves no position (it is
attended through its cache's own buffers, never in a pool).

A prompt longer than its `chunk_tokens` runs in chunks, the same alone and together. Nothing is
evicted here (each session evicts after its prompt, `engine/step.py`). If a forward fails, every
cache of the run is left as it was before the run and the error is raised. Greedy answers are
the same alone and together (a batched matrix product may round its last bits differently, far
below a choice's margin).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import attention, layout, pool_attention
from engine.evidence import Observed
from engine.kv_buffers import outside_inference
from engine.kv_cache import FRAME, KVCache
from engine.model import Model
from engine.pool_attention import CausalMasks, Member, PoolStep


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
    layout: torch.Tensor | None = None  # (c, 3) with 3-D positions: the prompt's layout (`engine/layout.py`)
    deepstack: torch.Tensor | None = None  # (v, hidden * D) Qwen3-VL's deep-stack features of its v FRAME tokens, in order
    keep: bool = True  # False: read only, in one forward; nothing of it stays in the cache (a check)
    observed: Observed | None = None  # read only: what its last queries pay the cache's frames is written here

    @property
    def tokens(self) -> int:
        return self.embeds.shape[1]

    @property
    def chunk(self) -> int:
        """The most of its tokens in one forward."""
        return self.chunk_tokens if self.keep else self.tokens


@dataclass(frozen=True)
class Ran:
    logits: torch.Tensor | None  # (vocab,) after the prompt's last token (an inference tensor: clone to keep)
    nll: float  # with targets: their summed negative log-likelihood (nats) given everything before; else 0


@dataclass(frozen=True)
class _Segment:
    cache: KVCache
    start: int  # the session's tokens in the packed sequence: [start, end)
    end: int
    keep: bool = True  # False: attended beside the cache, which keeps nothing of them
    observed: Observed | None = None  # read only: what its queries pay the cache's frames is written here (a probe's)


class _Packed:
    """The attention of a packed forward: each segment's tokens against its own cache; those of
    the caches in one pool (`pooled`) written and attended there together, the others each
    through its cache's own buffers."""

    def __init__(self, alone: list[_Segment], pooled: PoolStep | None, masks: CausalMasks) -> None:
        self.alone = alone
        self.pooled = pooled
        self.masks = masks

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        layer, (_, q_heads, total, dim) = module.layer_idx, query.shape
        out = query.new_empty(1, total, q_heads, dim)
        if self.pooled is not None:
            self.pooled.write(layer, key, value)
            self.pooled.attend(layer, query, module.scaling, out)
        for segment in self.alone:
            new = slice(segment.start, segment.end)
            queries = query[:, :, new]  # (1, q_heads, c, head_dim)
            if segment.keep:
                keys, values = segment.cache.hf.layers[layer].update(key[:, :, new], value[:, :, new])
                keys, values = segment.cache.attend(layer, queries, keys, values, module.scaling)  # (1, kv_heads, N, head_dim)
            else:
                keys, values = _beside(segment.cache, layer, key[:, :, new], value[:, :, new])
                if segment.observed is not None:
                    segment.observed.add(segment.cache, layer, queries[0], keys[0], module.scaling)
            mask = self.masks.get(q_heads // keys.shape[1], segment.end - segment.start, keys.shape[2], query)
            out[:, new] = pool_attention.attend(queries, keys, values, module.scaling, mask)
        return out


def _beside(cache: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (1, kv_heads, N + c, head_dim) a read-only prompt's c tokens attend:
    the cache's (its keys rotated at their positions), then their own (`key`, `value`, rotated
    at the positions after the cache's by the model): copies, of which the cache keeps nothing."""
    cached = cache.hf.layers[layer]
    with outside_inference():  # the cache's rotated copy is brought up to date, as its next forward would
        held = cached.rotated()
    return torch.cat([held, key], dim=2), torch.cat([cached.values, value], dim=2)


def run(model: Model, prompts: Sequence[Prompt]) -> list[Ran]:
    """Run each prompt after its cache's tokens (the caches distinct, of one model), in chunks;
    per prompt, the logits after its last token and, with targets, their score."""
    starts = [prompt.cache.appended for prompt in prompts]
    placed = [_placed(prompt) for prompt in prompts]
    done = [0] * len(prompts)
    logits = [prompt.before for prompt in prompts]
    nll = [0.0] * len(prompts)
    try:
        while True:
            chunks = [
                (i, slice(done[i], min(done[i] + prompt.chunk, prompt.tokens)))
                for i, prompt in enumerate(prompts)
                if done[i] < prompt.tokens
            ]
            if not chunks:
                break
            outputs = _forward(model, [(prompts[i], chunk, placed[i]) for i, chunk in chunks])
            for (i, chunk), out in zip(chunks, outputs, strict=True):
                prompt = prompts[i]
                if prompt.keep:
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
            if prompt.keep:
                prompt.cache.rollback(start)
        raise
    return [Ran(last, score) for last, score in zip(logits, nll, strict=True)]


def _placed(prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor] | None:
    """With 3-D positions: the prompt's tokens' positions (3, c) after its cache, and what the
    cache keeps of them (layout.FIELDS, c) (`layout.arriving`)."""
    if prompt.layout is None:
        return None
    return layout.arriving(prompt.layout, prompt.cache.next_position(), prompt.cache.appended)


def _forward(model: Model, chunks: list[tuple[Prompt, slice, tuple[torch.Tensor, torch.Tensor] | None]]) -> list[torch.Tensor]:
    """One forward of every chunk; per chunk, the logits after its last token (vocab,), or after
    each of its tokens (c, vocab) when its prompt is scored."""
    segments, positions, keep, start = [], [], [], 0
    for prompt, chunk, placed in chunks:
        count, held = chunk.stop - chunk.start, prompt.cache.hf.get_seq_length()
        segments.append(_Segment(prompt.cache, start, start + count, prompt.keep, prompt.observed))
        if placed is None:
            positions.append(torch.arange(held, held + count).expand(model.position_axes, -1))
        else:
            positions.append(placed[0][:, chunk])
            if prompt.keep:
                prompt.cache.arriving(placed[1][:, chunk])
        keep.append(torch.arange(start, start + count) if prompt.targets is not None else torch.tensor([start + count - 1]))
        start += count
    embeds = torch.cat([prompt.embeds[:, chunk] for prompt, chunk, _ in chunks], dim=1)  # (1, T, hidden)
    pooled, alone = _in_pool(segments)
    masks = CausalMasks()
    step = PoolStep(pooled, model.hf.config.get_text_config().num_attention_heads, embeds, masks) if pooled else None
    ids = torch.cat(positions, dim=1).to(model.device)  # (axes, T)
    visual, deepstack = _deepstack(chunks)
    with attention.running(_Packed(alone, step, masks)), torch.inference_mode():
        out = model.forward(
            embeds,
            ids if model.position_axes == 1 else ids[:, None],  # (1, T), or (3, 1, T) in 3-D
            torch.cat(keep).to(model.device),
            None if visual is None else visual.to(model.device),
            None if deepstack is None else deepstack.to(model.device, embeds.dtype),
        )
    if step is not None:
        step.stored()
    logits = out[0].split([len(k) for k in keep])
    return [rows if prompt.targets is not None else rows[0] for (prompt, _, _), rows in zip(chunks, logits, strict=True)]


def _deepstack(chunks: list[tuple[Prompt, slice, object]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which of the forward's tokens are visual (T,) and their deep-stack features in order (V,
    hidden * D), where the chunks hold any; else None and None."""
    if all(prompt.deepstack is None for prompt, _, _ in chunks):
        return None, None
    masks, rows = [], []
    for prompt, chunk, _ in chunks:
        frames = prompt.kinds == FRAME
        masks.append(frames[chunk])
        if prompt.deepstack is not None:
            first = int(frames[: chunk.start].sum())
            rows.append(prompt.deepstack[first : first + int(frames[chunk].sum())])
    visual = torch.cat(masks)
    return (visual, torch.cat(rows)) if rows and visual.any() else (None, None)


def _in_pool(segments: list[_Segment]) -> tuple[list[Member], list[_Segment]]:
    """The segments whose caches write and attend in one pool together (those of the pool most
    of them lease from, that keep their tokens and can: `KVCache.in_pool`), and the others."""
    able = [s for s in segments if s.keep and s.cache.lease is not None and s.cache.in_pool(s.end - s.start)]
    if not able:
        return [], segments
    pools = [s.cache.lease.pool for s in able]
    pool = max(pools, key=pools.count)
    members = [s for s in able if s.cache.lease.pool is pool]
    return [Member(s.cache, s.start, s.end - s.start) for s in members], [s for s in segments if s not in members]

"""Work of several sessions of one model in one forward: a token of each answer, or frames.

The sessions' new tokens are packed into one sequence, one session after another, each at its
own positions (after its own cache's tokens): every linear layer of the model (most of its
time and all of its weights' reads) runs once for all of them, and each attention layer
attends each session's tokens to that session's cache alone (`attention.packing`), with the
same steps as a session run alone: its keys stored, its queries kept for the next eviction,
its keys read rotated at their positions. Eviction stays per session, after the forward. No
padding and no mask over other sessions' tokens: caches of any lengths pack together.

Greedy answers are the same as each session's alone (the attention is the same sums; a
batched matrix product may round its last bits differently, far below a choice's margin).
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine import attention
from engine.kv_cache import KVCache
from engine.answer import Answer
from engine.session import Part, Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Segment:
    cache: KVCache
    start: int  # the session's tokens in the packed sequence: [start, end)
    end: int


class _Packing:
    """The attention of a packed forward: each segment's tokens against its own cache."""

    def __init__(self, segments: list[_Segment]) -> None:
        self.segments = segments

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        layer, outputs = module.layer_idx, []
        kwargs.pop("is_causal", None)
        for segment in self.segments:
            new = slice(segment.start, segment.end)
            queries = query[:, :, new]  # (1, q_heads, c, head_dim)
            keys, values = segment.cache.hf.layers[layer].update(key[:, :, new], value[:, :, new])
            keys, values = segment.cache.attend(layer, queries, keys, values, module.scaling)
            count, total = queries.shape[2], keys.shape[2]
            mask = None
            if count > 1:  # each new token sees the cache and the new tokens up to itself
                mask = torch.ones(count, total, dtype=torch.bool, device=keys.device).tril(total - count)[None, None]
            output, _ = sdpa_attention_forward(module, queries, keys, values, mask, is_causal=False, **kwargs)
            outputs.append(output)  # (1, c, q_heads, head_dim)
        return torch.cat(outputs, dim=1)


def run_together(prompts: Sequence[tuple[Session, list[Part]]]) -> None:
    """Run each session's prompt after its cache's tokens, all in one forward; afterwards each
    session's `logits` are those after its prompt. The sessions are distinct and of one model;
    nothing is evicted. If the forward fails, every session is left as it was before."""
    model = prompts[0][0].model
    inputs = [session._inputs(parts) for session, parts in prompts]
    segments, positions, start = [], [], 0
    for (session, _), (embeds, _, _) in zip(prompts, inputs, strict=True):
        count, held = embeds.shape[1], session.cache.hf.get_seq_length()
        segments.append(_Segment(session.cache, start, start + count))
        positions.append(torch.arange(held, held + count))
        start += count
    embeds = torch.cat([embeds for embeds, _, _ in inputs], dim=1)  # (1, T, hidden)
    last = torch.tensor([segment.end - 1 for segment in segments], device=model.device)
    try:
        with attention.packing(_Packing(segments)), torch.inference_mode():  # the forward alone, as `Model.forward`
            out = model.hf(
                inputs_embeds=embeds,
                position_ids=torch.cat(positions)[None].to(model.device),
                use_cache=False,
                logits_to_keep=last,
            )
    except BaseException:
        for session, _ in prompts:
            session.cache.rollback()
        raise
    for (session, _), (_, kinds, times), logits in zip(prompts, inputs, out.logits[0], strict=True):
        session._ran(kinds, times, logits)


def first_pieces(answers: Sequence[Answer]) -> list[str | None | Exception]:
    """The first piece of each answer not yet begun, their questions run as one forward (of
    distinct sessions of one model); an answer whose question could not run gives the
    exception, and is over."""
    prompts = [(answer, answer.begin()) for answer in answers]
    prompts = [(answer, prompt) for answer, prompt in prompts if prompt is not None]
    failed: Exception | None = None
    if len(prompts) > 1:
        try:
            run_together([(answer.session, prompt) for answer, prompt in prompts])
        except Exception as err:  # every session is as it was
            failed = err
    elif prompts:
        answer, prompt = prompts[0]
        try:
            answer.session._run(prompt)
        except Exception as err:
            failed = err
    if failed is not None:
        for answer, _ in prompts:
            answer.failed()
        return [failed] * len(answers)
    for answer, _ in prompts:
        answer.question_ran()
    return next_pieces(answers)


def next_pieces(answers: Sequence[Answer]) -> list[str | None | Exception]:
    """The next piece of each answer (None once it is over), their next tokens run as one
    forward; an answer that failed gives its exception, and the others go on. The answers are
    of distinct sessions of one model."""
    ready = [answer for answer in answers if answer.next_ids is not None]
    if len(ready) > 1:
        try:
            run_together([(answer.session, [answer.session._part(answer.next_ids)]) for answer in ready])
        except Exception:  # every session is as it was: each answer runs its token alone below
            log.exception("a batched step failed; its answers go on one at a time")
        else:
            for answer in ready:
                answer.fed(answer.session.logits)
    pieces: list[str | None | Exception] = []
    for answer in answers:
        try:
            pieces.append(next(answer, None))
        except Exception as err:
            pieces.append(err)
    return pieces


def append_frames_together(work: Sequence[tuple[Session, Sequence[np.ndarray], Sequence[float]]]) -> list[Exception | None]:
    """`append_frames` of several sessions of one model: their frames encoded together, then
    each round of prompts (one per session, `frames_per_prompt` frames each) run as one
    forward. Per session, None or what its `append_frames` would have raised (a session that
    fails takes no more of its frames; the others go on)."""
    errors: list[Exception | None] = [None] * len(work)
    queues: dict[int, list[tuple[list[Part], list[float]]]] = {}
    by_pool: dict[int | None, list[int]] = {}
    for index, (session, frames, times) in enumerate(work):
        try:
            if session._check_frames(frames, times):
                by_pool.setdefault(session.config.pool, []).append(index)
        except Exception as err:
            errors[index] = err
    for pool, indices in by_pool.items():
        model = work[indices[0]][0].model
        visual = model.encode_frames([frame for i in indices for frame in work[i][1]], pool)  # (N, tokens_per_frame, hidden)
        offset = 0
        for i in indices:
            count = len(work[i][1])
            queues[i] = work[i][0]._frame_prompts(visual[offset : offset + count], work[i][2])
            offset += count
    while queues:
        round_: list[tuple[int, list[Part], list[float]]] = []
        for i in list(queues):
            parts, times = queues[i].pop(0)
            if not queues[i]:
                del queues[i]
            try:
                work[i][0]._make_frame_room(parts, times)
            except Exception as err:
                errors[i] = err
                queues.pop(i, None)
                continue
            round_.append((i, parts, times))
        if not round_:
            continue
        try:
            if len(round_) == 1:
                i, parts, _ = round_[0]
                work[i][0]._run(parts)
            else:
                run_together([(work[i][0], parts) for i, parts, _ in round_])
        except Exception as err:  # every session of the round is as it was
            for i, _, _ in round_:
                errors[i] = err
                queues.pop(i, None)
            continue
        for i, _, times in round_:
            work[i][0]._appended_frames(times)
    return errors

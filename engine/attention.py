"""The attention function of every model the engine runs: PyTorch's SDPA, with the cache in the loop.

Registered with transformers as "streamvqa". While a forward runs inside `observing(cache)`,
each attention layer hands its queries (after RoPE) and the cache's keys to the cache, which
keeps the last queries to score its tokens at the next eviction and returns the keys rotated
at their positions, and the values (with tokens borrowed from the host tier merged in, when
a question asked for them). Inside `packing(packed)`, one forward runs the tokens of several
sessions one after the other in one sequence (`engine/batch.py`): the model builds no mask,
and each layer's attention is the packed object's, which attends each session's tokens to
its own cache. Outside both, it is plain SDPA.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "streamvqa"


class QueryObserver(Protocol):
    def attend(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Given the rotated queries (1, q_heads, c, head_dim) of the c tokens being run and the
        cache's keys and values (1, kv_heads, N, head_dim), theirs included, returns the keys
        and values to attend (N may grow by borrowed tokens, which the mask already counts)."""


class Packed(Protocol):
    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        """Given the queries, keys and values (1, heads, T, head_dim) of the T tokens of a packed
        forward (after RoPE, at each token's own position), returns the attention's output
        (1, T, q_heads, head_dim)."""


_observer: ContextVar[QueryObserver | None] = ContextVar("streamvqa_observer", default=None)
_packed: ContextVar[Packed | None] = ContextVar("streamvqa_packed", default=None)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    packed = _packed.get()
    if packed is not None:
        return packed.attention(module, query, key, value, **kwargs), None
    observer = _observer.get()
    if observer is not None:
        key, value = observer.attend(module.layer_idx, query, key, value, module.scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _mask(*args, **kwargs) -> torch.Tensor | None:
    """SDPA's mask, but none for a packed forward (its attention masks each session itself)."""
    return None if _packed.get() is not None else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, _mask)


@contextmanager
def observing(observer: QueryObserver) -> Iterator[None]:
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


@contextmanager
def packing(packed: Packed) -> Iterator[None]:
    token = _packed.set(packed)
    try:
        yield
    finally:
        _packed.reset(token)

"""The attention function of every model the engine runs: PyTorch's SDPA, with the cache in the loop.

Registered with transformers as "streamvqa". While a forward runs inside `observing(cache)`,
each attention layer hands its queries (after RoPE) and the cache's keys to the cache, which
keeps the last queries to score its tokens at the next eviction and returns the keys rotated
at their positions, and the values (with tokens borrowed from the host tier merged in, when
a question asked for them). Outside `observing`, it is plain SDPA.
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


_observer: ContextVar[QueryObserver | None] = ContextVar("streamvqa_observer", default=None)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    observer = _observer.get()
    if observer is not None:
        key, value = observer.attend(module.layer_idx, query, key, value, module.scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def observing(observer: QueryObserver) -> Iterator[None]:
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)

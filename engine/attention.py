"""The attention function of every model the engine runs: the one seam between a forward and the caches.

Registered with transformers as "streamvqa". While a forward runs inside `running(batch)`
(`engine/runner.py`, the only code that runs the model over a cache), the model builds no mask
and each layer's attention is the batch's: it attends each session's new tokens to that
session's cache. Outside it (a forward with no cache, as in tests), it is plain SDPA.
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


class Batch(Protocol):
    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        """Given the queries, keys and values (1, heads, T, head_dim) of the T tokens of a packed
        forward (after RoPE, at each token's own position), returns the attention's output
        (1, T, q_heads, head_dim)."""


_batch: ContextVar[Batch | None] = ContextVar("streamvqa_batch", default=None)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    batch = _batch.get()
    if batch is not None:
        return batch.attention(module, query, key, value, **kwargs), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _mask(*args, **kwargs) -> torch.Tensor | None:
    """SDPA's mask, but none for a batch's forward (its attention masks each session itself)."""
    return None if _batch.get() is not None else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, _mask)


@contextmanager
def running(batch: Batch) -> Iterator[None]:
    token = _batch.set(batch)
    try:
        yield
    finally:
        _batch.reset(token)

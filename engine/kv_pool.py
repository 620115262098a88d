"""One worker's memory for every session's cache: allocated once, in pages, leased by sessions.

The pool is one tensor (3, layers, kv_heads, pages * page_tokens, head_dim): keys as stored
(before the rotary embedding), values, and the keys rotated at their indices (the copy the
attention reads), for every layer, in pages of `page_tokens` token slots. A session leases a
run of consecutive pages (first fit, `engine/page_runs.py`) big enough for the most tokens its
cache holds at once, when it opens; each of its layers' keys, values and rotated keys is then a
view of its pages (1, kv_heads, tokens, head_dim), read in place, and nothing is allocated
while it streams. The lease goes back when the session ends (`Lease.release`, or when the lease
is collected). On a CPU the pool takes memory as its pages are first written and gives a run's
back with it (`engine/resident.py`); on a GPU it is taken whole at start, as vLLM takes its KV
cache. The host tiers' pages are in a pool of their own (`host`, `engine/host_pool.py`).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kv_buffers import outside_inference, rotate
from engine.page_runs import PageRuns, PoolFull, Run
from engine.resident import give_back

if TYPE_CHECKING:
    from engine.host_pool import HostPool

KEYS, VALUES, ROTATED = 0, 1, 2  # the pool's first index: what a slot holds
MERGE_WORKSPACE_BYTES = 8 << 20  # `Lease.merge` moves as many layers at a time as this holds (`can_merge`: one at least)


__all__ = ["KEYS", "MERGE_WORKSPACE_BYTES", "ROTATED", "VALUES", "KVPool", "Lease", "PoolFull", "page_bytes"]


@dataclass(eq=False)
class Lease(Run):
    """A session's run of pages: slots first_page * page_tokens .. + pages * page_tokens - 1."""

    pool: "KVPool"
    finite_tokens: int = 0  # its first slots known to hold numbers (written, or zeroed by `clean`)

    def clean(self, held: int, tokens: int) -> None:
        """Make sure the first `tokens` slots hold numbers, of every part and layer: those past
        the cache's `held` tokens that nothing wrote since the lease began are zeroed. The
        attention of several sessions at once (`engine/pool_attention.py`) reads past a cache's
        tokens, masked, and a masked NaN left there by an earlier tensor would still spread."""
        page = self.pool.page_tokens
        start = self.first_page * page
        since = max(self.finite_tokens, held)
        if tokens > since:  # up to a whole page, so that a growing cache zeroes once a page, not at every token
            tokens = min(-(-tokens // page) * page, self.tokens)
            self.pool.storage[:, :, :, start + since : start + tokens].zero_()
        self.finite_tokens = max(self.finite_tokens, tokens)

    @property
    def tokens(self) -> int:
        return self.pages * self.pool.page_tokens

    def rows(self, part: int, layer: int) -> torch.Tensor:
        """(1, kv_heads, tokens, head_dim) this lease's slots of keys, values or rotated keys of `layer`."""
        start = self.first_page * self.pool.page_tokens
        return self.pool.storage[part, layer, :, start : start + self.tokens][None]

    def can_merge(self, count: int) -> bool:
        """Whether `merge` can move a layer's `count` tokens through its workspace at once."""
        _, _, heads, _, dim = self.pool.storage.shape
        return 2 * heads * count * dim * self.pool.storage.element_size() <= MERGE_WORKSPACE_BYTES

    def merge(
        self, layers: range, held: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, scale: float,
    ) -> None:
        """Layers `layers` hold instead, per KV head, the tokens at `rows` (layers, kv_heads, n) of
        [the `held` tokens in their slots, then `keys` and `values` (layers, kv_heads, k,
        head_dim)], and the merged keys rotated at their indices into the copy (by `cos` and
        `sin` (n, head_dim) and `scale`, as `rotate` takes them): what a borrowing does to the
        layers it reaches before the forward does, for many layers in a few copies instead of a
        few dozen small ones per layer. (The callers' `PreRopeLayer.merged` then hold them.)"""
        storage = self.pool.storage
        _, depth, heads, total, dim = storage.shape
        start, count, borrowed = self.first_page * self.pool.page_tokens, rows.shape[-1], keys.shape[2]
        per_layer = 2 * heads * count  # rows of keys and values a layer merges
        group = MERGE_WORKSPACE_BYTES // (per_layer * dim * storage.element_size())  # at least 1: `can_merge`
        workspace = self.pool.workspace(min(group, len(layers)) * per_layer)
        flat, device = storage.view(-1, dim), rows.device
        for first in range(layers.start, layers.stop, group):
            span = slice(first, min(first + group, layers.stop))
            at = slice(span.start - layers.start, span.stop - layers.start)
            tail, slots = slice(start + held, start + held + borrowed), slice(start, start + count)
            storage[KEYS, span, :, tail] = keys[at]
            storage[VALUES, span, :, tail] = values[at]
            # each (part, layer, head)'s first slot in the flat storage, (2, layers, heads, 1); then the rows it takes
            part = torch.tensor([KEYS, VALUES], device=device)[:, None] * depth + torch.arange(span.start, span.stop, device=device)
            base = ((part[:, :, None] * heads + torch.arange(heads, device=device)) * total + start)[..., None]
            taken = workspace[: (span.stop - span.start) * per_layer]
            merged = torch.index_select(flat, 0, (base + rows[at]).flatten(), out=taken)
            storage[KEYS : VALUES + 1, span, :, slots] = merged.view(2, -1, heads, count, dim)
            rotate(storage[KEYS, span, :, slots], cos, sin, scale, out=storage[ROTATED, span, :, slots])


class KVPool(PageRuns):
    what = "KV pool"

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, pages: int, page_tokens: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", host: "HostPool | None" = None,
    ) -> None:
        """`host`: the worker's host pool beside it, where its sessions' host tiers lease their pages."""
        super().__init__(pages, page_tokens)
        self.host = host
        with outside_inference():
            self.storage = torch.empty(3, layers, kv_heads, pages * page_tokens, head_dim, dtype=dtype, device=device)
            self._workspace = self.storage.new_empty(0, head_dim)  # `Lease.merge`'s, kept: no allocation at each question

    @classmethod
    def sized(
        cls, memory_bytes: int, layers: int, kv_heads: int, head_dim: int, page_tokens: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", host: "HostPool | None" = None,
    ) -> "KVPool":
        """As many pages as `memory_bytes` holds (at least one)."""
        page = page_bytes(layers, kv_heads, head_dim, page_tokens, dtype)
        return cls(layers, kv_heads, head_dim, max(1, memory_bytes // page), page_tokens, dtype, device, host)

    def workspace(self, rows: int) -> torch.Tensor:
        """At least `rows` rows of head_dim, the same for every call (its contents are the caller's
        until the next call): grown to the most asked for, at most MERGE_WORKSPACE_BYTES (memory
        beside the pool's pages)."""
        if self._workspace.shape[0] < rows:
            with outside_inference():
                self._workspace = self.storage.new_empty(rows, self.storage.shape[-1])
        return self._workspace

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def give_back(self, first_page: int, pages: int) -> None:
        """On a CPU, the pages' slots of every part, layer and KV head go back to the operating
        system (a new lease zeroes what it reads first anyway: `Lease.clean`)."""
        give_back(self.storage, 3, first_page * self.page_tokens, (first_page + pages) * self.page_tokens)

    def lease(self, tokens: int, owner: object | None = None) -> Lease:
        """A run of pages for `tokens` slots (`PageRuns._take`)."""
        return self._take(tokens, owner, Lease)


def page_bytes(layers: int, kv_heads: int, head_dim: int, page_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one page: keys, values and rotated keys of `page_tokens` slots in every layer."""
    return 3 * layers * kv_heads * page_tokens * head_dim * torch.empty(0, dtype=dtype).element_size()

"""One worker's host memory for every session's host tier: allocated once, in pages, leased by sessions.

A page here is a host tier's page (`engine/host_tier.py`): `page_tokens` consecutive places of
a stream, in every layer and KV head, with each place's key (before the rotary embedding),
value, kind, video time and whether it is held, and for a model with 3-D positions its place
on its frame's grid (`grids`, `engine/layout.py`). The pool holds `pages` of them in five (or
six) tensors (layers, kv_heads, pages, page_tokens[, head_dim]), pinned on CUDA (so that what a
question borrows is copied to the device without blocking). Keys and values are kept in
`page_dtype` of the model's: a float32 model's in bfloat16, half the bytes, so that the same
memory holds twice the stream (what a question borrows is converted back, rounded to bfloat16;
the tier's index, on the device, is summed from the keys as they were). A session with recall
leases a run of pages, as many as its tier's bound, when it opens (`engine/page_runs.py`): its
tier is then views of that run, and moving a page in or out is a copy of that page. Not pinned,
the pool takes memory only as pages are written and gives a run's back with it
(`engine/resident.py`). A tier made without a pool (a session alone) makes one of its own, of
exactly its bound.
"""

import torch

from engine.kv_buffers import outside_inference
from engine.page_runs import PageRuns, Run
from engine.resident import give_back

PAGE_DTYPES = {torch.float32: torch.bfloat16}  # the model's dtype -> its host pages' keys and values, where they differ
PLACE_BYTES = 1 + 4 + 1  # per place, layer and KV head beside its key and value: kind (int8), time (float32), held (bool)
GRID_BYTES = 8  # and with 3-D positions, its place on its group's grid (int64, `engine/layout.py`'s `pack`)


class HostPool(PageRuns):
    what = "host pool"

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, pages: int, page_tokens: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", positions_3d: bool = False,
    ) -> None:
        """`dtype`: the model's (keys and values are kept in `page_dtype(dtype)`); `device`: the
        caches' (each tier keeps its index of its pages there); the pages themselves are in host
        memory. `positions_3d`: for a model with 3-D positions."""
        super().__init__(pages, page_tokens)
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        shape = (layers, kv_heads, pages, page_tokens)
        with outside_inference():
            self.keys = torch.empty(*shape, head_dim, dtype=page_dtype(dtype), pin_memory=pinned)
            self.values = torch.empty(*shape, head_dim, dtype=page_dtype(dtype), pin_memory=pinned)
            self.kinds = torch.empty(shape, dtype=torch.int8)
            self.times = torch.empty(shape)
            self.present = torch.empty(shape, dtype=torch.bool)
            self.grids = torch.empty(shape, dtype=torch.int64) if positions_3d else None

    @classmethod
    def sized(
        cls, memory_bytes: int, layers: int, kv_heads: int, head_dim: int, page_tokens: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", positions_3d: bool = False,
    ) -> "HostPool":
        """As many pages as `memory_bytes` holds (at least one)."""
        page = host_page_bytes(layers, kv_heads, head_dim, page_tokens, dtype, positions_3d)
        return cls(layers, kv_heads, head_dim, max(1, memory_bytes // page), page_tokens, dtype, device, positions_3d)

    @property
    def nbytes(self) -> int:
        parts = (self.keys, self.values, self.kinds, self.times, self.present, self.grids)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def give_back(self, first_page: int, pages: int) -> None:
        """Not pinned, the pages' places go back to the operating system (a new lease marks
        them not held: `lease`)."""
        if self.device.type == "cuda":  # pinned
            return
        for part in (self.keys, self.values, self.kinds, self.times, self.present, self.grids):
            if part is not None:
                give_back(part, 2, first_page, first_page + pages)

    def lease(self, tokens: int, owner: object | None = None) -> Run:
        """A run of pages for `tokens` places, none of them held yet (`PageRuns._take`)."""
        run = self._take(tokens, owner)
        self.present[:, :, run.first_page : run.first_page + run.pages] = False
        return run


def page_dtype(dtype: torch.dtype) -> torch.dtype:
    """What host pages keep the keys and values of a model computing in `dtype` in."""
    return PAGE_DTYPES.get(dtype, dtype)


def host_page_bytes(
    layers: int, kv_heads: int, head_dim: int, page_tokens: int, dtype: torch.dtype, positions_3d: bool = False
) -> int:
    """Bytes of one page of a host pool: keys, values, kinds, times and which places are held (and
    grids, with 3-D positions), in every layer, for a model computing in `dtype`."""
    place = 2 * head_dim * page_dtype(dtype).itemsize + PLACE_BYTES + (GRID_BYTES if positions_3d else 0)
    return layers * kv_heads * page_tokens * place

"""Which pages of a pool are free, and runs of consecutive pages leased first-fit.

A pool of a worker (its KV pool on the device, `engine/kv_pool.py`; its host pool,
`engine/host_pool.py`) is allocated once, in pages; a session leases one run of consecutive
pages, so that its part of the pool is a view, read in place with no page table. A run is found
first-fit among the free pages; sessions of one size take runs of one length, which leave no
holes another such session cannot fill. A run goes back with `release`, or when its owner is
collected; a pool in RAM then gives its pages' memory back to the operating system.
"""

import weakref
from dataclasses import dataclass

import torch

from engine.kv_buffers import outside_inference


class PoolFull(RuntimeError):
    """No run of free pages is long enough for a session."""


@dataclass(eq=False)
class Run:
    """A session's pages first_page .. first_page + pages - 1 of `pool`."""

    pool: "PageRuns"
    first_page: int
    pages: int

    def release(self) -> None:
        self.pool.release(self)


class PageRuns:
    """The free pages of a pool of `pages` pages of `page_tokens` tokens each, and its runs leased."""

    what = "pool"  # its name in PoolFull's message

    def __init__(self, pages: int, page_tokens: int) -> None:
        if pages < 1 or page_tokens < 1:
            raise ValueError(f"a pool needs at least one page of at least one token, got {pages} of {page_tokens}")
        self.page_tokens = page_tokens
        self.total_pages = pages
        self.leases: dict[int, Run] = {}  # by first page
        with outside_inference():  # a pool made in inference mode still takes runs back outside it
            self.free = torch.ones(pages, dtype=torch.bool)  # by page

    @property
    def free_pages(self) -> int:
        return int(self.free.sum())

    def pages_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.page_tokens))

    def longest_free_run(self) -> int:
        """Pages in the longest run of consecutive free pages."""
        best = run = 0
        for free in self.free.tolist():
            run = run + 1 if free else 0
            best = max(best, run)
        return best

    def can_lease(self, tokens: int) -> bool:
        return self._first_fit(self.pages_for(tokens)) is not None

    def _take(self, tokens: int, owner: object | None, run: type[Run] = Run) -> Run:
        """A run (of class `run`) of pages for `tokens` tokens; PoolFull when none is free. With
        `owner`, the run goes back when the owner is collected, if it was not released before."""
        pages = self.pages_for(tokens)
        first = self._first_fit(pages)
        if first is None:
            raise PoolFull(
                f"no {pages} consecutive free pages ({tokens} tokens) in the {self.what}: "
                f"{self.free_pages} of {self.total_pages} pages free, the longest run {self.longest_free_run()}"
            )
        self.free[first : first + pages] = False
        lease = run(self, first, pages)
        self.leases[first] = lease
        if owner is not None:
            weakref.finalize(owner, self.release, lease)
        return lease

    def release(self, lease: Run) -> None:
        """Give the run back (again: nothing), and its pages' memory (`give_back`)."""
        if self.leases.get(lease.first_page) is lease:
            del self.leases[lease.first_page]
            self.free[lease.first_page : lease.first_page + lease.pages] = True
            self.give_back(lease.first_page, lease.pages)

    def give_back(self, first_page: int, pages: int) -> None:
        """What a pool does with the memory of pages no run holds now: nothing here; a pool in
        RAM gives it to the operating system (`engine/resident.py`)."""

    def _first_fit(self, pages: int) -> int | None:
        if pages > self.total_pages:
            return None
        taken = torch.cat([torch.zeros(1, dtype=torch.int64), (~self.free).long().cumsum(0)])
        windows = taken[pages:] - taken[:-pages]  # taken pages among pages i .. i + pages - 1
        fits = (windows == 0).nonzero()
        return int(fits[0]) if len(fits) else None

"""A session's host tier: what the bounded cache evicted, in pages of stream places, and the pages a question needs.

A page is a span of `page_tokens` consecutive places of the stream (page p holds places
p * page_tokens .. (p + 1) * page_tokens - 1), in every layer and KV head. Each eviction hands
over, for every layer and KV head, the tokens it removed (keys as stored, before the rotary
embedding, and values, with kinds, video times and stream places); each token goes to its
place in its page. A policy that scores per head evicts a head's tokens of one sentence at
different times, so a page fills over several evictions, and a head's page may lack the tokens
that head still holds on the device; but whatever a head lost of a span of the stream is in
one page, so bringing the page back makes the span whole again. Pages by the order of
eviction instead scatter a fact over many pages under such a policy (measured in
docs/benchmarks.md: with them, `infmllm` and `snapkv` got back a fraction of what `sliding`
did).

Keys and values live in host memory, in a run of pages of a host pool (`engine/host_pool.py`:
pinned on CUDA, a float32 model's in bfloat16, any other model's bit for bit): the worker's,
shared by its sessions' tiers, or one of the tier's own; each slot is a page of the run. Each
page keeps, where scoring is cheap (on the device), `page_keys` representative keys per layer
and KV head: the sums (which point where the means do) of the keys held of equal runs of its
places, as they were evicted, in bfloat16, so that 4 of them cost the device what 2 in float32
did. A question borrows back, in the model's dtype, the pages its keys want most
(`engine/page_scoring.py`).

Bound: at most `budget_tokens // page_tokens` pages. When a page needs a place and all are
taken, pages leave by the tier's `drop` rule:
- "novel" (the default): the least novel eighth of the pages leaves at once, never one of the
  quarter used most recently (opened, or borrowed from by a question). A page is as novel as
  its most novel run of places: per run, one minus the cosine similarity of its representative
  to the closest representative of any other page held, averaged over the layers and KV heads.
  A page that others repeat (the same scene again, boilerplate) goes first; a page with
  something told once (a fact among prose, an event in a still scene) stays. Retrieval ranks
  pages by a softmax over them, so a page that many others resemble would rarely win it, and
  another page can stand in for it when it does. Measured in docs/benchmarks.md: in streams of prose 32
  times the budget, each planted fact's best page ranked in the most novel 17% of the pages,
  and with a tier of 16 times the budget recall answered 19 of 48 questions against 16 under
  "oldest".
- "oldest": the page used least recently goes, the oldest of those; with no questions, the
  oldest page.
Tokens that leave the device for a page not held and no newer than a page that left (a head
kept them longer than the rest of their span) are dropped: the tier has let that part of the
stream go. (Dropping the page borrowed from least often instead freezes the tier once every
page held has been borrowed from: each new page is then the one to go.)
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.host_pool import HostPool
from engine.kv_buffers import take
from engine.page_runs import Run
from engine.page_scoring import SCORED_LAYERS, SIMILARITY_CHUNK, Cached, Question  # SCORED_LAYERS: kv_cache.py's, from here

INDEX_DTYPE = torch.bfloat16  # of the representative keys' sums (at most page_tokens keys each)
DROP_RULES = ("novel", "oldest")
NOVEL_DROP_SHARE = 8  # under "novel", the least novel 1/8 of the pages leave together (amortises the scoring)
NOVEL_KEEP_SHARE = 4  # ... never one of the 1/4 of the pages used most recently
NOVELTY_LAYERS = 8  # novelty is scored in this many layers, evenly spaced (all when fewer)
NOVELTY_REFERENCES = 1024  # ... against at most this many representatives, evenly spaced over the slots


@dataclass
class Tokens:
    """Tokens of every layer and KV head, the same number in each."""

    keys: torch.Tensor  # (layers, kv_heads, n, head_dim), before the rotary embedding
    values: torch.Tensor  # (layers, kv_heads, n, head_dim)
    kinds: torch.Tensor  # (layers, kv_heads, n) int8
    times: torch.Tensor  # (layers, kv_heads, n) video time
    order: torch.Tensor  # (layers, kv_heads, n) int64, the token's place in the stream
    grids: torch.Tensor | None = None  # (layers, kv_heads, n) int64 with 3-D positions: its place on its group's grid (`layout.pack`)

    FIELDS = ("keys", "values", "kinds", "times", "order")

    @property
    def count(self) -> int:
        return self.kinds.shape[-1]


@dataclass
class Retrieval:
    """What one question brought back to one layer, and to the layers after it that share its choice."""

    tokens: Tokens  # (layers, kv_heads, k, ...) on the cache's device, from the layer asked for on, in stream order
    pages: list[int]  # the page numbers (spans of the stream) any head of the layer asked for borrowed from


def index_bytes_per_token(layers: int, kv_heads: int, head_dim: int, page_tokens: int, page_keys: int) -> float:
    """Device bytes of a host tier's index per token of its bound, over all layers: the
    representative keys' running sums, and which places are held."""
    return layers * kv_heads * (page_keys * head_dim * INDEX_DTYPE.itemsize / page_tokens + 1)


class HostTier:
    SAVED = ("keys", "values", "kinds", "times", "present", "key_sums")  # per slot, in a snapshot (and grids, with 3-D positions)

    def __init__(
        self, budget_tokens: int, page_tokens: int = 32, page_keys: int = 2, drop: str = "novel", pool: HostPool | None = None
    ) -> None:
        """With `pool` (the worker's), the tier leases its pages there now (PoolFull when no run
        of them is free), until `release()`; without, it makes a pool of its own at its first
        eviction."""
        if drop not in DROP_RULES:
            raise ValueError(f"host_drop must be one of {', '.join(DROP_RULES)}, got {drop!r}")
        if page_tokens < 1 or page_keys < 1 or page_tokens % page_keys:
            raise ValueError(f"page_tokens ({page_tokens}) must be a positive multiple of page_keys ({page_keys})")
        if budget_tokens < page_tokens:
            raise ValueError(f"host_budget_tokens ({budget_tokens}) must be at least page_tokens ({page_tokens})")
        if pool is not None and pool.page_tokens != page_tokens:
            raise ValueError(f"page_tokens ({page_tokens}) must be the host pool's ({pool.page_tokens})")
        self.budget_tokens, self.page_tokens, self.page_keys, self.drop = budget_tokens, page_tokens, page_keys, drop
        self.slots = budget_tokens // page_tokens
        self.slot_of: dict[int, int] = {}  # page number -> slot
        self.page_of = torch.full((self.slots,), -1, dtype=torch.int64)  # slot -> page number, -1 when free
        self.used = torch.zeros(self.slots, dtype=torch.int64)  # the clock when it was last opened or borrowed from
        self.clock = 0  # counts openings and borrowings
        self.dropped_pages = 0  # pages that left
        self.dropped_through = -1  # the newest page that left: tokens of older pages not held are dropped
        # Views of the run of the pool's pages, and the index on the device: at the lease (at the
        # first add without a pool, when the model's shapes are known)
        self.pool, self.shared_pool = pool, pool  # shared_pool: the worker's (None: the tier's own, once made)
        self.run: Run | None = None
        self.keys = self.values = None  # (layers, kv_heads, slots, page_tokens, head_dim), host memory
        self.kinds = self.times = self.present = None  # (layers, kv_heads, slots, page_tokens), CPU
        self.grids = None  # the same, with 3-D positions: each place's on its group's grid (`layout.pack`)
        self.held = None  # `present` on the device, for choosing
        self.key_sums = None  # (layers, kv_heads, slots, page_keys, head_dim) INDEX_DTYPE, device
        self.question = Question()  # the one borrowing now (`begin_question`)
        self.changed: set[int] = set()  # page numbers written since `take_changed` (held pages only)
        if pool is not None:
            self._lease()

    @property
    def saved(self) -> tuple[str, ...]:
        """What a snapshot saves of each slot."""
        return self.SAVED + (("grids",) if self.grids is not None else ())

    @property
    def pages(self) -> list[int]:
        """The page numbers held, in stream order."""
        return sorted(self.slot_of)

    def page_uses(self) -> dict[int, int]:
        """By page: the clock when it was last opened or borrowed from."""
        return {page: int(self.used[slot]) for page, slot in self.slot_of.items()}

    @property
    def tokens(self) -> int:
        """Tokens held, per layer (averaged over the KV heads, which may hold different ones)."""
        if self.present is None:
            return 0
        layers, heads = self.present.shape[:2]
        return round(int(self.present.sum()) / (layers * heads))

    def available(self) -> int:
        """The most tokens every KV head of every layer can lend."""
        if self.present is None:
            return 0
        return int(self.present.flatten(2).sum(-1).min())

    @property
    def nbytes(self) -> int:
        """Host bytes of the pages held."""
        if self.keys is None:
            return 0
        per_slot = sum(t[:, :, 0].numel() * t.element_size() for t in (self.keys, self.values, self.kinds, self.times, self.present))
        return per_slot * len(self.slot_of)

    @property
    def device_bytes(self) -> int:
        """Bytes on the cache's device: the representative keys and which places are held."""
        if self.key_sums is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.key_sums, self.held))

    # -- add -----------------------------------------------------------------------------------

    def add(self, evicted: Tokens) -> None:
        """Take what an eviction removed: each token to its place in its page."""
        if self.keys is None:
            self._allocate(*evicted.keys.shape[:2], evicted.keys.shape[-1], evicted.keys.dtype, evicted.keys.device,
                           evicted.grids is not None)
        if (evicted.grids is None) != (self.grids is None):
            raise ValueError("a host tier's pool holds 3-D grids exactly when its model has 3-D positions")
        layers, heads, count, dim = evicted.keys.shape
        pool, order = self.pool, evicted.order.cpu()
        page = order // self.page_tokens
        for number in page.unique().tolist():  # ascending: older pages first
            if number not in self.slot_of:
                self._open(number)
        slot = torch.tensor([self.slot_of.get(n, -1) for n in range(int(page.min()), int(page.max()) + 1)])
        slot = slot[page - int(page.min())]  # (layers, heads, count)
        kept = slot >= 0
        place = order % self.page_tokens
        grid = torch.arange(layers)[:, None, None] * heads + torch.arange(heads)[None, :, None]  # (layers, heads, 1)
        cell = grid * self.slots + slot  # into the tier's (layers * heads * slots)
        flat = (cell * self.page_tokens + place)[kept]  # into the tier's (layers * heads * slots * page_tokens)
        home = ((grid * pool.total_pages + self.run.first_page + slot) * self.page_tokens + place)[kept]  # into the pool's
        for name in ("keys", "values", "kinds", "times", "grids"):
            if (given := getattr(evicted, name)) is not None:
                into = getattr(pool, name)  # (layers, kv_heads, pages, page_tokens, ...)
                into.view(-1, *into.shape[4:])[home] = given.to(into.dtype).cpu()[kept]  # keys, values: rounded where kept narrower
        pool.present.view(-1)[home] = True
        self.changed.update(n for n in page.unique().tolist() if n in self.slot_of)
        device = self.held.device
        self.held.view(-1)[flat.to(device)] = True
        run = (cell * self.page_keys + place // (self.page_tokens // self.page_keys))[kept].to(device)
        self.key_sums.view(-1, dim).index_add_(0, run, evicted.keys.to(device, INDEX_DTYPE)[kept.to(device)])

    def _allocate(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device, positions_3d: bool = False) -> None:
        """Pages for the model's shapes: a pool of the tier's own when it has none."""
        if self.pool is None:
            self.pool = HostPool(layers, heads, dim, self.slots, self.page_tokens, dtype, device, positions_3d)
        if self.run is None:
            self._lease()

    def _lease(self) -> None:
        """Its run of the pool's pages, and its index of them on the caches' device."""
        pool = self.pool
        self.run = pool.lease(self.slots * self.page_tokens, owner=self)
        pages = slice(self.run.first_page, self.run.first_page + self.slots)
        self.keys, self.values = pool.keys[:, :, pages], pool.values[:, :, pages]
        self.kinds, self.times, self.present = pool.kinds[:, :, pages], pool.times[:, :, pages], pool.present[:, :, pages]
        self.grids = None if pool.grids is None else pool.grids[:, :, pages]
        layers, heads, _, _, dim = pool.keys.shape
        self.held = torch.zeros(self.present.shape, dtype=torch.bool, device=pool.device)
        self.key_sums = torch.zeros(layers, heads, self.slots, self.page_keys, dim, dtype=INDEX_DTYPE, device=pool.device)

    def release(self) -> None:
        """The session is over: its pages go back to the pool, and the tier holds nothing."""
        if self.run is not None:
            self.run.release()
        self.run = self.keys = self.values = self.kinds = self.times = self.present = self.grids = self.held = self.key_sums = None
        self.slot_of.clear()
        self.page_of.fill_(-1)
        self.changed.clear()

    def _open(self, number: int) -> None:
        """A slot for page `number`, after pages leave by the drop rule when none is free. None for
        a page no newer than one that left."""
        if number <= self.dropped_through:
            return
        free = (self.page_of < 0).nonzero()
        if not len(free):
            for slot in self._leaving():
                self.dropped_through = max(self.dropped_through, int(self.page_of[slot]))
                self.dropped_pages += 1
                self._clear(slot)
            free = (self.page_of < 0).nonzero()
        slot = int(free[0])
        for tensor in (self.keys, self.values, self.kinds, self.times, self.grids):  # a snapshot saves the whole page: zeros, never stale
            if tensor is not None:
                tensor[:, :, slot] = 0
        self.slot_of[number] = slot
        self.page_of[slot] = number
        self.clock += 1
        self.used[slot] = self.clock

    def _leaving(self) -> list[int]:
        """The slots whose pages leave when every slot is taken."""
        if self.drop == "oldest" or self.slots < NOVEL_KEEP_SHARE:
            least = self.used == self.used.min()
            return [int(self.page_of.masked_fill(~least, torch.iinfo(torch.int64).max).argmin())]
        novelty = self.novelty().cpu()
        novelty[self.used.topk(self.slots // NOVEL_KEEP_SHARE).indices] = float("inf")  # used most recently
        by_age = self.page_of.argsort()  # ties: the oldest page first
        least = by_age[novelty[by_age].argsort(stable=True)]
        return least[: max(1, self.slots // NOVEL_DROP_SHARE)].tolist()

    def novelty(self) -> torch.Tensor:
        """(slots,) how unlike the other pages held each page is: per run of its places, one minus
        the cosine similarity (at least 0) of its representative to the closest one of another
        page, averaged over the layers and KV heads; a page is as novel as its most novel run. Scored in
        NOVELTY_LAYERS layers against NOVELTY_REFERENCES representatives (evenly spaced), so
        that its cost grows with the tier, not with its square: a page that others repeat has
        some of them among the references."""
        layers, heads, slots, runs, dim = self.key_sums.shape
        device = self.key_sums.device
        held = self.held.view(layers, heads, slots * runs, -1).any(-1)  # (layers, kv_heads, slots * runs)
        owner = torch.arange(slots, device=device).repeat_interleave(runs)
        step = -(-slots * runs // NOVELTY_REFERENCES)  # every page has some among them up to that many slots
        references = torch.arange(0, slots * runs, step, device=device)
        same = owner[:, None] == owner[None, references]  # (slots * runs, references): a run of the same page
        closest = torch.zeros(slots * runs, device=device)
        counted = torch.zeros(slots * runs, device=device)
        rows = max(1, SIMILARITY_CHUNK // (heads * len(references)))
        for layer in torch.linspace(0, layers - 1, min(layers, NOVELTY_LAYERS)).round().long().unique().tolist():
            sums = self.key_sums[layer].float().flatten(1, 2)  # (kv_heads, slots * runs, head_dim)
            reps = sums / sums.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # a run not held: all zeros
            others = reps[:, references].transpose(1, 2)  # (kv_heads, head_dim, references)
            for start in range(0, slots * runs, rows):
                block = reps[:, start : start + rows] @ others  # (kv_heads, rows, references)
                best = block.masked_fill_(same[start : start + rows], 0.0).amax(-1).clamp_min(0.0)  # (kv_heads, rows)
                mine = held[layer, :, start : start + rows]
                closest[start : start + rows] += (best * mine).sum(0)
                counted[start : start + rows] += mine.sum(0)
        similar = (closest / counted.clamp_min(1)).masked_fill(counted == 0, 1.0)  # a run never held: no news
        return 1.0 - similar.view(slots, runs).amin(-1)

    def _clear(self, slot: int) -> None:
        self.changed.discard(int(self.page_of[slot]))
        del self.slot_of[int(self.page_of[slot])]
        self.page_of[slot] = -1
        for tensor in (self.present, self.held, self.key_sums):
            tensor[:, :, slot] = 0

    # -- retrieve ------------------------------------------------------------------------------

    def begin_question(self) -> None:
        """A new question: its layers' scores pool from the first layer on."""
        self.question = Question()

    def retrieve(self, layer: int, keys: torch.Tensor, count: int, cached: Cached | None = None) -> Retrieval | None:
        """`count` tokens (at most `available()`) of `layer` for the question's keys (kv_heads, c,
        head_dim) (before the rotary embedding) and what the layer's cache holds on the device
        (`cached`), in stream order, from `layer` on: one copy for every layer that shares its
        choice (`Question.borrow`). None: the layer borrows what an earlier one's retrieval brought it."""
        if (chosen := self.question.borrow(self, layer, keys, count, cached)) is None:
            return None
        self.clock += 1
        self.used[chosen[0] // self.page_tokens] = self.clock  # a page named twice takes the same clock
        return self._lend(layer, *chosen, keys.device, keys.dtype)

    def _lend(self, first: int, chosen: torch.Tensor, order: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Retrieval:
        """The tokens at `chosen` (layers, kv_heads, count) of the layers from `first` on, keys and
        values on `device` in `dtype` (the cache's), each in one copy for every layer."""
        layers, heads, count = chosen.shape
        last = first + layers

        def lend(pool: torch.Tensor) -> torch.Tensor:
            out = torch.empty(layers * heads * count, pool.shape[-1], dtype=pool.dtype, pin_memory=device.type == "cuda")
            return take(pool[first:last].flatten(2, 3), chosen, out=out).to(device, non_blocking=True).to(dtype)

        kinds, times, grids = (None if t is None else t[first:last].flatten(2).gather(2, chosen) for t in (self.kinds, self.times, self.grids))
        tokens = Tokens(lend(self.keys), lend(self.values), kinds, times, order, grids)
        return Retrieval(tokens, sorted(self.page_of[(chosen[0] // self.page_tokens).unique()].tolist()))

    # -- read ----------------------------------------------------------------------------------

    def contents(self, layer: int, head: int) -> Tokens:
        """What one layer's KV head holds, in stream order (on the CPU; for checks)."""
        if not self.slot_of:
            return Tokens(torch.empty(1, 1, 0, 0), torch.empty(1, 1, 0, 0), torch.empty(1, 1, 0, dtype=torch.int8),
                          torch.empty(1, 1, 0), torch.empty(1, 1, 0, dtype=torch.int64))
        slots = torch.tensor([self.slot_of[n] for n in self.pages])
        mask = self.present[layer, head, slots]  # (pages, page_tokens)
        order = torch.tensor(self.pages)[:, None] * self.page_tokens + torch.arange(self.page_tokens)
        held = [t[layer, head, slots][mask] for t in (self.keys, self.values, self.kinds, self.times)] + [order[mask]]
        return Tokens(*(t[None, None] for t in held))

    # -- snapshot ------------------------------------------------------------------------------

    def state(self, with_pages: bool = True) -> dict:
        """The pages held, in stream order, with their representatives (saved as they are, so a
        restored tier chooses exactly as this one). Without `with_pages`, which pages and their
        order alone: each page's tokens are `page_state`'s, saved apart (a snapshot then
        writes only the pages that changed since the last: `take_changed`)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        pages = self.pages
        slots = torch.tensor([self.slot_of[n] for n in pages], dtype=torch.int64)
        saved = {"options": [self.budget_tokens, self.page_tokens, self.page_keys, self.drop], "by_place": True, "pages": pages,
                 "used": self.used[slots], "counters": [self.clock, self.dropped_pages, self.dropped_through]}
        if self.keys is not None and with_pages:
            for name in self.saved:
                saved[name] = getattr(self, name)[:, :, slots.to(getattr(self, name).device)].cpu()
        elif self.keys is not None:
            saved["apart"] = [*self.keys.shape[:2], self.keys.shape[-1], str(self.keys.dtype).removeprefix("torch."),
                              self.grids is not None]
        return saved

    def page_state(self, number: int) -> dict[str, torch.Tensor]:
        """What `state` saves of one page held, per layer and KV head (on the CPU): copies, so
        that saving one saves that page alone (a view would save the whole tier beneath it)."""
        slot = self.slot_of[number]
        return {name: getattr(self, name)[:, :, slot].to("cpu", copy=True) for name in self.saved}

    def take_changed(self) -> list[int]:
        """The pages held that changed since the last call, in stream order (a snapshot's to write)."""
        changed, self.changed = sorted(n for n in self.changed if n in self.slot_of), set()
        return changed

    @classmethod
    def load(
        cls, state: dict, device: torch.device, read_page: Callable[[int], dict] | None = None, pool: HostPool | None = None,
        dtype: torch.dtype | None = None,
    ) -> "HostTier":
        """The tier a `state` was taken of, in `pool`'s pages if given; `read_page(number)`: a
        page's `page_state`, for a state saved without its pages; `dtype`: the keys' and values'
        (converted as they are copied in; None: as saved)."""
        tier = cls(*state["options"], pool=pool)
        if not state.get("by_place"):  # snapshot format 2, pages by the order of eviction: each token to its place
            for saved in state["pages"] + ([state["open"]] if state["open"] is not None else []):
                tier.add(Tokens(*(saved[name].to(device, dtype) if name in ("keys", "values") else saved[name] for name in Tokens.FIELDS)))
            return tier
        if "keys" in state:
            layers, heads, _, _, dim = state["keys"].shape
            tier._allocate(layers, heads, dim, dtype or state["keys"].dtype, device, "grids" in state)
            count = len(state["pages"])
            for name in tier.saved:  # format 3 also saved float32 key counts, now read from `present`
                getattr(tier, name)[:, :, :count] = state[name].to(getattr(tier, name).device)
            tier.held[:, :, :count] = state["present"].to(device)
        elif "apart" in state:
            if read_page is None:
                raise ValueError("this snapshot was taken without its host pages: restoring it needs them (read_page)")
            layers, heads, dim, saved_dtype, *grids = state["apart"]
            tier._allocate(layers, heads, dim, dtype or getattr(torch, saved_dtype), device, bool(grids and grids[0]))
            for slot, number in enumerate(state["pages"]):
                page = read_page(number)
                for name in tier.saved:
                    getattr(tier, name)[:, :, slot] = page[name].to(getattr(tier, name).device)
                tier.held[:, :, slot] = page["present"].to(device)
        for slot, number in enumerate(state["pages"]):
            tier.slot_of[number] = slot
            tier.page_of[slot] = number
        tier.used[: len(state["pages"])] = state["used"]
        tier.clock, tier.dropped_pages, tier.dropped_through = state["counters"]
        return tier

"""A session's host tier: what the bounded cache evicted, in pages, and the pages a question needs.

Each eviction hands over, for every layer and KV head, the tokens it removed (keys as stored,
before the rotary embedding, and values, with kinds, video times and stream order). They
gather in an open page; every `page_tokens` of them close a page. Every layer and KV head
evicts the same number of tokens, so pages have the same size everywhere, even though each
head's page holds its own tokens. A closed page moves to host memory (pinned, with copies
that do not block, on CUDA) and leaves behind, where scoring is cheap (on the device), its
`page_keys` representative keys: the means of equal runs of its keys.

A question scores the pages of each layer by its own keys (its tokens' keys, as stored, of
the question's words only, not the chat template's): a page matches a question key by the
cosine similarity of its closest representative; per question key, a softmax over the pages
(sharpened by SIMILARITY_SHARPNESS); a page's score is that share averaged over the question's
keys. Each KV head chooses its own pages (its pages hold its own tokens: a policy that scores
per head evicts a fact from different heads at different times). A fact is asked about in the words it was told in, and the
keys of the same words in similar contexts are close, whereas the question's queries are not
(measured on bench.recall's streams: scoring by queries brought back 16% to 51% of an evicted
fact's tokens to each layer, near chance at 8 pages of 48; by keys, 30% to 71%, and 76% to 90%
with page_keys = page_tokens).
The best pages up to the retrieval budget, and the open page, come back bit for bit.

Bound: at most `budget_tokens` tokens (closed pages and the open one). Past it, a page is
dropped: the one retrieved least often, the oldest of those.
"""

from dataclasses import dataclass, field

import torch

SIMILARITY_SHARPNESS = 20.0  # a question key's softmax over pages is of 20 x cosine similarity


@dataclass
class Tokens:
    """Tokens of every layer and KV head, the same number in each."""

    keys: torch.Tensor  # (layers, kv_heads, n, head_dim), before the rotary embedding
    values: torch.Tensor  # (layers, kv_heads, n, head_dim)
    kinds: torch.Tensor  # (layers, kv_heads, n) int8
    times: torch.Tensor  # (layers, kv_heads, n) video time
    order: torch.Tensor  # (layers, kv_heads, n) int64, the token's place in the stream

    FIELDS = ("keys", "values", "kinds", "times", "order")

    @property
    def count(self) -> int:
        return self.kinds.shape[-1]

    def cut(self, start: int, end: int) -> "Tokens":
        """Tokens start..end, copied (a page must not hold on to the tensor it was cut from)."""
        return Tokens(*(getattr(self, name)[:, :, start:end].clone() for name in self.FIELDS))

    def join(self, more: "Tokens") -> "Tokens":
        return Tokens(*(torch.cat([getattr(self, name), getattr(more, name)], dim=2) for name in self.FIELDS))

    def layer(self, index: int) -> "Tokens":
        return Tokens(*(getattr(self, name)[index : index + 1] for name in self.FIELDS))

    def head(self, layer: int, head: int) -> "Tokens":
        return Tokens(*(getattr(self, name)[layer : layer + 1, head : head + 1] for name in self.FIELDS))

    @classmethod
    def concat(cls, parts: list["Tokens"], dim: int) -> "Tokens":
        return cls(*(torch.cat([getattr(part, name) for part in parts], dim=dim) for name in cls.FIELDS))

    def on(self, device: torch.device) -> "Tokens":
        """Keys and values on `device` (copied without blocking from pinned memory)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Tokens(move(self.keys), move(self.values), self.kinds, self.times, self.order)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.kinds, self.times, self.order))


@dataclass
class Page:
    tokens: Tokens  # page_tokens of them; keys and values in host memory
    number: int  # pages closed before this one
    hits: int = 0  # layers that brought it back, over every question


@dataclass
class Retrieval:
    """What one question brought back to one layer."""

    tokens: Tokens  # (1, kv_heads, k, ...) on the cache's device, keys and values
    pages: list[int]  # the page numbers


@dataclass
class HostTier:
    budget_tokens: int
    page_tokens: int = 32
    page_keys: int = 2  # representative keys per page

    pages: dict[int, Page] = field(default_factory=dict)  # by slot
    open: Tokens | None = None  # fewer than page_tokens, on the cache's device
    representatives: torch.Tensor | None = None  # (layers, kv_heads, slots, page_keys, head_dim)
    closed: int = 0  # pages closed so far
    dropped_pages: int = 0

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or self.page_keys < 1 or self.page_tokens % self.page_keys:
            raise ValueError(f"page_tokens ({self.page_tokens}) must be a positive multiple of page_keys ({self.page_keys})")
        if self.budget_tokens < self.page_tokens:
            raise ValueError(f"host_budget_tokens ({self.budget_tokens}) must be at least page_tokens ({self.page_tokens})")

    @property
    def slots(self) -> int:
        return self.budget_tokens // self.page_tokens + 1

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.page_tokens + (self.open.count if self.open is not None else 0)

    @property
    def nbytes(self) -> int:
        """Host bytes: the closed pages' tokens."""
        return sum(page.tokens.nbytes for page in self.pages.values())

    @property
    def device_bytes(self) -> int:
        """Bytes on the cache's device: the open page and the representative keys."""
        held = self.open.nbytes if self.open is not None else 0
        if self.representatives is not None:
            held += self.representatives.numel() * self.representatives.element_size()
        return held

    # -- add -----------------------------------------------------------------------------------

    def add(self, evicted: Tokens) -> None:
        """Take what an eviction removed (in stream order per layer and head); close full pages
        and drop pages past the budget."""
        self.open = evicted if self.open is None else self.open.join(evicted)
        while self.open.count >= self.page_tokens:
            page, self.open = self.open.cut(0, self.page_tokens), self.open.cut(self.page_tokens, self.open.count)
            if len(self.pages) == self.slots:
                self._drop()
            self._close(page)
        while self.tokens > self.budget_tokens and self.pages:
            self._drop()

    def _close(self, tokens: Tokens) -> int:
        layers, heads, count, dim = tokens.keys.shape
        if self.representatives is None:
            self.representatives = tokens.keys.new_zeros(layers, heads, self.slots, self.page_keys, dim)
        free = next(slot for slot in range(self.slots) if slot not in self.pages)
        runs = tokens.keys.float().view(layers, heads, self.page_keys, count // self.page_keys, dim).mean(dim=3)
        self.representatives[:, :, free] = runs.to(self.representatives.dtype)
        self.pages[free] = Page(_to_host(tokens), self.closed)
        self.closed += 1
        return free

    def _drop(self) -> None:
        slot = min(self.pages, key=lambda s: (self.pages[s].hits, self.pages[s].number))
        del self.pages[slot]
        self.dropped_pages += 1

    # -- retrieve ------------------------------------------------------------------------------

    def page_count(self, retrieval_tokens: int) -> int:
        """Closed pages a question brings back to each layer, besides the open page."""
        room = retrieval_tokens - (self.open.count if self.open is not None else 0)
        return max(0, min(len(self.pages), room // self.page_tokens))

    def retrieve(self, layer: int, keys: torch.Tensor, count: int) -> Retrieval:
        """The `count` best closed pages of `layer` for the question's keys (kv_heads, c, head_dim)
        (before the rotary embedding), chosen for each KV head, and the open page, merged in
        stream order per KV head."""
        heads = keys.shape[0]
        chosen: list[list[int]] = [[] for _ in range(heads)]
        if count:
            slots = sorted(self.pages)
            scores = self.score(layer, keys, torch.tensor(slots, device=self.representatives.device))
            chosen = [[slots[i] for i in row] for row in scores.topk(count, dim=-1).indices.tolist()]
        numbers = sorted({self.pages[slot].number for row in chosen for slot in row})
        for slot in {slot for row in chosen for slot in row}:
            self.pages[slot].hits += 1
        device = keys.device
        rows = []
        for head, row in enumerate(chosen):
            parts = [self.pages[slot].tokens.head(layer, head).on(device) for slot in row]
            if self.open is not None and self.open.count:
                parts.append(self.open.head(layer, head))
            rows.append(Tokens.concat(parts, dim=2))
        joined = Tokens.concat(rows, dim=1)  # (1, kv_heads, k, ...)
        order = joined.order.sort(dim=-1).indices  # stream order per head
        index = order.to(device)[..., None].expand(-1, -1, -1, joined.keys.shape[-1])
        merged = Tokens(
            joined.keys.gather(2, index),
            joined.values.gather(2, index),
            joined.kinds.gather(2, order),
            joined.times.gather(2, order),
            joined.order.gather(2, order),
        )
        return Retrieval(merged, numbers)

    def score(self, layer: int, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """(kv_heads, len(slots)) how much the question's keys (kv_heads, c, head_dim) want each
        page of `layer`, per KV head (each head's pages hold its own tokens)."""
        reps = self.representatives[layer][:, slots].float()  # (kv_heads, pages, page_keys, head_dim)
        reps = reps / reps.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        wanted = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (kv_heads, c, head_dim)
        similarity = torch.einsum("hcd,hpkd->hcpk", wanted, reps).amax(dim=-1)  # (kv_heads, c, pages)
        return (SIMILARITY_SHARPNESS * similarity).softmax(dim=-1).mean(dim=1)

    # -- read ----------------------------------------------------------------------------------

    def per_second(self, kind: int, seconds: int, layers: int, heads: int) -> torch.Tensor:
        """(seconds,) tokens of `kind` held here from each second of video, averaged over the
        layers and KV heads."""
        counts = torch.zeros(seconds)
        parts = [page.tokens for page in self.pages.values()] + ([self.open] if self.open is not None else [])
        for part in parts:
            mine = part.times.cpu()[part.kinds.cpu() == kind].floor().long().clamp(0, max(seconds - 1, 0))
            counts += torch.bincount(mine, minlength=seconds)[:seconds].float()
        return counts / (layers * heads)

    # -- snapshot ------------------------------------------------------------------------------

    def state(self) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies to pinned memory did not block
        slots = sorted(self.pages)
        return {
            "options": [self.budget_tokens, self.page_tokens, self.page_keys],
            "pages": [{**_fields(self.pages[s].tokens, "cpu"), "number": self.pages[s].number, "hits": self.pages[s].hits} for s in slots],
            "open": None if self.open is None else _fields(self.open, "cpu"),
            "counters": [self.closed, self.dropped_pages],
        }

    @classmethod
    def load(cls, state: dict, device: torch.device) -> "HostTier":
        tier = cls(*state["options"])
        for saved in state["pages"]:
            page = tier.pages[tier._close(_tokens(saved, device))]
            page.number, page.hits = saved["number"], saved["hits"]
        tier.open = None if state["open"] is None else _tokens(state["open"], device)
        tier.closed, tier.dropped_pages = state["counters"]
        return tier


def _fields(tokens: Tokens, device: str) -> dict:
    return {name: getattr(tokens, name).to(device) for name in Tokens.FIELDS}


def _tokens(saved: dict, device: torch.device) -> Tokens:
    """Saved fields as Tokens: keys and values on `device`, the rest on the CPU."""
    return Tokens(saved["keys"].to(device), saved["values"].to(device), saved["kinds"], saved["times"], saved["order"])


def _to_host(tokens: Tokens) -> Tokens:
    """Keys and values copied to host memory (pinned, without blocking, from a GPU)."""
    if tokens.keys.device.type != "cuda":
        return tokens

    def host(tensor: torch.Tensor) -> torch.Tensor:
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return pinned.copy_(tensor, non_blocking=True)

    return Tokens(host(tokens.keys), host(tokens.values), tokens.kinds, tokens.times, tokens.order)

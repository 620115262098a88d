"""The attention of the sessions of one forward whose caches live in one KV pool.

Per layer, for every such session at once: one write of the new keys, rotated keys and values
into their slots in the pool, and one attention call for the sessions that run the same number
of new tokens. No Python loop over sessions inside a layer: what differs from session to session
(slots, positions, pages, masks) is made into index tensors once per forward (`PoolStep`).

Write: each layer's new keys, rotated at their positions, are turned back, written after each
session's held tokens with one `index_copy_` per pool part, and rotated again into the copy the
attention reads: token by token the arithmetic of `PreRopeLayer.update`, so the same bits as a
session run alone.

Attend, for the B sessions with c new tokens each: their queries (B, kv_heads, group * c,
head_dim) over a batch of their keys and values (E, kv_heads, N, head_dim), with an additive
mask: each query sees its session's keys up to its own, never another session's nor the slots
after its last. The batch is a strided view of the pool when the leases are of one length and
lie one after another, else their pages gathered; on a CPU, past `CPU_GATHER_MAX_KEYS`, each
session is attended in place instead (docs/engine.md, "The KV pool").
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_buffers import outside_inference, rotate
from engine.kv_cache import KVCache
from engine.kv_pool import KEYS, ROTATED, VALUES

# On a CPU, a batch whose sessions hold more keys than this (summed, per KV head) is attended
# session by session in place rather than gathered (docs/engine.md: where gathering stops paying)
CPU_GATHER_MAX_KEYS = 4096


@dataclass(frozen=True)
class Member:
    """A session of the forward whose cache writes and attends in the pool (`KVCache.in_pool`)."""

    cache: KVCache
    start: int  # its new tokens are rows start .. start + count - 1 of the packed forward
    count: int


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, mask: torch.Tensor | None) -> torch.Tensor:
    """(1, c, q_heads, head_dim) the c new tokens' queries (1, q_heads, c, head_dim) over the N
    keys and values (1, kv_heads, N, head_dim), the last c of them their own, with `mask`
    (`CausalMasks`). The query heads that share a KV head are one longer run of queries over it
    (transformers' q heads g * group .. (g + 1) * group - 1 read KV head g), so no key or value
    is copied per query head."""
    _, q_heads, count, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.reshape(1, kv_heads, q_heads // kv_heads * count, dim)
    output = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return output.view(1, q_heads, count, dim).transpose(1, 2)


class CausalMasks:
    """The masks of one forward, each made once for every layer (SDPA would turn a boolean mask
    into one at every call)."""

    def __init__(self) -> None:
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}  # (group, c, N) -> mask

    def get(self, group: int, count: int, total: int, like: torch.Tensor) -> torch.Tensor | None:
        """(group * c, N) added to the attention's logits of c new tokens over N keys, the last
        c their own: each sees the keys up to itself (0), not those after it (-inf), in each of
        the `group` runs of queries; in `like`'s dtype. None for one token."""
        if count == 1:
            return None
        if (group, count, total) not in self._masks:
            hidden = torch.ones(count, total, dtype=torch.bool, device=like.device).triu(total - count + 1)
            mask = torch.zeros(count, total, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))
            self._masks[group, count, total] = mask.repeat(group, 1)
        return self._masks[group, count, total]


@dataclass(frozen=True)
class _Batch:
    """The members of a forward with `count` new tokens each, attended in one call: as E entries
    (B, or more with gaps) of a batch of keys, a view of the pool or its pages gathered; or,
    with `keys` None, each member in place."""

    count: int
    rows: torch.Tensor  # (B * c,) the members' new tokens' rows in the packed forward, member by member
    slots: list[tuple[int, int, int]]  # per member: its first slot in the pool, its keys (held + c), its first row
    keys: Callable[[torch.Tensor], torch.Tensor] | None = None  # a layer's (kv_heads, slots, head_dim) -> (E, kv_heads, N, head_dim)
    entries: torch.Tensor | None = None  # (B,) each member's entry among the E; None: the B in order
    size: int = 0  # E
    mask: torch.Tensor | None = None  # (E, 1, group * c, N)


class PoolStep:
    """The members' slots, positions and pages for one forward (the same in every layer)."""

    def __init__(self, members: list[Member], q_heads: int, like: torch.Tensor, masks: CausalMasks) -> None:
        first = members[0].cache
        self.masks = masks
        self.pool = first.lease.pool
        self.members = members
        self.scale = first.positions.scale
        device, page = like.device, self.pool.page_tokens
        slots, rows, cos, sin, minus_sin, kept, held = [], [], [], [], [], [], []
        for member in members:
            before = member.cache.hf.get_seq_length()
            start = member.cache.lease.first_page * page + before
            slots.append(torch.arange(start, start + member.count))
            rows.append(torch.arange(member.start, member.start + member.count))
            c, s, m = member.cache.incoming_rotations(before, member.count, like)
            cos.append(c), sin.append(s), minus_sin.append(m)
            kept.append(rows[-1][-member.cache.window_tokens :])
            held.append(before)
        self.slots = torch.cat(slots).to(device)
        self.rows = torch.cat(rows).to(device)
        self.cos, self.sin, self.minus_sin = torch.cat(cos), torch.cat(sin), torch.cat(minus_sin)
        self.kept_rows = torch.cat(kept).to(device)
        self.kept_counts = [len(k) for k in kept]
        self.kept: list[torch.Tensor | None] = [None] * first.num_layers  # per layer (q_heads, sum of kept, head_dim)
        self.scaling = [1.0] * first.num_layers
        kv_heads = self.pool.storage.shape[2]
        self.batches = [
            self._batch([(m, h) for m, h in zip(members, held, strict=True) if m.count == count], q_heads // kv_heads, like)
            for count in sorted({m.count for m in members})
        ]

    def _batch(self, members: list[tuple[Member, int]], group: int, like: torch.Tensor) -> _Batch:
        page, count, device = self.pool.page_tokens, members[0][0].count, like.device
        members = sorted(members, key=lambda member: member[0].cache.lease.first_page)
        rows = torch.cat([torch.arange(m.start, m.start + count) for m, _ in members]).to(device)
        slots = [(m.cache.lease.first_page * page, held + count, m.start) for m, held in members]
        firsts, totals = [first for first, _, _ in slots], [total for _, total, _ in slots]
        alone = _Batch(count, rows, slots)
        if len(members) == 1:
            return alone
        lease = members[0][0].cache.lease.tokens
        entries = [(first - firsts[0]) // lease for first in firsts]
        if all(m.cache.lease.tokens == lease for m, _ in members) and all(
            first - firsts[0] == entry * lease for first, entry in zip(firsts, entries, strict=True)
        ) and entries[-1] < 2 * len(members):
            # leases of one length, one after another (gaps at most as many as members): the
            # batch is a view of the pool, entry e the lease at firsts[0] + e * lease
            size, most = entries[-1] + 1, max(totals)

            def view(part: torch.Tensor) -> torch.Tensor:
                heads, slots_, dim = part.shape
                return part.as_strided(
                    (size, heads, most, dim), (lease * dim, slots_ * dim, dim, 1), part.storage_offset() + firsts[0] * dim
                )

            keys, index = view, torch.tensor(entries, device=device)
            for member, held in members:
                member.cache.lease.clean(held, most)
        elif device.type == "cpu" and sum(totals) > CPU_GATHER_MAX_KEYS:
            return alone
        else:  # each member's pages gathered, the last repeated up to the most pages of one
            pages = max(-(-total // page) for total in totals)
            index_pages = torch.cat([
                torch.arange(first // page, first // page + pages).clamp(max=first // page + -(-total // page) - 1)
                for first, total in zip(firsts, totals, strict=True)
            ]).to(device)
            size, most = len(members), pages * page

            def gathered(part: torch.Tensor) -> torch.Tensor:
                heads, _, dim = part.shape
                return part.view(heads, -1, page, dim).index_select(1, index_pages).view(heads, size, most, dim).transpose(0, 1)

            keys, index = gathered, torch.arange(size, device=device)
            for (member, held), total in zip(members, totals, strict=True):
                member.cache.lease.clean(held, -(-total // page) * page)
        # each member's query i sees its keys up to held + i; an entry of no member, its first key alone
        last = torch.zeros(size, count, dtype=torch.int64, device=device)
        last[index] = torch.tensor([total - count for total in totals], device=device)[:, None] + torch.arange(count, device=device)
        mask = None
        if count > 1 or size > len(members) or min(totals) < most:
            hidden = torch.arange(most, device=device)[None, None, :] > last[:, :, None]  # (E, c, N)
            mask = torch.zeros(hidden.shape, dtype=like.dtype, device=device).masked_fill_(hidden, float("-inf"))
            mask = mask.repeat(1, group, 1)[:, None]
        entries_index = None if size == len(members) else index
        return _Batch(count, rows, slots, keys, entries_index, size, mask)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The members' new keys (1, kv_heads, T, head_dim), rotated at their positions, and
        values into their slots of `layer`: stored keys, rotated keys and values."""
        keys, values = key[0].index_select(1, self.rows), value[0].index_select(1, self.rows)  # (kv_heads, T', head_dim)
        unrotated = rotate(keys, self.cos, self.minus_sin, 1 / self.scale)
        storage = self.pool.storage
        storage[KEYS, layer].index_copy_(1, self.slots, unrotated)
        storage[ROTATED, layer].index_copy_(1, self.slots, rotate(unrotated, self.cos, self.sin, self.scale))
        storage[VALUES, layer].index_copy_(1, self.slots, values)

    def attend(self, layer: int, query: torch.Tensor, scaling: float, out: torch.Tensor) -> None:
        """Write into `out` (1, T, q_heads, head_dim), at the members' rows, their new tokens'
        attention, given the forward's queries (1, q_heads, T, head_dim); keep the queries that
        the members' windows take."""
        with outside_inference():
            self.kept[layer] = query[0].detach().index_select(1, self.kept_rows)
        self.scaling[layer] = scaling
        keys, values = self.pool.storage[ROTATED, layer], self.pool.storage[VALUES, layer]  # (kv_heads, slots, head_dim)
        q_heads, dim = query.shape[1], query.shape[3]
        kv_heads = keys.shape[0]
        for batch in self.batches:  # one per count of new tokens: one, in a step of answer tokens
            if batch.keys is None:
                for first, total, row in batch.slots:
                    queries = query[:, :, row : row + batch.count]
                    mask = self.masks.get(q_heads // kv_heads, batch.count, total, query)
                    out[0, row : row + batch.count] = attend(
                        queries, keys[None, :, first : first + total], values[None, :, first : first + total], scaling, mask
                    )[0]
                continue
            members, count, group = len(batch.slots), batch.count, q_heads // kv_heads
            queries = query[0].index_select(1, batch.rows).view(kv_heads, group, members, count, dim)
            queries = queries.permute(2, 0, 1, 3, 4).reshape(members, kv_heads, group * count, dim)
            if batch.entries is not None:  # gaps between the members: entries of no one's queries
                queries = queries.new_zeros(batch.size, kv_heads, group * count, dim).index_copy_(0, batch.entries, queries)
            output = F.scaled_dot_product_attention(queries, batch.keys(keys), batch.keys(values), attn_mask=batch.mask, scale=scaling)
            if batch.entries is not None:
                output = output.index_select(0, batch.entries)
            output = output.view(members, kv_heads, group, count, dim).permute(0, 3, 1, 2, 4).reshape(members * count, q_heads, dim)
            out[0].index_copy_(0, batch.rows, output)

    def stored(self) -> None:
        """After the forward: each member holds its new tokens, and keeps its queries."""
        per_layer = [layer.split(self.kept_counts, dim=1) for layer in self.kept]  # per layer, per member
        for member, queries in zip(self.members, zip(*per_layer, strict=True), strict=True):
            member.cache.stored(member.count, queries, self.scaling)

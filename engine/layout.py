"""3-D rotary positions (Qwen's M-RoPE) of a cache's tokens, and how eviction re-encodes them.

A model with 3-D positions places each token at (time, height, width), each a section of the
rotary frequencies. Text advances all three together; the tokens of one visual group (a pair of
frames, merged into a grid of rows x columns) share one time and lie on their grid, at
(s, s + row, s + column), and what follows starts at s + max(rows, columns): transformers'
`get_rope_index` for a video of one temporal group. A prompt's layout, per token, is
(s - the prompt's first s, row, column), (0, 0) for text (`of_parts`).

Per layer, `Layout` holds per KV head and token its position (s, row, column), its group (the
stream place of its group's first token; a text token is a group of its own) and its row and
column on its group's own grid. After an eviction the kept tokens are re-encoded (`compact`):
per KV head, in stream order, each kept group starts where the one before ended, and spans the
more of the rows and the columns it keeps, numbered 0, 1, ... in their order. So s stays below
the number of tokens kept, whatever the stream's length, and tokens merged in (borrowed from a
host tier) add at most their number; a cache that evicted nothing holds exactly transformers'
positions (docs/engine.md, "Qwen2.5-VL and Qwen3-VL").
"""

from collections.abc import Sequence

import torch

SCALAR, ROW, COLUMN, GROUP, GRID_ROW, GRID_COLUMN = range(6)
FIELDS = 6


def of_parts(parts: Sequence[tuple[int, tuple[int, int] | None]]) -> torch.Tensor:
    """(c, 3) a prompt's layout: per token (s from the prompt's first, row, column), given its
    parts as (tokens, grid): a visual group on a grid of (rows, columns), row by row, or text
    (grid None), a token a step."""
    rows, start = [], 0
    for tokens, grid in parts:
        if grid is None:
            steps = torch.arange(start, start + tokens)
            rows.append(torch.stack([steps, torch.zeros_like(steps), torch.zeros_like(steps)], dim=1))
            start += tokens
            continue
        height, width = grid
        if height * width != tokens:
            raise ValueError(f"a visual group of {tokens} tokens on a grid of {height}x{width}")
        cells = torch.arange(tokens)
        rows.append(torch.stack([torch.full((tokens,), start), cells // width, cells % width], dim=1))
        start += max(height, width)
    return torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.long)


def arriving(layout: torch.Tensor, base: int, place: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's tokens placed after a cache whose next position is `base` and next stream place
    `place`: their 3-D positions (3, c) for the model, and what the cache keeps of them (FIELDS, c)."""
    scalar = layout[:, 0] + base
    row, column = layout[:, 1], layout[:, 2]
    positions = torch.stack([scalar, scalar + row, scalar + column])
    first = torch.searchsorted(layout[:, 0].contiguous(), layout[:, 0].contiguous())  # each token's group's first token
    kept = torch.stack([scalar, row, column, first + place, row, column])
    return positions, kept


def positions_of(rows: torch.Tensor) -> torch.Tensor:
    """(..., 3) the 3-D positions of tokens' rows (FIELDS, ...)."""
    return torch.stack([rows[SCALAR], rows[SCALAR] + rows[ROW], rows[SCALAR] + rows[COLUMN]], dim=-1)


GRID_BITS = 20  # of each of a token's index in its group, its grid row and its grid column, packed
GRID_MASK = (1 << GRID_BITS) - 1


def pack(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(...) int64 what a host tier keeps of tokens' layouts, given their rows (FIELDS, ...) and
    stream places (...): each one's index in its group (its place less its group's), grid row
    and grid column, GRID_BITS bits each. Their positions are made again when they come back."""
    return ((order - rows[GROUP]) << 2 * GRID_BITS) | (rows[GRID_ROW] << GRID_BITS) | rows[GRID_COLUMN]


def unpack(grids: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(FIELDS, ...) the rows of `pack`ed tokens, their positions 0 (to be re-encoded)."""
    rows = torch.zeros(FIELDS, *grids.shape, dtype=torch.long)
    rows[GROUP] = order - (grids >> 2 * GRID_BITS)
    rows[GRID_ROW], rows[GRID_COLUMN] = (grids >> GRID_BITS) & GRID_MASK, grids & GRID_MASK
    return rows


def _rank_within(group: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(kv_heads, n) each token's value's rank among the distinct values of its group's tokens."""
    key = group * (int(value.max()) + 1) + value
    ordered, order = key.sort(dim=1, stable=True)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    rank = new.long().cumsum(dim=1) - 1  # among every distinct (group, value), in order
    grouped = group.gather(1, order)
    first = torch.ones_like(grouped, dtype=torch.bool)
    first[:, 1:] = grouped[:, 1:] != grouped[:, :-1]
    base = torch.where(first, rank, torch.zeros_like(rank)).cummax(dim=1).values  # the group's first value's rank
    return torch.empty_like(rank).scatter_(1, order, rank - base)


def compact(group: torch.Tensor, grid_row: torch.Tensor, grid_column: torch.Tensor) -> torch.Tensor:
    """(3, kv_heads, n) the re-encoded s, row and column of kept tokens, in stream order per KV
    head, given each one's group and place on its group's grid (kv_heads, n). Each row is its
    own: the layers' KV heads may come as one (layers * kv_heads, n)."""
    if group.shape[1] == 0:
        return torch.zeros(3, *group.shape, dtype=torch.long)
    row, column = _rank_within(group, grid_row), _rank_within(group, grid_column)
    starts = torch.ones_like(group, dtype=torch.bool)
    starts[:, 1:] = group[:, 1:] != group[:, :-1]
    index = starts.long().cumsum(dim=1) - 1  # (kv_heads, n) which kept group, in order
    span = torch.zeros_like(group).scatter_reduce_(1, index, torch.maximum(row, column) + 1, "amax")
    first = span.cumsum(dim=1) - span
    return torch.stack([first.gather(1, index), row, column])


class Layout:
    """One layer's tokens' FIELDS per KV head: `rows` (FIELDS, kv_heads, n) int64, in a buffer with
    room after them, so that a forward appends its tokens in place."""

    def __init__(self, kv_heads: int) -> None:
        self._buffer = torch.zeros(FIELDS, kv_heads, 0, dtype=torch.long)
        self._length = 0
        self._next: int | None = 0  # the next position, while known
        self.incoming: torch.Tensor | None = None  # (FIELDS, c) of the tokens the next forward stores

    @property
    def rows(self) -> torch.Tensor:
        return self._buffer[:, :, : self._length]

    @rows.setter
    def rows(self, rows: torch.Tensor) -> None:
        self._buffer, self._length, self._next = rows.clone(), rows.shape[2], None

    def positions(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """(kv_heads, m, 3) the 3-D positions of the tokens [start, end)."""
        return positions_of(self.rows[:, :, start:end])

    @property
    def tokens(self) -> int:
        return self._length

    def stored(self) -> torch.Tensor:
        """The forward's new tokens are stored: hold their rows; returns their positions (c, 3)."""
        new = self.incoming
        if new is None:
            raise RuntimeError("a forward stores tokens without their 3-D positions")
        end = self._length + new.shape[1]
        if end > self._buffer.shape[2]:
            with torch.inference_mode(False):  # kept across steps (engine/kv_cache.py's rule): made outside the forward's mode
                grown = torch.empty(FIELDS, self._buffer.shape[1], max(end, self._buffer.shape[2] * 3 // 2), dtype=torch.long)
                grown[:, :, : self._length] = self.rows
            self._buffer = grown
        self._buffer[:, :, self._length : end] = new[:, None]
        self._length = end
        if self._next is not None:
            self._next = max(self._next, int((new[SCALAR] + torch.maximum(new[ROW], new[COLUMN])).max()) + 1)
        return positions_of(new)

    def cut(self, count: int) -> None:
        if count < self._length:
            self._length, self._next = count, None

    def take(self, index: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """(FIELDS, kv_heads, k) the rows of the tokens at `index` (kv_heads, k) among the first
        `width` (all when None)."""
        return self.rows[:, :, :width].gather(2, index.cpu()[None].expand(FIELDS, -1, -1))

    def keep(self, index: torch.Tensor) -> None:
        """Hold the tokens at `index` (kv_heads, k), ascending per KV head, re-encoded (`compact`)."""
        self.hold(self.take(index))

    def give_back(self, index: torch.Tensor, width: int) -> None:
        """Hold the tokens at `index` (kv_heads, k) among the first `width`, then those after them,
        each at its position (a borrowing given back leaves gaps, which the next eviction closes)."""
        self.rows = torch.cat([self.take(index, width), self.rows[:, :, width:]], dim=2)

    def hold(self, rows: torch.Tensor, encoded: bool = False) -> None:
        """Hold these tokens' rows (FIELDS, kv_heads, k), in stream order per KV head, re-encoded
        unless `encoded` (they are already)."""
        if not encoded:
            rows[:GROUP] = compact(rows[GROUP], rows[GRID_ROW], rows[GRID_COLUMN])
        if rows.shape[2] > self._buffer.shape[2]:
            self.rows = rows
            return
        self._buffer[:, :, : rows.shape[2]] = rows
        self._length, self._next = rows.shape[2], None

    def merge(self, merged: torch.Tensor, held: int) -> None:
        """Hold `merged` (FIELDS, kv_heads, m), re-encoded (the first `held` tokens and those
        borrowed, in stream order), then the tokens after the first `held` (a forward's new
        ones, at the positions they ran at, after the places reserved for the borrowed)."""
        self.hold(torch.cat([merged, self.rows[:, :, held:]], dim=2), encoded=True)

    def next_position(self) -> int:
        """Where the next token goes: after the furthest any KV head's tokens reach."""
        if self._next is None:
            rows = self.rows
            reach = rows[SCALAR] + torch.maximum(rows[ROW], rows[COLUMN])
            self._next = int(reach.max()) + 1 if self._length else 0
        return self._next

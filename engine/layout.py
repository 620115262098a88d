"""3-D rotary positions (Qwen's M-RoPE) of a cache's tokens, and how eviction re-encodes them.

A model with 3-D positions places each token at (time, height, width), each a section of the
rotary frequencies. Text advances all three together; the tokens of one visual group (a pair of
frames, merged into a grid of rows x columns) share one time and lie on their grid, at
(s, s + row, s + column), and what follows starts at s + max(rows, columns): transformers'
`get_rope_index` for a video of one temporal group. A prompt's layout, per token, is
(s - the prompt's first s, row, column), (0, 0) for text (`of_parts`).

Each token's position is then a scalar s (the same in all three) plus an offset (0, row, column)
that never changes. The cache stores each key turned back from s alone, so the offset's rotation
stays in the stored key (applied once, by the model), and rotates it at s when it is read, as it
does for a model with 1-D positions; moving a token to another s is again one rotation from the
stored key.

Per layer, `Layout` holds per KV head and token: s, the token's group (the stream place of its
group's first token; a text token is a group of its own) and its extent (max(row, column)). After
an eviction the kept tokens are re-encoded (`compact`): per KV head, in stream order, each kept
group starts where the one before ended and spans the rows and columns it keeps (its largest
extent + 1). Height and width keep their place within a frame; time follows the order of the kept
groups; text advances all three. So s stays below the number of tokens kept, whatever the
stream's length, and a cache that evicted nothing holds exactly transformers' positions.
"""

from collections.abc import Sequence

import torch

SCALAR, GROUP, EXTENT = 0, 1, 2


def of_parts(parts: Sequence[tuple[int, tuple[int, int] | None]]) -> torch.Tensor:
    """(c, 3) a prompt's layout: per token (s from the prompt's first, row, column), given its
    parts as (tokens, grid): a visual group on a grid of (rows, columns), row by row, or text
    (grid None), a token a step."""
    rows = []
    start = 0
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
    `place`: their 3-D positions (3, c) for the model, and what the cache keeps of them (3, c):
    s, group, extent."""
    scalar = layout[:, 0] + base
    positions = torch.stack([scalar, scalar + layout[:, 1], scalar + layout[:, 2]])
    first = torch.searchsorted(layout[:, 0].contiguous(), layout[:, 0].contiguous())  # each token's group's first token
    kept = torch.stack([scalar, first + place, layout[:, 1:].amax(dim=1)])
    return positions, kept


def compact(group: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
    """(kv_heads, n) the re-encoded s of kept tokens, in stream order per KV head, given each
    one's group and extent (kv_heads, n): each group after the last, spanning its largest extent + 1."""
    heads, count = group.shape
    if count == 0:
        return group.clone()
    starts = torch.ones_like(group, dtype=torch.bool)
    starts[:, 1:] = group[:, 1:] != group[:, :-1]
    index = starts.long().cumsum(dim=1) - 1  # (kv_heads, n) which kept group, in order
    span = torch.zeros_like(group).scatter_reduce_(1, index, extent + 1, "amax")
    first = span.cumsum(dim=1) - span
    return first.gather(1, index)


class Layout:
    """One layer's tokens' s, group and extent, per KV head: `rows` (3, kv_heads, n) int64, in a
    buffer with room after them, so that a forward appends its tokens in place."""

    def __init__(self, kv_heads: int) -> None:
        self._buffer = torch.zeros(3, kv_heads, 0, dtype=torch.long)
        self._length = 0
        self._next: int | None = 0  # the next position, while known
        self.incoming: torch.Tensor | None = None  # (3, c) of the tokens the next forward stores

    @property
    def rows(self) -> torch.Tensor:
        return self._buffer[:, :, : self._length]

    @rows.setter
    def rows(self, rows: torch.Tensor) -> None:
        self._buffer, self._length, self._next = rows.clone(), rows.shape[2], None

    @property
    def scalar(self) -> torch.Tensor:
        return self.rows[SCALAR]

    @property
    def tokens(self) -> int:
        return self._length

    def stored(self) -> torch.Tensor:
        """The forward's new tokens are stored: hold their rows; returns their s (c,)."""
        new = self.incoming
        if new is None:
            raise RuntimeError("a forward stores tokens without their 3-D positions")
        end = self._length + new.shape[1]
        if end > self._buffer.shape[2]:
            with torch.inference_mode(False):  # kept across steps (engine/kv_cache.py's rule): made outside the forward's mode
                grown = torch.empty(3, self._buffer.shape[1], max(end, self._buffer.shape[2] * 3 // 2), dtype=torch.long)
                grown[:, :, : self._length] = self.rows
            self._buffer = grown
        self._buffer[:, :, self._length : end] = new[:, None]
        self._length = end
        if self._next is not None:
            self._next = max(self._next, int((new[SCALAR] + new[EXTENT]).max()) + 1)
        return new[SCALAR]

    def cut(self, count: int) -> None:
        if count < self._length:
            self._length, self._next = count, None

    def keep(self, index: torch.Tensor) -> None:
        """Hold the tokens at `index` (kv_heads, k), ascending per KV head, re-encoded (`compact`)."""
        rows = self.rows.gather(2, index.cpu()[None].expand(3, -1, -1))
        rows[SCALAR] = compact(rows[GROUP], rows[EXTENT])
        self._buffer[:, :, : rows.shape[2]] = rows
        self._length, self._next = rows.shape[2], None

    def next_position(self) -> int:
        """Where the next token goes: after the furthest any KV head's tokens reach."""
        if self._next is None:
            rows = self.rows
            self._next = int((rows[SCALAR] + rows[EXTENT]).max()) + 1 if self._length else 0
        return self._next

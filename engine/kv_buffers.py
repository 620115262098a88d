"""The buffers under a session's KV cache, and the rotary tables that place its keys.

Per layer, keys as they were before the rotary embedding, values, and (while a prompt or an
answer runs) a copy of the keys rotated at their indices, each in a buffer with room after its
tokens (`Rows`), so that a forward writes only its new tokens, in place; `PreRopeLayer` is the
transformers cache layer over them. What moves tokens (eviction, borrowing, give-back) and what
they mean (kind, time, place) is `engine/kv_cache.py`'s.

One rule for every tensor a session keeps from one step to the next (these buffers, each token's
kind, time and place, the last queries, the rotary tables, the host tier, the session's counters
and last logits): it is made `outside_inference`, or cloned there. Only the model's forward runs
in inference mode, and a tensor made in it cannot be changed in place outside it: without the
rule, state made in a step of several sessions would fail the session's next step alone.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.layout import Layout


@contextmanager
def outside_inference() -> Iterator[None]:
    """Where the tensors a session keeps across steps are made: plain tensors, which a later step
    may change in place whether or not it runs in inference mode; and no gradient."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def rotations(rotary: nn.Module, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (*positions.shape, head_dim) of the pure rotation by `positions`, with the
    model's own frequencies, in float32 (without the rotary embedding's `attention_scaling`),
    the first half of sin negated: what `rotate` takes."""
    cos, sin = rotary(like.float(), positions.to(like.device).reshape(1, -1))
    scale = getattr(rotary, "attention_scaling", 1.0)
    shape = (*positions.shape, cos.shape[-1])
    half = cos.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return (cos / scale).reshape(shape), (sin / scale).reshape(shape)


def rotate(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys (..., n, head_dim) rotated by angles whose cos and (half-negated) sin are (n, head_dim),
    times `scale`, computed in float32: the model's `k * cos + rotate_half(k) * sin`, in the
    fewest passes over the keys (rotate_half(k) * sin is the halves of k swapped, times the
    half-negated sin; the same products, so the same bits). Written into `out` (of the keys'
    shape and dtype, a place in a buffer) when given, and returned."""
    k = keys.float()
    half = k.shape[-1] // 2
    swapped = k.roll(half, dims=-1).mul_(sin)
    if out is not None and out.dtype == k.dtype and scale == 1.0:
        return torch.mul(k, cos, out=out).add_(swapped)
    rotated = (k * cos).add_(swapped)
    if scale != 1.0:
        rotated.mul_(scale)
    return rotated.to(keys.dtype) if out is None else out.copy_(rotated)


class PositionTable:
    """cos and (half-negated) sin of positions 0, 1, 2, ... of one model, grown as needed (a few
    MB), and the sin of minus those positions."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        self.scale = float(getattr(rotary, "attention_scaling", 1.0))  # the model rotates keys, then scales
        self.cos = self.sin = self.minus_sin = torch.empty(0, 0)
        self._last: tuple = ()  # the last `between`: every layer of a forward asks for the same positions
        self._axes: torch.Tensor | None = None

    def up_to(self, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, head_dim) cos and sin of positions 0..count-1, on `like`'s device."""
        if self.cos.shape[0] < count or self.cos.device != like.device:
            size = max(count, 2 * self.cos.shape[0])
            with outside_inference():
                self.cos, self.sin = rotations(self.rotary, torch.arange(size), like)
                self.minus_sin = -self.sin
        return self.cos[:count], self.sin[:count]

    def between(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(end - start, head_dim) cos, sin and minus sin of positions start..end-1."""
        key = (start, end, like.device)
        if self._last[:3] != key:
            self.up_to(end, like)
            self._last = (*key, self.cos[start:end], self.sin[start:end], self.minus_sin[start:end])
        return self._last[3:]

    def at3(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., head_dim) cos, sin and minus sin of 3-D positions (..., 3) (time, height, width):
        each rotary dimension turns by the axis the model gives it (`axes`)."""
        self.up_to(int(positions.max()) + 1 if positions.numel() else 0, like)
        dim = self.cos.shape[1]
        index = positions.to(self.cos.device)[..., self.axes(like)].reshape(-1, dim)  # (N, head_dim): each dimension's position
        shape = (*positions.shape[:-1], dim)
        return tuple(table.gather(0, index).view(shape) for table in (self.cos, self.sin, self.minus_sin))

    def axes(self, like: torch.Tensor) -> torch.Tensor:
        """(head_dim,) which axis of a 3-D position each rotary dimension turns by (0 time, 1
        height, 2 width), read off the model's rotary embedding: a position of 1 on one axis
        turns only that axis's dimensions."""
        if self._axes is None or self._axes.device != like.device:
            probe = torch.eye(3, dtype=torch.long, device=like.device)[:, None, :]  # (axes, 1, 3): token a at 1 on axis a
            with outside_inference():
                _, sin = self.rotary(like.float(), probe)  # (1, 3, head_dim)
                self._axes = sin[0].abs().argmax(dim=0)
        return self._axes


GROWTH = 1.5  # a full buffer is copied into one this many times the tokens it must hold


class Rows:
    """(1, kv_heads, n, head_dim) tokens in a buffer with room after them: appending writes in
    place, and only a full buffer is copied, into one GROWTH times what it must hold but no
    larger than `most` (unless it must hold more), so its storage never exceeds GROWTH times
    the most tokens it held, nor `most` when it held no more. `tokens` is a view of the n
    tokens: an append leaves earlier views as they were, an assignment writes over them.

    With a `home` (a session's slots in the worker's pool, `engine/kv_pool.py`), the buffer
    is the home, allocated once: tokens past it (which a session's lease is sized never to
    need) go to a buffer of their own until the tokens fit the home again."""

    def __init__(self, most: int | None = None, home: torch.Tensor | None = None) -> None:
        self.buffer: torch.Tensor | None = None  # (1, kv_heads, capacity, head_dim)
        self.length = 0
        self.most = most
        self.home = home  # (1, kv_heads, slots, head_dim)

    @property
    def tokens(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer.narrow(2, 0, self.length)

    def append(self, new: torch.Tensor) -> None:
        """`new` (1, kv_heads, c, head_dim) after the n tokens."""
        self.extend(new.shape[2], new).copy_(new)

    def extend(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """`count` more tokens of `like`'s kind after the n: their places (1, kv_heads, count,
        head_dim), for the caller to write."""
        end = self.length + count
        if self.buffer is None or end > self.buffer.shape[2]:
            self._grow(end, like, keep=True)
        places = self.buffer.narrow(2, self.length, count)
        self.length = end
        return places

    def assign(self, tokens: torch.Tensor | None) -> bool:
        """Hold `tokens` (1, kv_heads, n, head_dim) instead (None: nothing, and no buffer).
        Returns True when they are the first of the tokens held (a cut, as a rollback makes):
        then nothing moves."""
        buffer = self.buffer
        if tokens is None:
            self.buffer, self.length = None, 0
            return False
        count = tokens.shape[2]
        if buffer is not None and tokens.data_ptr() == buffer.data_ptr() and tokens.stride() == buffer.stride():
            if count <= self.length and tokens.dtype == buffer.dtype:
                self.length = count
                return True
        if buffer is not None and tokens.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            tokens = tokens.clone()  # other tokens of this buffer (or of the pool): they would be written over
        if buffer is not self.home and self._home_fits(count, tokens):
            self.buffer = self.home  # back home from a buffer of its own
        elif buffer is None or count > buffer.shape[2] or _kind(buffer) != _kind(tokens):
            self._grow(count, tokens, keep=False)
        self.buffer.narrow(2, 0, count).copy_(tokens)
        self.length = count
        return False

    def _grow(self, count: int, like: torch.Tensor, keep: bool) -> None:
        """A new buffer with room for GROWTH times `count` tokens of `like`'s kind; `keep`: with
        the n tokens held copied in."""
        if self._home_fits(count, like):
            if keep and self.length and self.buffer is not self.home:
                self.home.narrow(2, 0, self.length).copy_(self.buffer.narrow(2, 0, self.length))
            self.buffer = self.home
            return
        _, heads, _, dim = like.shape
        size = math.ceil(GROWTH * count)
        if self.most is not None:
            size = max(count, min(size, self.most))
        with outside_inference():
            buffer = torch.empty(1, heads, size, dim, dtype=like.dtype, device=like.device)
        if keep and self.length:
            buffer.narrow(2, 0, self.length).copy_(self.buffer.narrow(2, 0, self.length))
        self.buffer = buffer

    def _home_fits(self, count: int, like: torch.Tensor) -> bool:
        return self.home is not None and count <= self.home.shape[2] and _kind(self.home) == _kind(like)


def _kind(tokens: torch.Tensor) -> tuple:
    """What a buffer shares with the tokens (1, kv_heads, n, head_dim) it holds: kv_heads, head_dim, dtype and device."""
    return tokens.shape[1], tokens.shape[3], tokens.dtype, tokens.device


class PreRopeLayer(DynamicLayer):
    """A transformers cache layer that stores keys as they were before the rotary embedding: the
    model hands it keys rotated at their positions (their indices), and it turns them back.

    Beside them it keeps `rotated()`, the same keys rotated at their indices: appending rotates
    the new keys into it, and assigning `keys` (which is how an eviction, a borrowing, a
    give-back or a rollback moves tokens) empties it (a cut keeps what it holds of the tokens
    left), to be made again from the stored keys when next read. Each key is rotated
    the same way whenever it is, so the copy is bit for bit what rotating every stored key from
    scratch gives. Keys, values and the copy are each in a buffer with room for more tokens
    (`Rows`, no larger than `most_tokens` while they hold no more, or a session's slots in the
    worker's pool: `homes`, of keys, values and the copy), so that a forward writes only its new
    tokens; what `keys`, `values`, `update` and `rotated` return are views, valid until the next
    assignment.

    With a `layout` (a model with 3-D positions, `engine/layout.py`), a token's position is its
    3-D position there rather than its index: keys are turned back from it and rotated at it. A
    cut (a rollback) cuts the layout too; what moves tokens otherwise moves its rows (`Layout.keep`)."""

    def __init__(
        self, table: PositionTable, most_tokens: int | None = None, homes: tuple[torch.Tensor | None, ...] = (None, None, None),
        layout: Layout | None = None,
    ) -> None:
        self.most_tokens = most_tokens
        self._keys, self._values = Rows(most_tokens, homes[0]), Rows(most_tokens, homes[1])
        self._rotated_home = homes[2]
        self._rotated: Rows | None = None  # its first `length` tokens: the first keys, rotated
        super().__init__()
        self.table = table
        self.pending = 0  # places reserved for borrowed tokens that this layer has yet to bring in
        self.layout = layout

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys.tokens

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        cut = self._keys.assign(keys)
        if cut and self.layout is not None:
            self.layout.cut(self._keys.length)
        if self._rotated is not None:  # tokens may sit at other indices now, unless cut
            self._rotated.length = min(self._rotated.length, self._keys.length) if cut else 0

    @property
    def values(self) -> torch.Tensor | None:
        return self._values.tokens

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._values.assign(values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self._keys.length + self.pending

    def reserve(self, places: int) -> None:
        """Places for borrowed tokens, brought in before the next forward's own (0: none)."""
        self.pending = places

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self._keys.length
        start = held + self.pending
        count = key_states.shape[-2]
        if self.layout is not None:
            cos, sin, minus_sin = self.table.at3(self.layout.stored(), key_states)
        else:
            cos, sin, minus_sin = self.table.between(start, start + count, key_states)
        unrotated = rotate(key_states, cos, minus_sin, 1 / self.table.scale, out=self._keys.extend(count, key_states))
        self._values.append(value_states)
        copy = self._rotated
        if copy is not None and copy.length == held and not self.pending:  # the new keys' positions are their indices
            rotate(unrotated, cos, sin, self.table.scale, out=copy.extend(count, unrotated))
        return self.keys, self.values

    def in_pool(self, count: int) -> bool:
        """Whether a forward may write `count` new tokens straight into this layer's slots in the
        pool (`engine/pool_attention.py`): keys, values and the rotated copy all there, with room
        for them, and nothing to borrow first. Brings the rotated copy up to date (what an
        eviction moved) so that the forward only adds the new tokens to it."""
        keys, values = self._keys, self._values
        if self.pending or not self.is_initialized or keys.home is None:
            return False
        if keys.buffer is not keys.home or values.buffer is not values.home or keys.length + count > keys.home.shape[2]:
            return False
        self._rotate_up_to_date()
        return self._rotated.buffer is self._rotated.home

    def merge(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        """Hold instead, per KV head, the tokens at `rows` (kv_heads, m) of [the tokens held, then
        `keys` and `values` (1, kv_heads, k, head_dim)], as a borrowing merges tokens among those
        held; and rotate the keys into the copy now, while they are in the processor's cache."""
        self._keys.append(keys)
        self._values.append(values)
        self.keys, self.values = take(self.keys, rows), take(self.values, rows)  # the copy emptied
        self._rotate_up_to_date()  # with a layout, its rows merged already (`Layout.merge`)

    def at_home(self, tokens: int) -> bool:
        """Whether keys, values and the rotated copy are all in this layer's slots in the pool,
        with room for `tokens`: then the pool may move them for it (`Lease.merge`)."""
        keys, values, copy = self._keys, self._values, self._rotated
        return (
            keys.home is not None and keys.buffer is keys.home and values.buffer is values.home
            and self._rotated_home is not None and (copy is None or copy.buffer in (None, copy.home))
            and tokens <= keys.home.shape[2]
        )

    def merged(self, count: int) -> None:
        """After the pool merged tokens into this layer's slots and rotated them into the copy
        (`Lease.merge`): hold the first `count`."""
        for rows in (self._keys, self._values, self._copy()):
            rows.buffer, rows.length = rows.home, count

    def wrote(self, count: int) -> None:
        """After a forward wrote `count` new tokens into this layer's slots (`in_pool`): hold them
        (and, with a layout, their rows)."""
        for rows in (self._keys, self._values, self._rotated):
            rows.length += count
        if self.layout is not None:
            self.layout.stored()

    def leave_home(self) -> None:
        """Hold nothing, and no more in the pool's slots (`homes`)."""
        self.keys = self.values = None
        self._keys.home = self._values.home = self._rotated_home = self._rotated = None

    def _copy(self) -> Rows:
        if self._rotated is None:
            self._rotated = Rows(self.most_tokens, self._rotated_home)
        return self._rotated

    def rotated(self) -> torch.Tensor:
        """(1, kv_heads, N, head_dim) the stored keys rotated at their positions: their indices,
        or their 3-D positions in the layout."""
        self._rotate_up_to_date()
        return self._rotated.tokens

    def _rotate_up_to_date(self) -> None:
        """Rotate into the copy the stored keys it lacks (those appended or merged since)."""
        done, total = self._copy().length, self._keys.length
        if done < total:
            stored = self._keys.buffer.narrow(2, done, total - done)
            if self.layout is not None:
                cos, sin, _ = self.table.at3(self.layout.positions(done, total), stored)  # (kv_heads, m, head_dim)
            else:
                cos, sin, _ = self.table.between(done, total, stored)
            rotate(stored, cos, sin, self.table.scale, out=self._rotated.extend(total - done, stored))


def take(tokens: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(..., kv_heads, k, head_dim) each KV head's tokens of (..., kv_heads, N, head_dim) at its
    own indices (..., kv_heads, k) (the leading dimensions of `index` may be dropped where the
    tokens' are 1, as with one layer (1, kv_heads, N, head_dim)): whole rows copied
    (index_select), many times faster than a gather with an index expanded over head_dim, and
    the same values. Written into `out` (as many rows of head_dim, e.g. pinned memory) when given."""
    *lead, total, dim = tokens.shape
    rows = index.reshape(-1, index.shape[-1])
    strides = [stride for size, stride in zip(lead, tokens.stride()[:-2]) if size > 1]
    if tokens.is_contiguous() or tokens.stride()[-2:] != (dim, 1) or any(s % dim for s in strides) or tokens.storage_offset() % dim:
        source = tokens.reshape(-1, dim)
        starts = torch.arange(rows.shape[0], device=index.device) * total
    else:  # a view of a buffer, the KV pool or a host pool: its rows read where they lie, without copying the view whole first
        source = tokens.as_strided((tokens.untyped_storage().nbytes() // (dim * tokens.element_size()), dim), (dim, 1), 0)
        starts = torch.full((), tokens.storage_offset() // dim, device=index.device)
        for size, stride in zip(lead, tokens.stride()[:-2]):  # each leading index's first row, in order
            starts = starts[..., None] + torch.arange(size, device=index.device) * (stride // dim)
        starts = starts.reshape(-1)
    rows = (rows + starts[:, None]).reshape(-1)
    return torch.index_select(source, 0, rows, out=out).view(*lead, -1, dim)


class QueryWindow:
    """A layer's last queries, at most `size` (q_heads, w, head_dim): a forward adds its own
    without a copy, and they are joined when read, or when `size` additions wait (so it holds
    the queries of at most `size` + 1 forwards)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.parts: list[torch.Tensor] = []  # (q_heads, c, head_dim) each, oldest first

    def add(self, queries: torch.Tensor) -> None:
        """Keeps a copy of what it needs: the forward's queries are inference tensors, and
        `KVCache.attend` calls this `outside_inference`."""
        self.keep(queries[:, -self.size :].clone())

    def keep(self, queries: torch.Tensor) -> None:
        """`add` for queries that are already the window's own (a copy no one else changes)."""
        if queries.shape[1] >= self.size:
            self.parts = [queries[:, -self.size :]]
            return
        self.parts.append(queries)
        if len(self.parts) > self.size:
            self.read()

    def read(self) -> torch.Tensor | None:
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts, dim=1)[:, -self.size :]]
        return self.parts[0] if self.parts else None

    def set(self, queries: torch.Tensor | None) -> None:
        self.parts = [] if queries is None else [queries[:, -self.size :]]


class LayerStore(DynamicCache):
    """The transformers cache a forward takes: one `PreRopeLayer` per layer."""

    def __init__(self, layers: list[PreRopeLayer]) -> None:
        Cache.__init__(self, layers=layers)

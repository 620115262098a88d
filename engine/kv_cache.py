"""A session's KV cache, bounded by an eviction policy: append, evict, and positions by index.

Per layer, in a transformers cache: keys and values (1, kv_heads, n, head_dim). Beside them,
per KV head and token (kv_heads, n): the token's kind (TEXT or FRAME) and the video time it
came from. Each KV head may keep different tokens, but every head of every layer keeps the same
number, n.

Positions are re-encoded at every eviction: a token's position is always its index 0..n-1, so
positions never exceed the cache's peak size. The keys are kept as they were before the rotary
embedding, and beside them a copy rotated at their indices, which the attention reads: a forward
rotates only its new tokens into it, and whatever moves tokens (an eviction, a borrowing, a
give-back) has it made again from the stored keys at the next forward. So an eviction is a
gather, and what the attention sees is always one rotation away from what the model computed
(docs/engine.md, "Positions": rotating rotated keys lets bfloat16's rounding build up).

A model with 3-D positions (Qwen2.5-VL, Qwen3-VL) places tokens by each layer's `Layout`
instead (`engine/layout.py`): keys are turned back from, and rotated at, each token's 3-D
position there, and an eviction, a borrowing or a give-back moves its rows with the tokens; an
eviction (or a borrowing) re-encodes them.

With a host tier (`engine/host_tier.py`), what an eviction removes moves there instead of
being dropped, and a question may borrow pages back (`engine/loan.py`).

The buffers of keys, values and the rotated copy (room after their tokens, so a forward writes
only its new ones), and the rotary tables, are `engine/kv_buffers.py`'s, as is the rule that
every tensor a session keeps across steps is made `outside_inference`. Here is what moves tokens
among them with each token's kind, time and place, which must move together (append, evict; a
borrowing's rows: `lent`, `gave_back`).
"""

import time
from collections.abc import Callable

import torch
from torch import nn

from engine.host_tier import HostTier, Tokens
from engine.kv_buffers import LayerStore, PositionTable, PreRopeLayer, QueryWindow, outside_inference, rotate, take
from engine.kv_pool import KEYS, ROTATED, VALUES, Lease
from engine.layout import Layout, pack, positions_of
from engine.loan import Loan, MergePlan, borrow, give_back
from engine.policies import Observation, Policy, causal_attention

TEXT, FRAME = 0, 1
MERGE_EVERY = 64  # forwards whose tokens' kinds and times may wait before every layer gets them


class KVCache:
    def __init__(
        self, policy: Policy, rotary: nn.Module, num_layers: int, kv_heads: int, evidence_window: int = 32,
        host: HostTier | None = None, most_tokens: int | None = None, lease: Lease | None = None, positions_3d: bool = False,
    ) -> None:
        """`most_tokens`: the most the cache is expected to hold at once; its buffers grow past
        it only when it holds more. `lease`: its slots in the worker's pool, which its buffers
        are instead (`engine/kv_pool.py`). `positions_3d`: the model places tokens in 3-D
        (`engine/layout.py`): each layer keeps their layout, re-encoded at every eviction."""
        self.policy = policy
        self.kv_heads = kv_heads
        self.evidence_window = evidence_window
        self.positions = PositionTable(rotary)
        self.lease = lease
        self.hf: LayerStore = LayerStore([
            PreRopeLayer(self.positions, most_tokens, self._homes(layer), Layout(kv_heads) if positions_3d else None)
            for layer in range(num_layers)
        ])
        self._kinds = [torch.empty(kv_heads, 0, dtype=torch.int8) for _ in range(num_layers)]
        self._times = [torch.empty(kv_heads, 0) for _ in range(num_layers)]
        self._order = [torch.empty(kv_heads, 0, dtype=torch.int64) for _ in range(num_layers)]  # place in the stream
        # The kinds and times (c,) of the last forwards, not yet in every layer's (`_merge`)
        self._unmerged: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._unmerged_tokens = 0
        self.appended = 0  # tokens appended so far: the next token's place in the stream
        self.host = host
        self.loan = Loan()  # what questions borrow from the host tier
        self.scores: list[torch.Tensor | None] = [None] * num_layers  # (kv_heads, n) for keeps_scores
        # Stream places never evicted (`pin`): the opening's, then those of each pinned turn
        self.pins: list[torch.Tensor] = []
        # Since the last eviction: each layer's last queries (q_heads, w, head_dim), at most
        # `window_tokens` (for the next eviction and evidence), and (for policies that
        # accumulate) the attention each key received.
        self.window_tokens = max(policy.window_tokens if policy.needs_attention else 0, evidence_window)
        self._queries = [QueryWindow(self.window_tokens) for _ in range(num_layers)]
        self._received: list[torch.Tensor | None] = [None] * num_layers
        self._scaling = [1.0] * num_layers
        self.evictions = 0
        self.evicted_tokens = 0
        self.evict_s = 0.0
        self.max_position = -1

    def _homes(self, layer: int) -> tuple[torch.Tensor | None, ...]:
        if self.lease is None:
            return (None, None, None)
        return tuple(self.lease.rows(part, layer) for part in (KEYS, VALUES, ROTATED))

    def release(self) -> None:
        """Give the cache's slots back to the pool and its host tier's pages to theirs, and hold
        nothing: the cache is done with. (A later forward would hold its tokens in buffers of its
        own, never in the pool's pages, which another session may lease now.)"""
        if self.host is not None:
            self.host.release()
        if self.lease is None:
            return
        for cached in self.hf.layers:
            cached.leave_home()
        self.lease.release()
        self.lease = None

    @property
    def positions_3d(self) -> bool:
        return self.hf.layers[0].layout is not None

    def next_position(self) -> int:
        """The position the next token takes (with 3-D positions, its s: `engine/layout.py`)."""
        if not self.positions_3d:
            return self.hf.get_seq_length()
        # after the places reserved for what a question borrows: its tokens take at most as many (`engine/layout.py`)
        return max(cached.layout.next_position() for cached in self.hf.layers) + self.hf.layers[0].pending

    def incoming_rotations(self, held: int, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(count, head_dim) cos, sin and minus sin of the positions of the next forward's
        `count` tokens, after the `held` the cache holds: their indices, or their 3-D positions
        (`arriving`)."""
        if self.positions_3d:
            return self.positions.at3(positions_of(self.hf.layers[0].layout.incoming), like)
        return self.positions.between(held, held + count, like)

    def arriving(self, kept: torch.Tensor) -> None:
        """With 3-D positions: what each layer keeps of the next forward's tokens (FIELDS, c)
        (`layout.arriving`)."""
        for cached in self.hf.layers:
            cached.layout.incoming = kept

    def in_pool(self, count: int) -> bool:
        """Whether a forward of `count` new tokens may write them and attend in the worker's
        pool, together with other sessions' (`engine/pool_attention.py`): every layer held in
        the cache's slots with room for them, nothing to borrow first, and a policy that does
        not accumulate each query's attention (which the pool's attention does not return)."""
        if self.lease is None or self.policy.accumulates:
            return False
        with outside_inference():
            return all(cached.in_pool(count) for cached in self.hf.layers)

    def stored(self, count: int, queries: list[torch.Tensor], scaling: list[float]) -> None:
        """After a forward wrote `count` new tokens into the cache's slots in the pool and
        attended them there: hold them, and keep their queries (per layer (q_heads, w,
        head_dim), the window's own) and each layer's scaling."""
        for layer, cached in enumerate(self.hf.layers):
            cached.wrote(count)
            self._queries[layer].keep(queries[layer])
            self._scaling[layer] = scaling[layer]

    @property
    def num_layers(self) -> int:
        return len(self.hf.layers)

    @property
    def tokens(self) -> int:
        return self._kinds[0].shape[1] + self._unmerged_tokens

    # Per layer, (kv_heads, n) for each token: its kind (int8), video time (float32) and place
    # in the stream (int64); reading them first brings in what was appended since.

    @property
    def kinds(self) -> list[torch.Tensor]:
        self._merge()
        return self._kinds

    @property
    def times(self) -> list[torch.Tensor]:
        self._merge()
        return self._times

    @property
    def order(self) -> list[torch.Tensor]:
        self._merge()
        return self._order

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for layer in self.hf.layers if layer.is_initialized for t in (layer.keys, layer.values)
        )

    def rotated_keys(self, layer: int) -> torch.Tensor:
        """(kv_heads, N, head_dim) the layer's keys rotated at their positions (their indices)."""
        return self.hf.layers[layer].rotated()[0]

    # -- append --------------------------------------------------------------------------------

    def attend(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by the attention of `layer` while it runs c new tokens, with their queries
        (1, q_heads, c, head_dim) and every stored key and value (1, kv_heads, N, head_dim),
        theirs included. Brings in borrowed tokens if places are reserved, keeps the last
        queries, and returns the keys (rotated at their index) and values to attend. Runs
        inside the model's forward, so what it keeps is made `outside_inference`."""
        with outside_inference():
            if self.hf.layers[layer].pending:
                keys, values = borrow(self, layer, queries.shape[2])
            keys = self.hf.layers[layer].rotated()
            new = queries[0].detach()
            self._queries[layer].add(new)
            self._scaling[layer] = scaling
            if self.policy.accumulates:
                received = causal_attention(new, keys[0], scaling).sum(dim=2).mean(dim=1)  # (kv_heads, N)
                before = self._received[layer]
                if before is not None:
                    received[:, : before.shape[1]] += before
                self._received[layer] = received
            return keys, values

    def append(self, kinds: torch.Tensor, times: torch.Tensor) -> None:
        """After the model has run c new tokens: their kinds (c,) int8 and video times (c,)."""
        count = kinds.shape[0]
        last = self.next_position() - 1 if self.positions_3d else self.tokens + count - 1
        self.max_position = max(self.max_position, last)
        self.appended += count
        self._unmerged.append((kinds, times))
        self._unmerged_tokens += count
        if len(self._unmerged) >= MERGE_EVERY:
            self._merge()

    def _merge(self) -> None:
        """Bring the tokens appended since into every layer's kinds, times and order: one copy
        of each per layer for all of them, however many forwards appended them."""
        if not self._unmerged:
            return
        count, heads = self._unmerged_tokens, self.kv_heads
        kinds = torch.cat([k.to(torch.int8) for k, _ in self._unmerged]).expand(heads, count)
        times = torch.cat([t.float() for _, t in self._unmerged]).expand(heads, count)
        order = torch.arange(self.appended - count, self.appended).expand(heads, count)
        self._unmerged, self._unmerged_tokens = [], 0
        for rows, new in ((self._kinds, kinds), (self._times, times), (self._order, order)):
            rows[:] = [torch.cat([held, new], dim=1) for held in rows]

    def rollback(self, appended: int | None = None) -> None:
        """After a failed forward: drop whatever it appended or borrowed, and what it observed;
        given `appended` (the stream place before a prompt of several forwards), the tokens of
        the forwards before it too (nothing is evicted within a prompt, so they are the last).
        Borrowed tokens go back only if the forwards undone are the ones that borrowed them: an
        answer's token that failed leaves its answer's borrowing as it was."""
        undone_from = self.appended if appended is None else min(appended, self.appended)
        if appended is not None and appended < self.appended:
            self._merge()
            drop = self.appended - appended
            for rows in (self._kinds, self._times, self._order):
                rows[:] = [held[:, : held.shape[1] - drop] for held in rows]
            self.appended = appended
        for layer, cached in enumerate(self.hf.layers):
            cached.reserve(0)
            held = self.kinds[layer].shape[1]
            if cached.is_initialized and cached.keys.shape[2] > held:
                cached.keys, cached.values = cached.keys[:, :, :held], cached.values[:, :, :held]
        self._forget_queries()  # what the undone forwards observed
        if self.loan.at is not None and self.loan.at >= undone_from:
            give_back(self)
        self._received = [None] * self.num_layers

    def lent(self, layer: int, plan: MergePlan, held: int) -> None:
        """After `layer` merged what it borrows (`plan`'s, engine/loan.py) among its `held` tokens:
        their kinds, times, places, and what they received; the queries of the tokens before them are gone."""
        at = layer - plan.first
        self.kinds[layer], self.times[layer], self.order[layer] = plan.kinds[at], plan.times[at], plan.order[at]
        received = self._received[layer]
        if received is not None:
            padded = torch.cat([received[:, :held], received.new_zeros(self.kv_heads, self.hf.layers[layer].pending)], dim=1)
            self._received[layer] = padded.gather(1, plan.merge[at].to(received.device))
        self._queries[layer].set(None)  # from here on, only queries of tokens after every borrowed one

    def gave_back(self, layer: int, keep: torch.Tensor, width: int, count: int) -> None:
        """After `layer` gave back `count` borrowed tokens of its first `width`, keeping those at `keep` (kv_heads,
        width - count): their rows and what they received follow; its last queries (after them) move back `count` places."""
        for rows in (self.kinds, self.times, self.order):
            rows[layer] = torch.cat([rows[layer][:, :width].gather(1, keep), rows[layer][:, width:]], dim=1)
        received = self._received[layer]
        if received is not None:
            self._received[layer] = torch.cat([received[:, :width].gather(1, keep.to(received.device)), received[:, width:]], dim=1)
        queries = self._queries[layer].read()
        if queries is not None and not self.positions_3d:  # with 3-D positions, the tokens kept keep theirs
            cos, sin = self.positions.up_to(count + 1, queries)
            self._queries[layer].set(rotate(queries, cos[count:], -sin[count:]))

    def pin(self, places: torch.Tensor, turns: int, new_turn: bool = True) -> None:
        """Never evict the tokens at these stream places: the first call's (the opening) for
        good, later ones as turns, of which the last `turns` stay pinned; `new_turn=False` adds
        to the last turn."""
        if not self.pins:
            self.pins = [places]
        elif new_turn or len(self.pins) == 1:
            self.pins = self.pins[:1] + (self.pins[1:] + [places])[-turns:] if turns else self.pins[:1]
        else:
            self.pins[-1] = torch.cat([self.pins[-1], places])

    # -- evict ---------------------------------------------------------------------------------

    def evict(self) -> None:
        """Down to the policy's budget, if over it and holding nothing borrowed (`engine/loan.py`).
        The queries seen so far are dropped either way (the next prompt brings its own window);
        what accumulates is kept until an eviction. The rotated copy stays: what an eviction moved
        is rotated again at the next forward; after no eviction, only the next prompt's tokens are."""
        if not self.loan.borrowed and self.policy.evicts and self.tokens > self.policy.budget_tokens:
            started = time.perf_counter()
            removed = self.tokens - self.policy.budget_tokens
            evicted = [self._evict_layer(layer) for layer in range(self.num_layers)]
            if self.host is not None:
                self.host.add(Tokens(*(torch.stack(field) for field in zip(*evicted))))  # per field (layers, kv_heads, removed, ...)
            self._received = [None] * self.num_layers
            self.evictions += 1
            self.evicted_tokens += removed
            self.evict_s += time.perf_counter() - started
        self._forget_queries()  # the next prompt brings its own

    def _forget_queries(self) -> None:
        for window in self._queries:
            window.set(None)

    def _evict_layer(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """Keep the policy's choice; with a host tier, returns what left, in stream order per KV
        head: keys, values (kv_heads, removed, head_dim), kinds, times, order (kv_heads, removed)."""
        policy, cached = self.policy, self.hf.layers[layer]
        total = cached.keys.shape[2]
        attention = None
        if policy.needs_attention:
            queries = self._queries[layer].read()[:, -policy.window_tokens :]
            attention = causal_attention(queries, self.rotated_keys(layer), self._scaling[layer])
        previous = None
        if policy.keeps_scores and self.scores[layer] is not None:
            kept = self.scores[layer]
            previous = torch.cat([kept, kept.new_zeros(self.kv_heads, total - kept.shape[1])], dim=1)
        keys = cached.keys[0] if policy.needs_keys else None
        scores = policy.score(Observation(self.kv_heads, total, attention, previous, self._received[layer], keys))
        pinned = torch.isin(self.order[layer], torch.cat(self.pins)) if self.pins else None
        keep = policy.select(scores, pinned, self.order[layer])  # (kv_heads, B), ascending: the kept tokens' new positions
        keep_cpu = keep.cpu()
        left = None
        if self.host is not None:
            gone = torch.ones(self.kv_heads, total, dtype=torch.bool).scatter_(1, keep_cpu, False)
            gone = gone.nonzero()[:, 1].view(self.kv_heads, -1)  # (kv_heads, removed), ascending
            rows = gone.to(cached.keys.device)
            left = (take(cached.keys, rows)[0], take(cached.values, rows)[0])
            left += tuple(meta[layer].gather(1, gone) for meta in (self.kinds, self.times, self.order))
            if cached.layout is not None:
                left += (pack(cached.layout.take(gone), left[4]),)
        rows = keep.to(cached.keys.device)
        cached.keys, cached.values = take(cached.keys, rows), take(cached.values, rows)
        if cached.layout is not None:
            cached.layout.keep(keep_cpu)
        for rows in (self.kinds, self.times, self.order):
            rows[layer] = rows[layer].gather(1, keep_cpu)
        if policy.keeps_scores:
            self.scores[layer] = scores.float().gather(1, keep.to(scores.device))
        return left

    # -- read ----------------------------------------------------------------------------------

    def kept_queries(self, layer: int) -> tuple[torch.Tensor | None, float]:
        """The last queries `layer` keeps (q_heads, w, head_dim), rotated at their positions (None
        when none), and its attention's scaling (for evidence: engine/evidence.py)."""
        return self._queries[layer].read(), self._scaling[layer]

    # -- snapshot ------------------------------------------------------------------------------

    def state(self, host_pages: bool = True) -> dict:
        """Everything to go on elsewhere; without `host_pages`, the host tier's pages are left
        out (`HostTier.state`)."""
        return {
            "keys": [None if layer.keys is None else layer.keys.clone() for layer in self.hf.layers],  # not the buffers
            "values": [None if layer.values is None else layer.values.clone() for layer in self.hf.layers],
            "kinds": self.kinds,
            "times": self.times,
            "order": self.order,
            "host": None if self.host is None else self.host.state(host_pages),
            "scores": self.scores,
            "pins": self.pins,
            "queries": [window.read() for window in self._queries],
            "received": self._received,
            "scaling": self._scaling,
            "counters": [self.evictions, self.evicted_tokens, self.evict_s, self.max_position],
            "layout": [cached.layout.rows.clone() for cached in self.hf.layers] if self.positions_3d else None,
            "retrieval": [self.appended, self.loan.retrievals, self.loan.retrieved_tokens, self.loan.retrieve_s,
                          self.loan.retrieved_pages],
        }

    def load(
        self, state: dict, device: torch.device, read_page: Callable[[int], dict] | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """A `state()` loaded on the CPU: tensors the model reads go to `device`; metadata stays;
        `read_page`: the host tier's pages, when they were saved apart; `dtype`: the model's, which
        keys, values and queries are converted to when the state was taken in another."""

        def here(tensors: list, as_dtype: torch.dtype | None = None) -> list:
            return [None if t is None else t.to(device, as_dtype) for t in tensors]

        for cached, keys, values in zip(self.hf.layers, here(state["keys"], dtype), here(state["values"], dtype)):
            cached.lazy_initialization(keys, values)
            cached.keys, cached.values = keys, values
        if self.positions_3d:
            if state.get("layout") is None:
                raise ValueError("the snapshot holds no 3-D positions, which this model needs")
            for cached, rows in zip(self.hf.layers, state["layout"], strict=True):
                cached.layout.rows = rows
        self._unmerged, self._unmerged_tokens = [], 0  # the state's rows replace all, what waits too
        self._kinds, self._times = state["kinds"], state["times"]
        # A snapshot of a version without stream order: its tokens are in stream order
        self._order = state.get("order") or [torch.arange(k.shape[1]).expand(self.kv_heads, -1).clone() for k in self._kinds]
        if state.get("host") is not None and self.host is not None:
            pool = self.host.shared_pool
            self.host.release()  # its pages, for the restored tier's
            self.host = HostTier.load(state["host"], device, read_page, pool, dtype)
        retrieval = state.get("retrieval", [int(self.order[0].max()) + 1 if self.tokens else 0, 0, 0, 0.0])
        self.appended, *counters = [*retrieval, 0][:5]
        self.loan = Loan(*counters)
        self.scores, self._received = here(state["scores"]), here(state["received"])
        for window, queries in zip(self._queries, here(state["queries"], dtype), strict=True):
            window.set(queries)
        self.pins = state.get("pins", [])
        self._scaling = state["scaling"]
        self.evictions, self.evicted_tokens, self.evict_s, self.max_position = state["counters"]

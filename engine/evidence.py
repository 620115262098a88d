"""An answer's evidence: the video times its question and answer attend to beyond what any question would.

Every query of a chat pays some frames a share of its attention whatever it is about (the
opening frames, the newest ones), so each query's attention is read as shares (per token held of
each video time, of what it paid all frame times), against a baseline measured on the same
cache: a probe (PROBE, then PROBE_ANSWER) run read only before the question. A time's excess is
what the question's and the answer's queries paid it beyond (1 + PROBE_MARGIN) times their
baselines; the times of most excess are the evidence (docs/engine.md, "Evidence": the rule and
how it was chosen).

State of one answer, bounded by the frame times the cache holds. What queries paid the frames
is read here too: the kept queries' from the cache (`frame_attention`), a read-only prompt's as
the runner runs it (`Observed`); the answer (engine/answer.py) and the step hand them in.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.kv_buffers import outside_inference
from engine.kv_cache import FRAME, KVCache
from engine.policies import causal_attention

PROBE = "Describe the video."  # the question about nothing in particular whose attention is the baseline
PROBE_ANSWER = "I see"  # the first words of an answer to it, run after it: part of the baseline of an answer's queries
PROBE_ANSWER_WEIGHT = 0.5  # an answer's baseline: this much of the probe answer's share, the rest its question's
EVIDENCE_FLOOR = 0.5  # a time is evidence only if its excess is at least this share of the best's
PROBE_MARGIN = 0.1  # a time is evidence only where it draws more than 1 + this times the probe's share


class FrameAttention(NamedTuple):
    """The attention some queries paid the frames held, by video time."""

    times: torch.Tensor  # (T,) the frames' video times, ascending
    mass: torch.Tensor  # (w, T) per query: the attention paid to each time's tokens, over layers and heads
    held: torch.Tensor  # (T,) each time's tokens held, over layers and KV heads


def frame_attention(cache: KVCache, queries: int | None = None, kind: int | None = None) -> FrameAttention | None:
    """What the cache's last `queries` kept queries (all those kept when None; at most its
    `evidence_window`) paid the frames still held, by the frame's video time: per query, summed
    over layers and heads, and how many tokens of each time the layers' KV heads hold (a token
    held in two heads counts twice); with `kind`, only the queries of tokens of that kind; None
    when no query is kept."""
    window = cache.evidence_window if queries is None else min(queries, cache.evidence_window)
    first, _ = cache.kept_queries(0)
    if window <= 0 or first is None:
        return None
    rows = None
    if kind is not None:  # the queries kept are of the cache's last tokens, the same in every head
        count = first[:, -window:].shape[1]
        rows = (cache.kinds[0][0, -count:] == kind).nonzero()[:, 0]
        if rows.numel() == 0:
            return None
    parts = []  # per layer: the frame tokens' times (M,) and the attention each query paid them (w, M)
    for layer in range(cache.num_layers):
        frames = cache.kinds[layer] == FRAME
        if not frames.any():  # text alone: nothing to weigh
            continue
        kept, scaling = cache.kept_queries(layer)
        received = causal_attention(kept[:, -window:], cache.rotated_keys(layer), scaling, rows).sum(dim=1).cpu()  # (kv_heads, w, N)
        parts.append((cache.times[layer][frames], received.permute(1, 0, 2)[:, frames]))
    return _by_time(parts)


class Observed:
    """What a read-only prompt's last queries paid a cache's frames, layer by layer as the runner
    runs it (a question's probe, a check that wants evidence); `read` once every layer ran."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer with frames: their times (M,), paid (w, M)

    def add(self, cache: KVCache, layer: int, queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
        """`layer` ran the prompt's c tokens: keep what its last `evidence_window` queries
        (q_heads, c, head_dim) paid the layer's frames, given the keys they attend (kv_heads,
        N + c, head_dim): the cache's N, rotated, then the prompt's own."""
        with outside_inference():
            if layer == 0:  # a prompt run again (alone, after a failed forward) starts over
                self._parts = []
            frames = cache.kinds[layer] == FRAME  # (kv_heads, N)
            if not frames.any():
                return
            received = causal_attention(queries[:, -cache.evidence_window :], keys, scaling).sum(dim=1).cpu()  # (kv_heads, w, N + c)
            self._parts.append((cache.times[layer][frames], received[:, :, : frames.shape[1]].permute(1, 0, 2)[:, frames]))

    def read(self) -> FrameAttention | None:
        """What the prompt paid the frames, as `frame_attention` reads the kept queries'; None
        when it saw none."""
        return _by_time(self._parts)


def _by_time(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> FrameAttention | None:
    """Per layer, its frame tokens' times (M,) and what each query paid them (w, M), summed by
    video time over the layers; None without any."""
    if not parts:
        return None
    times = torch.unique(torch.cat([t for t, _ in parts]))
    mass = torch.zeros(parts[0][1].shape[0], times.shape[0])
    held = torch.zeros(times.shape[0])
    for frame_times, paid in parts:
        slot = torch.searchsorted(times, frame_times)
        mass.index_add_(1, slot, paid)
        held.index_add_(0, slot, torch.ones_like(frame_times))
    return FrameAttention(times, mass, held)


@dataclass(frozen=True)
class Evidence:
    time_s: float  # video time of a frame
    weight: float  # its share of the excess attention the answer paid to frames (0..1)


def shares(attention: FrameAttention) -> torch.Tensor:
    """(w, T) per query, each time's share of its attention per token held (each row sums to 1,
    or to 0 where a query paid the frames nothing)."""
    per_token = attention.mass / attention.held.clamp(min=1)
    return per_token / per_token.sum(dim=1, keepdim=True).clamp(min=1e-12)


class Contrast:
    """The probe's mean share of each video time for its question and for its answer, then the
    question's and the answer's shares, summed, against the baselines made of them."""

    def __init__(self) -> None:
        # by role (False: a question's queries, True: an answer's), by video time:
        self.probed: dict[bool, dict[float, float]] = {}  # the probe's question's and answer's mean share
        self.paid: dict[bool, dict[float, float]] = {False: {}, True: {}}  # the shares of the queries weighed, summed
        self.queries = {False: 0, True: 0}  # how many queries `paid` sums

    def probe(self, attention: FrameAttention | None, answer_queries: int = 0) -> None:
        """The probe's mean shares: of its last `answer_queries` queries (its answer's) and of
        the rest (its question's); of all of them for both where one part is missing."""
        if attention is None:
            return
        rows, times = shares(attention), attention.times.tolist()
        split = rows.shape[0] - answer_queries
        parts = (rows[:split], rows[split:]) if 0 < split < rows.shape[0] else (rows, rows)
        self.probed = {role: dict(zip(times, part.mean(dim=0).tolist())) for role, part in zip((False, True), parts)}

    def add(self, attention: FrameAttention | None, answer: bool = False) -> None:
        """The attention of queries of the question (or, `answer`, of the answer) not yet weighed
        (a time the probe did not see has a baseline of 0)."""
        if attention is None:
            return
        paid = self.paid[answer]
        for t, share in zip(attention.times.tolist(), shares(attention).sum(dim=0).tolist()):
            paid[t] = paid.get(t, 0.0) + share
        self.queries[answer] += attention.mass.shape[0]

    def top(self, k: int, answer_weight: float = PROBE_ANSWER_WEIGHT, margin: float = PROBE_MARGIN) -> list[Evidence]:
        """The times of most excess over the baselines and their margin, else over the baselines
        alone; none where no time draws more than its baseline. A question's baseline is the
        probe question's share, an answer's `answer_weight` of the probe answer's and the rest
        of its question's."""
        question, answer = self.probed.get(False, {}), self.probed.get(True, {})
        baseline = {False: question, True: {t: answer_weight * answer.get(t, 0.0) + (1 - answer_weight) * q for t, q in question.items()}}
        count = max(sum(self.queries.values()), 1)
        for scale in (1 + margin, 1.0):
            excess: dict[float, float] = {}
            for role, paid in self.paid.items():
                for t, share in paid.items():
                    excess[t] = excess.get(t, 0.0) + (share - self.queries[role] * scale * baseline[role].get(t, 0.0)) / count
            chosen = top_evidence(excess, k)
            if chosen:
                return chosen
        return []


def top_evidence(excess: dict[float, float], k: int) -> list[Evidence]:
    """The `k` video times of most excess attention, of those with at least EVIDENCE_FLOOR of
    the most; each weighted by its share of the positive excess of every time."""
    total = sum(e for e in excess.values() if e > 0)
    if total <= 0:
        return []
    best = sorted(excess.items(), key=lambda item: -item[1])[:k]
    return [Evidence(round(t, 3), round(e / total, 4)) for t, e in best if e > 0 and e >= EVIDENCE_FLOOR * best[0][1]]

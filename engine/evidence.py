"""An answer's evidence: the video times its question and answer attend to beyond what any question would.

Every query of a chat pays some frames a share of its attention whatever it is about: the
opening frames (attention sinks) and the newest ones. Summed, those shares put the first second
and the last seconds among the evidence of nearly every answer on real video (docs/engine.md,
"Evidence"). So each query's attention is taken as shares: per token held of each video time,
the share of what it paid all frame times (a row summing to 1).

The baseline is measured, not guessed: before a question runs, a question about nothing in
particular (PROBE) runs read only against the same cache (`KVCache.observe`: nothing of it
stays), and its queries' mean share of each time is what any question pays there. A time's
excess is the mean share of the question's queries and the answer's (its tokens and the markers
closing its turn) less (1 + PROBE_MARGIN) times that baseline; the times of most excess are the
evidence. Where no time draws that much more than the probe did, the times that draw more at all
are; where none does (an answer that reads the video exactly as a question about nothing would),
there is none.

State of one answer, bounded by the frame times the cache holds; the answer (engine/answer.py)
reads the cache and hands the attention in.
"""

from dataclasses import dataclass

import torch

from engine.kv_cache import FrameAttention

PROBE = "Describe the video."  # the question about nothing in particular whose attention is the baseline
EVIDENCE_FLOOR = 0.5  # a time is evidence only if its excess is at least this share of the best's
PROBE_MARGIN = 0.1  # a time is evidence only where it draws more than 1 + this times the probe's share


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
    """The probe's mean share of each video time (the baseline), then the question's and the
    answer's shares, summed, against it."""

    def __init__(self) -> None:
        self.baseline: dict[float, float] = {}  # by video time: what any question pays it
        self.paid: dict[float, float] = {}  # by video time: the shares of the question's and answer's queries, summed
        self.queries = 0  # how many queries `paid` sums

    def probe(self, attention: FrameAttention | None) -> None:
        """The baseline: the mean share of the probe's queries."""
        if attention is not None:
            self.baseline = dict(zip(attention.times.tolist(), shares(attention).mean(dim=0).tolist()))

    def add(self, attention: FrameAttention | None) -> None:
        """The attention of queries of the question or the answer not yet weighed (a time the
        probe did not see has a baseline of 0)."""
        if attention is None:
            return
        for t, share in zip(attention.times.tolist(), shares(attention).sum(dim=0).tolist()):
            self.paid[t] = self.paid.get(t, 0.0) + share
        self.queries += attention.mass.shape[0]

    def top(self, k: int) -> list[Evidence]:
        """The times of most excess over the baseline and its margin, else over the baseline
        alone; none where no time draws more than its baseline."""
        count = max(self.queries, 1)
        for scale in (1 + PROBE_MARGIN, 1.0):
            chosen = top_evidence({t: paid / count - scale * self.baseline.get(t, 0.0) for t, paid in self.paid.items()}, k)
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

"""An answer's evidence: the video times its own tokens attend to beyond what any query would.

Every query of a chat pays some frames a share of its attention whatever it is about: the
opening frames (attention sinks) and the newest ones. Summed, those shares put the first second
and the last seconds among the evidence of nearly every answer on real video (docs/engine.md,
"Evidence"). So each query's attention is taken as shares: per token held of each video time,
the share of what it paid all frame times (a row summing to 1). The baseline of a time is the
mean share of the question's queries (its tokens and the markers closing it, which run before
a word of the answer) plus BETWEEN_FRAMES_SCALE times the mean share of the text between the
last frames (its time and newline, the same whatever is asked: the pull of the newest frames).
An answer query's excess is its share of a time less that baseline, where positive; a time's
evidence is the excess of every answer query summed. A time that every query attends to alike
draws no excess however much it draws; a time the question already attends to (the frame a
conversation is about) stays evidence where some answer tokens attend to it more still.

State of one answer, bounded by the frame times the cache holds; the answer (engine/answer.py)
reads the cache and hands the attention in.
"""

from dataclasses import dataclass

import torch

from engine.kv_cache import FrameAttention

EVIDENCE_FLOOR = 0.5  # a time is evidence only if its excess is at least this share of the best's
BETWEEN_FRAMES_SCALE = 0.5  # the weight in the baseline of what the text between the last frames paid each time


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
    """The question's mean share of each video time, then the answer's excess over it, summed."""

    def __init__(self) -> None:
        self.baseline: dict[float, float] = {}  # by video time: the question's queries' mean share
        self.excess: dict[float, float] = {}  # by video time: the answer's queries' excess, summed
        self.paid: dict[float, float] = {}  # by video time: the answer's queries' shares, summed

    def question(self, attention: FrameAttention | None, between_frames: FrameAttention | None = None) -> None:
        """The baseline: the mean share of the question's queries (its tokens and the markers
        closing it), plus BETWEEN_FRAMES_SCALE times that of the text between the last frames."""
        for source, scale in ((attention, 1.0), (between_frames, BETWEEN_FRAMES_SCALE)):
            if source is None:
                continue
            for t, share in zip(source.times.tolist(), shares(source).mean(dim=0).tolist()):
                self.baseline[t] = self.baseline.get(t, 0.0) + scale * share

    def answer(self, attention: FrameAttention | None) -> None:
        """The attention of answer queries not yet weighed (a time the question did not see has
        a baseline of 0)."""
        if attention is None:
            return
        times = attention.times.tolist()
        baseline = torch.tensor([self.baseline.get(t, 0.0) for t in times])
        paid = shares(attention)
        excess = (paid - baseline).clamp(min=0).sum(dim=0)
        for t, e, p in zip(times, excess.tolist(), paid.sum(dim=0).tolist()):
            self.excess[t] = self.excess.get(t, 0.0) + e
            self.paid[t] = self.paid.get(t, 0.0) + p

    def top(self, k: int) -> list[Evidence]:
        """The times of most excess; when no time drew any (the answer attended to the frames as
        its question did), those it paid most per token held."""
        return top_evidence(self.excess, k) or top_evidence(self.paid, k)


def top_evidence(excess: dict[float, float], k: int) -> list[Evidence]:
    """The `k` video times of most excess attention, of those with at least EVIDENCE_FLOOR of
    the most; each weighted by its share of the excess of every time."""
    total = sum(excess.values())
    if total <= 0:
        return []
    best = sorted(excess.items(), key=lambda item: -item[1])[:k]
    return [Evidence(round(t, 3), round(e / total, 4)) for t, e in best if e > 0 and e >= EVIDENCE_FLOOR * best[0][1]]

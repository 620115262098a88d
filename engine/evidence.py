"""An answer's evidence: the video times its question and answer attend to beyond what any question would.

Every query of a chat pays some frames a share of its attention whatever it is about: the
opening frames (attention sinks) and the newest ones. Summed, those shares put the first second
and the last seconds among the evidence of nearly every answer on real video (docs/engine.md,
"Evidence"). So each query's attention is taken as shares: per token held of each video time,
the share of what it paid all frame times (a row summing to 1).

The baseline is measured, not guessed: before a question runs, a question about nothing in
particular (PROBE) and the first words of an answer to it (PROBE_ANSWER) run read only against
the same cache (`KVCache.observe`: nothing of them stays). Its question's queries' mean share of
each time is what any question pays there. An answer's tokens read the opening, the newest
and the most salient frames more than a question's do, whatever was asked, so an answer's
baseline is the mean of the probe question's share and its answer's (PROBE_ANSWER_WEIGHT): the
answer's two words alone are salience too, and a needle the real answer reads they read as
well (docs/engine.md, "Evidence"). A time's excess is the shares of the question's queries (with
the markers closing its turn) less (1 + PROBE_MARGIN) times the question's baseline, plus the
shares of the answer's queries (its tokens and the markers closing its turn) less as much of the
answer's baseline, over all those queries; the times of most excess are the evidence. Where no
time draws that much more than the probe did, the times that draw more at all are; where none
does (an answer that reads the video exactly as one about nothing would), there is none.

State of one answer, bounded by the frame times the cache holds; the answer (engine/answer.py)
reads the cache and hands the attention in.
"""

from dataclasses import dataclass

import torch

from engine.kv_cache import FrameAttention

PROBE = "Describe the video."  # the question about nothing in particular whose attention is the baseline
PROBE_ANSWER = "I see"  # the first words of an answer to it, run after it: part of the baseline of an answer's queries
PROBE_ANSWER_WEIGHT = 0.5  # an answer's baseline: this much of the probe answer's share, the rest its question's
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

"""How an answer's next token is chosen: greedy, or drawn with temperature, top-k and top-p; and
where stop strings end its text.

Whatever the sampling, an answer never degenerates: no token 3-gram comes a 4th time (the token
that would complete it is passed over, `Repeats`), and text that runs on for `GARBAGE_CHARS`
characters without a letter or digit ends the answer before them (`clean_end`).

A draw uses a generator of its own on the CPU, seeded by `seed`: the same seed, question and
cache give the same answer on any device.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000
MAX_SEED = 2**63 - 1
REPEATS = 3  # the times a token 3-gram may come in one answer
GARBAGE_CHARS = 32  # characters in a row with no letter or digit that end an answer, unshown


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy, the most likely token every time (top_p, top_k, seed unused)
    top_p: float = 1.0  # draw among the fewest most likely tokens whose probabilities reach top_p
    top_k: int = 0  # draw among the k most likely tokens; 0: no such limit
    seed: int | None = None  # None: a fresh draw each answer
    stop: tuple[str, ...] = ()  # the answer ends before the first of these in its text

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be from 0 to {MAX_TEMPERATURE}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be above 0 and at most 1, got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be from 0 to {MAX_TOP_K}, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        """The random source of one answer (None when greedy)."""
        if self.greedy:
            return None
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None, banned: Sequence[int] = ()) -> int:
        """The next token's id, from the logits (vocab,) of the last position, never one of `banned`."""
        if banned:
            logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
        if self.greedy:  # max's index, the first of equals as argmax's: 4 times faster over a bfloat16 vocabulary on a CPU
            return int(logits.max(-1).indices)
        scores = logits.detach().float().cpu() / self.temperature  # (vocab,)
        if 0 < self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = scores.sort(descending=True)
            probs = ordered.softmax(-1)
            outside = probs.cumsum(-1) - probs >= self.top_p  # the nucleus is complete before these
            scores[order[outside]] = float("-inf")
        return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))

    def cut(self, text: str) -> tuple[str, bool]:
        """What of an answer's `text` can be shown now, and whether a stop string ended it: the
        text before the first stop string; else all but a tail that may be the start of one."""
        ends = [found for s in self.stop if (found := text.find(s)) >= 0]
        if ends:
            return text[: min(ends)], True
        held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - held], False


class Repeats:
    """The token 3-grams of one answer, by their first two tokens: the tokens that may not come next.
    A 3-gram with a digit in it is not counted: numbers in a list share digits ("at 10.5 s, 10.6 s,
    10.7 s, 10.8 s"), and passing one of them over would change a number, not end a loop."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, int], dict[int, int]] = {}  # (a, b) -> {c: times a, b, c came}; one entry a token
        self._numeric: list[bool] = []  # whether each of the last 3 tokens' text has a digit

    def banned(self, ids: list[int]) -> list[int]:
        """The tokens that, after `ids`, would make a 3-gram come more than `REPEATS` times."""
        after = self._next.get(tuple(ids[-2:]), {})
        return [token for token, times in after.items() if times >= REPEATS]

    def add(self, ids: list[int], numeric: bool = False) -> None:
        """`ids` gained a token (`numeric`: its text has a digit): count the 3-gram it ends."""
        self._numeric = [*self._numeric[-2:], numeric]
        if len(ids) >= 3 and not any(self._numeric):
            after = self._next.setdefault((ids[-3], ids[-2]), {})
            after[ids[-1]] = after.get(ids[-1], 0) + 1


def clean_end(text: str) -> int:
    """Where the characters at the end of `text` with no letter or digit among them begin."""
    end = len(text)
    while end and not text[end - 1].isalnum():
        end -= 1
    return end


GREEDY = Sampling()

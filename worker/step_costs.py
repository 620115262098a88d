"""What an upload's steps cost, and so the time its ingest has left (docs/api.md, "Ingest progress").

A step's seconds (wall time from the session's previous step, so other sessions' time is in it)
grow with the tokens its cache holds: a line fitted by least squares over the steps that left
the cache below the budget. A full cache's steps evict as well and cost more: measured over the
latest RATE_WINDOW_STEPS once the cache is full, before that known from an earlier upload of
the same kind (`FullStepTimes`), and never less than the line's value at the budget. The time
left sums the remaining steps, each at the tokens its cache will hold then.
"""

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

RATE_WINDOW_STEPS = 8  # the latest steps, which give a step's video, tokens and, at a full cache, seconds
MIN_FULL_STEPS = 4  # steps at a full cache an upload measures before the worker takes their time for others
MAX_FULL_STEP_KEYS = 32  # (model, policy, budget, recall) a worker keeps a time for; the least recently used go first

FullStepKey = tuple[str, str, int, bool]  # model, policy, budget_tokens, recall


@dataclass(frozen=True)
class CacheFill:
    """The session's cache after a step."""

    cache_tokens: int  # held now
    tokens_seen: int  # run through the model so far
    budget_tokens: int | None  # held once full (it evicts down to them); None: a policy that keeps everything


@dataclass(frozen=True)
class Step:
    s: float  # its seconds, from the previous step (the first: from the upload's end)
    video_s: float  # the video it added to the cache
    tokens: int | None  # the tokens it ran; None for the first (not known)
    full: bool  # the cache was at its budget after it: it evicted


class StepCosts:
    """One upload's steps: `observe` each as it ends, then ask `seconds_left`."""

    def __init__(self, at_s: float, covered_s: float) -> None:
        self._at_s, self._covered_s = at_s, covered_s  # after the last step (at first: the upload's end)
        self._seen: int | None = None
        self._cache: CacheFill | None = None
        self._window: deque[Step] = deque(maxlen=RATE_WINDOW_STEPS)
        self._sums = [0.0] * 6  # over the steps below the budget: n, sum x, sum y, sum x^2, sum xy, sum y^2 (x: tokens, y: s)

    def observe(self, at_s: float, covered_s: float, cache: CacheFill) -> None:
        """A step ended at monotonic `at_s`, the cache's frames covering `covered_s` of video."""
        full = cache.budget_tokens is not None and cache.cache_tokens >= cache.budget_tokens
        tokens = None if self._seen is None else cache.tokens_seen - self._seen
        step = Step(at_s - self._at_s, covered_s - self._covered_s, tokens, full)
        self._window.append(step)
        self._at_s, self._covered_s, self._seen, self._cache = at_s, covered_s, cache.tokens_seen, cache
        if not full:
            x = cache.cache_tokens
            for i, value in enumerate((1, x, step.s, x * x, x * step.s, step.s * step.s)):
                self._sums[i] += value

    def _line(self) -> tuple[float, float]:
        """(intercept s, slope s per token) of a step's seconds over the tokens it leaves in the
        cache, below the budget. A slope no more than twice its standard error, which the noise
        of a few steps could make, is taken as 0 (extrapolated to the budget, it would count)."""
        n, sx, sy, sxx, sxy, syy = self._sums
        spread_x, spread_xy, spread_y = sxx - sx * sx / n, sxy - sx * sy / n, syy - sy * sy / n
        if n < 3 or spread_x <= 0:
            return sy / n, 0.0
        slope = spread_xy / spread_x
        error = math.sqrt(max(spread_y - slope * spread_xy, 0.0) / (n - 2) / spread_x)
        if slope <= 2 * error:
            slope = 0.0
        return (sy - slope * sx) / n, slope

    @property
    def full_step_s(self) -> float | None:
        """The mean seconds of the latest steps at a full cache, once MIN_FULL_STEPS are measured."""
        full = [step.s for step in self._window if step.full]
        return sum(full) / len(full) if len(full) >= MIN_FULL_STEPS else None

    def seconds_left(self, video_left_s: float, known_full_step_s: float | None) -> float | None:
        """The seconds to ingest `video_left_s` more of video; `known_full_step_s`: what a step at a
        full cache took the worker in an earlier upload like this one. None before a step that
        added video is measured."""
        steps, cache = list(self._window), self._cache
        video_s = sum(step.video_s for step in steps)
        if cache is None or video_s <= 0:
            return None
        steps_left = video_left_s / (video_s / len(steps))
        full = [step.s for step in steps if step.full]
        if self._sums[0] == 0:  # no step below the budget (the cache was full before): all are full steps
            return steps_left * sum(full) / len(full)
        base_s, per_token_s = self._line()
        budget = cache.budget_tokens
        full_s = base_s + per_token_s * (budget or 0)  # at least: a full step evicts besides
        if full:  # measured: the cache's own steps at its budget, however few
            full_s = sum(full) / len(full)
        elif known_full_step_s is not None:
            full_s = max(full_s, known_full_step_s)
        counted = [step.tokens for step in steps if step.tokens is not None]
        step_tokens = sum(counted) / len(counted) if counted else 0.0
        filling = steps_left  # the steps j = 1, 2 ... that leave the cache below its budget
        if budget is not None:
            below = budget - cache.cache_tokens
            filling = 0 if below <= 0 else steps_left if step_tokens <= 0 else min(steps_left, math.ceil(below / step_tokens) - 1)
        filling_s = filling * (base_s + per_token_s * (cache.cache_tokens + step_tokens * (filling + 1) / 2))
        return filling_s + (steps_left - filling) * full_s


class FullStepTimes:
    """A worker's seconds of a step at a full cache, the latest measured for each key (at most
    MAX_FULL_STEP_KEYS keys)."""

    def __init__(self) -> None:
        self._seconds: OrderedDict[FullStepKey, float] = OrderedDict()

    def get(self, key: FullStepKey) -> float | None:
        seconds = self._seconds.get(key)
        if seconds is not None:
            self._seconds.move_to_end(key)
        return seconds

    def learn(self, key: FullStepKey, seconds: float | None) -> None:
        if seconds is None:
            return
        self._seconds[key] = seconds
        self._seconds.move_to_end(key)
        while len(self._seconds) > MAX_FULL_STEP_KEYS:
            self._seconds.popitem(last=False)

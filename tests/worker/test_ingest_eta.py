"""An upload's time left is right early on, while its cache still fills and its steps are cheap,
as well as late: the steps still to come are costed at the tokens their cache will hold, and a
step at a full cache (which evicts) at what it took the worker in an earlier upload like it.

A step's seconds here come from a clock the upload reads, moved by each step's cost: a step that
leaves the cache holding `x` tokens takes 1 + x / 1000 s below the budget, 4 s at a full cache.
The video: 160 s at 1 frame a second, 8 frames a step, so 20 steps of 8 s; each adds 100 tokens.
"""

import pytest

from streamvqa.protocol import MediaEntry, MediaKind
from tests.media import file_bytes
from worker.step_costs import CacheFill, FullStepTimes
from worker.upload import UploadIngest

BUDGET_TOKENS = 1050  # reached by step 11: steps 1 to 10 leave 100 to 1,000 tokens, the rest evict down to it
STEP_TOKENS = 100
KEY = ("streamvqa-demo", "infmllm", BUDGET_TOKENS, True)


class Clock:
    def __init__(self) -> None:
        self.s = 1000.0

    def __call__(self) -> float:
        return self.s


@pytest.fixture(scope="module")
def video() -> bytes:
    return file_bytes("mp4", 160, rate=1)


def upload(spool, video: bytes, clock: Clock) -> UploadIngest:
    ingest = UploadIngest(spool, fps=1.0, max_side=64, max_bytes=1 << 24, clock=clock)
    ingest.receive(MediaEntry(MediaKind.DATA, data=video))
    ingest.receive(MediaEntry(MediaKind.END))
    assert ingest.info.duration_s == 160.0
    return ingest


def step_s(cache_tokens: int, budget_tokens: int | None) -> float:
    full = budget_tokens is not None and cache_tokens >= budget_tokens
    return 4.0 if full else 1 + cache_tokens / 1000


def run(ingest: UploadIngest, clock: Clock, steps: int, budget_tokens: int | None, full_steps: FullStepTimes,
        seconds=step_s) -> list[tuple[float, float]]:
    """Steps 1 to `steps`, as the worker runs them: (share, seconds left) after each."""
    said = []
    for j in range(1, steps + 1):
        cache_tokens = j * STEP_TOKENS if budget_tokens is None else min(j * STEP_TOKENS, budget_tokens)
        clock.s += seconds(cache_tokens, budget_tokens)
        cache = CacheFill(cache_tokens, j * STEP_TOKENS, budget_tokens)
        said.append(ingest.estimate(8.0 * j, cache, full_steps.get(KEY)))
        full_steps.learn(KEY, ingest.full_step_s)
    return said


def test_a_cache_that_keeps_everything_costs_its_steps_by_their_growth(tmp_path, video):
    # 'full' keeps every token: a step costs 1 + x / 1000 s all the way (steps 6 to 20: 34.5 s);
    # the rate of the first five steps (40 s of video in 6.5 s) said 19.5
    clock = Clock()
    said = run(upload(tmp_path / "video.upload", video, clock), clock, 5, None, FullStepTimes())
    assert said[-1] == (0.25, 34.5)


def test_steps_that_vary_by_chance_are_not_taken_for_a_growing_cost(tmp_path, video):
    # 3, 4, 3, 4 s: fitted, a slope of 2 ms a token (then steps 5 to 20 would take 88 s), but no
    # more than its noise could make; the 16 steps left are told at their mean, 3.5 s
    clock = Clock()
    said = run(upload(tmp_path / "video.upload", video, clock), clock, 4, None, FullStepTimes(),
               seconds=lambda cache_tokens, _: 3.0 if cache_tokens % 200 else 4.0)
    assert said[-1] == (0.2, 56.0)


def test_an_upload_knows_what_a_full_cache_costs_from_the_one_before(tmp_path, video):
    full_steps, clock = FullStepTimes(), Clock()
    first = run(upload(tmp_path / "first.upload", video, clock), clock, 20, BUDGET_TOKENS, full_steps)
    # the worker's first upload of this kind: at 25 % its line says steps 6 to 10 take 9 s, and a
    # full step 2.05 s (the line at the budget); once full, its own full steps (4 s) count
    assert first[4] == (0.25, 29.5)
    assert first[14] == (0.75, 20.0)
    assert first[19] == (1.0, 0.0)
    assert full_steps.get(KEY) == 4.0

    clock = Clock()
    second = run(upload(tmp_path / "second.upload", video, clock), clock, 15, BUDGET_TOKENS, full_steps)
    # steps 6 to 10 take 1.6 + 1.7 + 1.8 + 1.9 + 2.0 = 9 s, steps 11 to 20 4 s each: 49 s left,
    # of which the rate of the first five steps (40 s of video in 6.5 s) said 19.5
    # after two steps no growth is told from noise yet: steps 3 to 10 at their mean (1.15 s), and 40 s
    assert second[1] == (0.1, 49.2)
    assert second[4] == (0.25, 49.0)
    assert second[9] == (0.5, 40.0)
    assert second[14] == (0.75, 20.0)


def test_a_worker_keeps_the_full_step_times_of_32_kinds_of_upload_at_most():
    full_steps = FullStepTimes()
    for budget in range(40):
        full_steps.learn(("m", "infmllm", budget, True), 1.0 + budget)
    assert full_steps.get(("m", "infmllm", 7, True)) is None
    assert full_steps.get(("m", "infmllm", 8, True)) == 9.0
    assert full_steps.get(("m", "infmllm", 39, True)) == 40.0

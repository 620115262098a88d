"""A worker's engine step: parts prepared by their owners, run as one `engine.step`, then published.

Each part is one kind of work of a step (questions to start: `worker.answering.Starts`; answer
tokens: `Tokens`; checks: `worker.watches.Checking`; frames: `worker.intake.Appending`), prepared on the loop (questions and
frames taken). On the engine's thread each part gives its work (`work()`: an answer is asked
there), and all of it runs as one engine step (`engine/step.py`: one forward for every prompt);
back on the loop, each part publishes its own results (`publish`), or the exception that failed
the step as a whole.
"""

from collections.abc import Sequence
from itertools import islice
from typing import Protocol

from engine import Answer, Check, Frames, Result, step
from worker.threads import Threads


class Part(Protocol):
    def work(self) -> list[Answer | Frames | Check]:
        """On the engine's thread: the part's items of the step."""

    async def publish(self, results: list[Result] | Exception) -> None:
        """One result per item of `work`, in order; or what failed the whole step."""


async def run(threads: Threads, parts: Sequence[Part | None]) -> None:
    """The parts that have work (None: a kind with none) as one engine step, if any has."""
    parts = [part for part in parts if part is not None]
    if not parts:
        return

    def on_engine() -> list[list[Result]]:
        items = [part.work() for part in parts]
        results = iter(step([item for work in items for item in work]))
        return [list(islice(results, len(work))) for work in items]  # each part's own, in order

    try:
        results: list[list[Result]] | list[Exception] = await threads.engine(on_engine)
    except Exception as err:  # each part says so as its own results
        results = [err] * len(parts)
    for part, result in zip(parts, results, strict=True):
        await part.publish(result)

"""What a worker's next engine step holds, so that no session's work holds up another's question.

A worker has one engine and many sessions. Their work is cut into **steps**, each of bounded
length: each turn of the worker's loop reads Redis, asks `next_step`, and runs the step as one
engine step (`engine/step.py`: one forward for all of its prompts, chunk by chunk). A step holds:

- `starts`: the first question waiting in each of up to `batch_sessions` sessions, the oldest
  asked first (each at most MAX_QUESTION_TOKENS and its turn's markers): its prefill and first token;
- `answers`: one more token of every answer under way (up to `batch_sessions` of them);
- `checks`: a check of one due watch of each of up to `batch_sessions` sessions with one due
  (`worker/watches.py`), while the step stays within `step_tokens`;
- `frames`: the next group of at most `frames_per_step` frames of sessions with frames ready,
  up to `batch_sessions`, while the step stays within `step_tokens`.

The token budget: a start counts as MAX_QUESTION_TOKENS, an answer as one token, a check as its
prompt (`check_tokens`), a session's frames as `frames_per_step` times the tokens one of its
frames took in its cache (`frame_tokens`, 0 before its first). Checks and frames join a step
while its count stays within `step_tokens`; the first session in turn of each always joins a
step that starts no question, so neither waits for answers.

A session does one thing at a time, its questions in order and before its media: a check or
frames wait for its answer and questions (a check would fall inside the answer's turn), and a
session with a watch due is checked before it takes more frames. Every question that can start
goes in the next step, every answer under way gets a token in every step, and within each of the
other kinds the sessions take turns after those that ran last, so that past `batch_sessions`
every session's turn comes within ceil(sessions / batch_sessions) steps. What a question waits
for, and why a live stream's frames queue meanwhile instead of being dropped (`Ingest.hold`), is
docs/architecture.md's "Fairness" and "Live frames during an answer".
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from streamvqa.protocol import MAX_QUESTION_TOKENS

Kind = Literal["answers", "checks", "frames"]  # work that sessions take turns at
DEFAULT_STEP_TOKENS = 4096


class Work(Protocol):
    """What the scheduler needs to know of a session."""

    @property
    def next_question_at(self) -> tuple[int, int] | None:
        """The stream id (ms, seq) of its first question not started, when it can start one."""

    @property
    def answering(self) -> bool:
        """An answer is under way."""

    @property
    def ingest_ready(self) -> bool:
        """Frames (or an ingest's errors and warnings) wait for a step."""

    @property
    def frame_tokens(self) -> int:
        """Tokens one frame took in its cache (0 before its first)."""

    @property
    def check_due(self) -> bool:
        """One of its watches is due a check."""

    @property
    def check_tokens(self) -> int:
        """What that check's prompt counts."""


@dataclass(frozen=True)
class Step:
    starts: tuple[str, ...] = ()  # in the order their questions were asked
    answers: tuple[str, ...] = ()  # in turn order, as are checks and frames
    frames: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()

    @property
    def sessions(self) -> tuple[str, ...]:
        return self.starts + self.answers + self.checks + self.frames


class Scheduler:
    """Chooses steps; remembers, per kind of work, the last session that had a turn."""

    def __init__(self, batch_sessions: int, step_tokens: int = DEFAULT_STEP_TOKENS, frames_per_step: int = 8) -> None:
        for name, value in (("batch_sessions", batch_sessions), ("step_tokens", step_tokens), ("frames_per_step", frames_per_step)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.batch_sessions = batch_sessions
        self.step_tokens = step_tokens
        self.frames_per_step = frames_per_step
        self._last: dict[Kind, str] = {}  # per kind, the last session of its last step

    def peek(self, sessions: Mapping[str, Work]) -> Step | None:
        """The step `next_step` would choose, without taking it."""
        waiting = sorted((work.next_question_at, session_id) for session_id, work in sessions.items() if work.next_question_at)
        starts = tuple(session_id for _, session_id in waiting[: self.batch_sessions])
        answers = tuple(self._in_turn(sessions, "answers", lambda work: work.answering)[: self.batch_sessions])
        tokens = len(starts) * MAX_QUESTION_TOKENS + len(answers)
        free = lambda work: not work.answering and work.next_question_at is None  # noqa: E731
        checks: list[str] = []
        for session_id in self._in_turn(sessions, "checks", lambda work: work.check_due and free(work))[: self.batch_sessions]:
            cost = sessions[session_id].check_tokens
            if tokens + cost > self.step_tokens and (checks or starts):
                break
            checks.append(session_id)
            tokens += cost
        frames: list[str] = []
        ready = lambda work: work.ingest_ready and free(work) and not work.check_due  # noqa: E731
        for session_id in self._in_turn(sessions, "frames", ready)[: self.batch_sessions]:
            cost = self.frames_per_step * sessions[session_id].frame_tokens
            if tokens + cost > self.step_tokens and (frames or starts):
                break
            frames.append(session_id)
            tokens += cost
        step = Step(starts, answers, tuple(frames), tuple(checks))
        return step if step.sessions else None

    def next_step(self, sessions: Mapping[str, Work]) -> Step | None:
        """The step to run now."""
        step = self.peek(sessions)
        if step is not None:
            for kind in ("answers", "checks", "frames"):  # starts go by the time they were asked, not in turn
                if getattr(step, kind):
                    self._last[kind] = getattr(step, kind)[-1]
        return step

    def _in_turn(self, sessions: Mapping[str, Work], kind: Kind, ready: Callable[[Work], bool]) -> list[str]:
        """The sessions `ready` for work of `kind`, from the one after the last that had a turn."""
        order = list(sessions)
        last = self._last.get(kind)
        if last in sessions:
            at = order.index(last) + 1
            order = order[at:] + order[:at]
        return [session_id for session_id in order if ready(sessions[session_id])]


def entry_time(entry_id: bytes | str) -> tuple[int, int]:
    """A Redis stream entry id as (milliseconds, sequence), comparable across streams."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)

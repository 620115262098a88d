"""Which engine step a worker runs next, so that no session's work holds up another's question.

A worker has one engine and many sessions. Their work is cut into **steps**, each of bounded
length, and the worker's loop runs one step, then reads Redis again, then asks `next_step`:

- `start`: the first question waiting in each of up to `batch_sessions` sessions, the oldest
  asked first: their prefills (at most MAX_QUESTION_TOKENS and the turn's markers each) run as
  one forward, and their first tokens;
- `answer`: one more token of every answer under way (up to `batch_sessions` of them), their
  forwards run as one (`engine/step.py`);
- `ingest`: one group of at most `frames_per_step` frames of each of up to `batch_sessions`
  sessions with frames ready, encoded and prefilled together.

The rule: questions that have not started go first (the oldest asked, over all sessions);
otherwise answers and frames take turns (an `answer` step, then an `ingest` step, while both
have work), and within each kind the sessions take turns after those that ran last, so that
past `batch_sessions` every session's turn comes within ceil(sessions / batch_sessions) steps
of its kind. A session does one thing at a time, its questions in order and before its media
(frames never enter the cache in the middle of an answer); a question asked on a stream socket
after media is not ready (`next_question_at` is None) until that media is in the cache, and its
session's `ingest` steps go on meanwhile. So a question read by the worker waits for the step
running when it came and for the starts of questions read before it, never for another
session's whole answer or whole video; and an answer's next token waits for at most one
`ingest` step and the starts of new questions.

A session's own frames wait for its answer. For a live stream that wait must not turn into a
hole in the cache: while a session answers or has a question ready to start, its ingest holds the
real-time rule (`Ingest.hold`, set by the loop each turn from the same `answering` and
`next_question_at` this scheduler reads), so the frames sent meanwhile queue up and enter the
cache in the `ingest` steps after the answer, instead of being dropped as late.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

StepKind = Literal["start", "answer", "ingest"]


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


@dataclass(frozen=True)
class Step:
    kind: StepKind
    session_ids: tuple[str, ...]  # one or more: in the order their questions were asked for `start`, in turn order for the others


class Scheduler:
    """Chooses steps; remembers the kind of the last step and, per kind, where the turns stand."""

    def __init__(self, batch_sessions: int) -> None:
        if batch_sessions < 1:
            raise ValueError(f"batch_sessions must be >= 1, got {batch_sessions}")
        self.batch_sessions = batch_sessions
        self._last_kind: StepKind | None = None
        self._last: dict[StepKind, str] = {}  # per kind, the last session of its last step

    def peek(self, sessions: Mapping[str, Work]) -> Step | None:
        """The step `next_step` would choose, without taking it."""
        waiting = sorted((work.next_question_at, session_id) for session_id, work in sessions.items() if work.next_question_at)
        if waiting:
            return Step("start", tuple(session_id for _, session_id in waiting[: self.batch_sessions]))
        answering = self._in_turn(sessions, "answer", lambda work: work.answering)
        ingesting = self._in_turn(sessions, "ingest", lambda work: not work.answering and work.ingest_ready)
        if answering and (not ingesting or self._last_kind != "answer"):
            return Step("answer", answering)
        if ingesting:
            return Step("ingest", ingesting)
        return None

    def next_step(self, sessions: Mapping[str, Work]) -> Step | None:
        """The step to run now."""
        step = self.peek(sessions)
        if step is not None:
            self._last_kind = step.kind
            self._last[step.kind] = step.session_ids[-1]
        return step

    def _in_turn(self, sessions: Mapping[str, Work], kind: StepKind, ready) -> tuple[str, ...]:
        """Up to `batch_sessions` sessions `ready` for a step of `kind`, from the one after the
        last that ran one."""
        order = list(sessions)
        last = self._last.get(kind)
        if last in sessions:
            at = order.index(last) + 1
            order = order[at:] + order[:at]
        return tuple([session_id for session_id in order if ready(sessions[session_id])][: self.batch_sessions])


def entry_time(entry_id: bytes | str) -> tuple[int, int]:
    """A Redis stream entry id as (milliseconds, sequence), comparable across streams."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)

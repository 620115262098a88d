"""Which engine step a worker runs next, so that no session's work holds up another's question.

A worker has one engine and many sessions. Their work is cut into **steps**, each of bounded
length, and the worker's loop runs one step, then reads Redis again, then asks `next_step`:

- `start`: a question's prefill and its first token (at most MAX_QUESTION_TOKENS and the
  turn's markers);
- `answer`: one more token of an answer under way;
- `ingest`: one group of at most FRAMES_PER_STEP frames (their encoding and prefill).

The rule: a question that has not started goes first (the oldest asked, over all sessions);
otherwise the sessions with work take turns, one step each, after the session that ran last.
A session does one thing at a time, its questions in order and before its media (frames never
enter the cache in the middle of an answer). So a question read by the worker waits for the
step running when it came and for the starts of questions read before it, never for another
session's whole answer or whole video.
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
    session_id: str


def next_step(sessions: Mapping[str, Work], last: str | None) -> Step | None:
    """The step to run now; `last` is the session that ran the previous one (None at first)."""
    waiting = [(work.next_question_at, session_id) for session_id, work in sessions.items() if work.next_question_at]
    if waiting:
        return Step("start", min(waiting)[1])
    order = list(sessions)
    if last in sessions:
        at = order.index(last) + 1
        order = order[at:] + order[:at]
    for session_id in order:
        work = sessions[session_id]
        if work.answering:
            return Step("answer", session_id)
        if work.ingest_ready:
            return Step("ingest", session_id)
    return None


def entry_time(entry_id: bytes | str) -> tuple[int, int]:
    """A Redis stream entry id as (milliseconds, sequence), comparable across streams."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    milliseconds, _, sequence = text.partition("-")
    return int(milliseconds), int(sequence or 0)

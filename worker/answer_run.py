"""An answer under way on a worker: its question, the engine's answer it reads pieces from, the
events not yet published, and the final event it ends with. State alone: `worker/answering.py`
runs it, and the session that holds it (`worker/hosted.py`) knows only that it is there."""

import time
from dataclasses import dataclass, field

from engine import Answer, Session, SessionStats
from streamvqa.protocol import DoneEvent, Evidence, Question, TokenEvent


@dataclass
class AnswerRun:
    entry_id: bytes  # the question's entry in the session's question stream (acknowledged at the end)
    question: Question
    stream: str  # the answer's stream key
    pieces: Answer  # the engine's answer: one piece of text per `next`, run on the engine's thread
    before: SessionStats  # the session's counters when the answer started
    started_at: float = field(default_factory=time.monotonic)  # when the worker started it
    started_unix: float = field(default_factory=time.time)  # the same, as unix time
    text: list[str] = field(default_factory=list)
    outbox: list[TokenEvent] = field(default_factory=list)  # pieces not yet in the answer stream (Redis failed)
    published: int = 0  # events in the answer stream
    first_token_at: float | None = None  # unix time

    @property
    def asked_at(self) -> float:
        """Unix time the question was asked (when the worker started it, if the gateway did not say)."""
        return self.question.asked_at or (time.time() - (time.monotonic() - self.started_at))

    def add(self, piece: str) -> None:
        """A generated piece, queued for the answer stream (empty pieces are not sent)."""
        if piece:
            self.first_token_at = self.first_token_at or time.time()
            self.text.append(piece)
            self.outbox.append(TokenEvent(text=piece))

    def done(self, engine: Session, cancelled: bool = False) -> DoneEvent:
        """The final event, once the engine's iterator has ended (or was closed: `cancelled`)."""
        finished_at = time.time()
        stats = engine.stats()
        return DoneEvent(
            answer="".join(self.text),
            tokens=self.pieces.tokens,
            evidence=[Evidence(time_s=e.time_s, weight=e.weight) for e in self.pieces.evidence],
            recalled_s=self.pieces.recalled_s,
            finish_reason="cancelled" if cancelled else self.pieces.finish_reason,
            prompt_tokens=self.pieces.prompt_tokens,
            video_time_s=stats.video_time_s,
            cache_tokens=stats.cache_tokens,
            worker_ms=round((time.monotonic() - self.started_at) * 1000, 1),
            ttft_ms=round(max(0.0, (self.first_token_at or finished_at) - self.asked_at) * 1000, 1),
            total_ms=round(max(0.0, finished_at - self.asked_at) * 1000, 1),
        )

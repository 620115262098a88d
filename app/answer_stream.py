"""One answer's events, read from Redis once and typed, as every transport delivers them.

`ask` queues a question and returns its `AnswerStream`; `AnswerStream.follow` resumes an
answer asked before. Iterating a stream yields `Token`s, `Idle` while nothing comes for its
`idle_s`, and ends with one final item: `Finished`, `Failed` (the worker refused the question or
failed answering it) or `TimedOut` (the gateway stopped waiting; the answer goes on). The stream
counts the gateway's metrics of a question it asked, once: the question at `ask`, the outcome at
its final event. A stream that asked and is closed before its final item (its client left)
cancels the answer: the worker stops it at its next token.

Each transport only formats these items: a JSON reply or Server-Sent Events (app/asks.py), a
stream socket's `answer_*` events (app/streams.py), OpenAI's completions and chunks
(app/completions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from app import answers, sse
from app.metrics import GatewayMetrics
from app.tail import TailTimeout, tail
from streamvqa.protocol import Answer, AnswerEnvelope, AskOptions, DoneEvent, Keys, SessionRecord


@dataclass(frozen=True)
class Token:
    text: str
    event_id: str  # the answer stream's entry id: a client resumes after it


@dataclass(frozen=True)
class Finished:
    answer: Answer
    done: DoneEvent  # with what only the gateway reads (prompt_tokens)
    event_id: str


@dataclass(frozen=True)
class Failed:
    code: str
    message: str
    event_id: str


@dataclass(frozen=True)
class TimedOut:
    timeout_s: float


@dataclass(frozen=True)
class Idle:
    pass


IDLE = Idle()
AnswerItem = Token | Finished | Failed | TimedOut | Idle
ANSWER_READ_COUNT = 256  # answer events read from Redis at once, at most
LEAVE_CHECK_S = 1.0  # the `idle_s` of a request that waits for its answer: how often it checks that its client is still there


async def ask(
    redis: Redis, keys: Keys, session: SessionRecord, question: str, options: AskOptions, session_ttl_s: int,
    metrics: GatewayMetrics, via: str, timeout_s: float, idle_s: float = sse.KEEPALIVE_S, after_media: str | None = None,
) -> AnswerStream:
    """Queue a question (asked via `rest`, `sse`, `socket` or `openai`) with its length and
    sampling, and on a socket the media entry it follows; its answer's stream. ApiError as
    `answers.submit` refuses it."""
    answer_id = await answers.submit(
        redis, keys, session, question, options.answer_tokens, options.sampling(), session_ttl_s, after_media
    )
    metrics.questions.labels(via).inc()
    return AnswerStream(redis, keys, session.id, answer_id, timeout_s, idle_s, metrics=metrics)


class AnswerStream:
    """An answer's items in order (see the module's docstring); one consumer iterates it once."""

    def __init__(
        self, redis: Redis, keys: Keys, session_id: str, answer_id: str, timeout_s: float, idle_s: float,
        since: str = "0-0", metrics: GatewayMetrics | None = None,
    ) -> None:
        self.redis, self.keys = redis, keys
        self.session_id, self.answer_id = session_id, answer_id
        self.timeout_s = timeout_s
        self.over = False  # the final item came
        # given: this stream asked the question, so it counts the outcome, and closing it early cancels
        # the answer; None: it follows an answer asked before (counted by the stream that asked it)
        self._metrics = metrics
        self._entries = tail(redis, keys.answer(session_id, answer_id), since, AnswerEnvelope, ANSWER_READ_COUNT, idle_s, timeout_s)

    @classmethod
    def follow(
        cls, redis: Redis, keys: Keys, session_id: str, answer_id: str, timeout_s: float, since: str
    ) -> AnswerStream:
        """An answer asked before, from after the entry id `since`; closing it cancels nothing."""
        return cls(redis, keys, session_id, answer_id, timeout_s, sse.KEEPALIVE_S, since)

    def __aiter__(self) -> AnswerStream:
        return self

    async def __anext__(self) -> AnswerItem:
        if self.over:
            raise StopAsyncIteration
        try:
            entry = await anext(self._entries)
        except TailTimeout:
            self.over = True
            return TimedOut(self.timeout_s)
        if entry is None:
            return IDLE
        event_id, event = entry
        if event.type == "token":
            return Token(event.text, event_id)
        self.over = True
        if event.type == "done":
            if self._metrics is not None:
                self._metrics.answered(event)
            return Finished(event.answered(self.answer_id), event, event_id)
        if self._metrics is not None:
            self._metrics.answers.labels("error").inc()
        return Failed(event.code, event.message, event_id)

    def close(self) -> None:
        """Done with the stream: an answer this stream asked, not over yet, is cancelled (its
        client left, or its transport failed)."""
        if self._metrics is not None and not self.over:
            answers.cancel_soon(self.redis, self.keys, self.session_id, self.answer_id)
        self.over = True

    async def __aenter__(self) -> AnswerStream:
        return self

    async def __aexit__(self, *_) -> None:
        self.close()
        await self._entries.aclose()

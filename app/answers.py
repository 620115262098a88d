"""Questions onto a session's stream; answers looked up in their own streams (app/answer_stream.py
follows one as it grows).

Each answer is a bounded Redis stream of token events ending with one `done` or `error` event
(written by the worker). A session keeps the ids of its latest ASKED_MAXLEN questions with the
time they were asked, and their text, so that an answer can be looked up, resumed and told
apart from an unknown id, and the conversation listed. A client that leaves before its answer is
done cancels it (`cancel_soon`): the worker stops it at its next token.
"""

import asyncio
import logging
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from app.errors import ApiError
from streamvqa import protocol
from streamvqa.pending import enqueue
from streamvqa.protocol import Answer, AnswerEnvelope, Keys, Question, Sampling, SessionRecord, scripts
from streamvqa.redis_client import FAILURES

log = logging.getLogger(__name__)
_cancelling: set[asyncio.Task] = set()  # cancel marks on their way to Redis: one per client that left, each done in a moment


class AnswerStatus(BaseModel):
    """An answer as far as it has come."""

    answer_id: str
    status: Literal["pending", "streaming", "done", "error"] = Field(
        description="pending: not begun; streaming: tokens are arriving; done; error (see `code`)."
    )
    answer: str = Field(description="The text so far (all of it once done).")
    tokens: int = Field(description="Tokens so far.")
    last_event_id: str | None = Field(None, description="Resume its event stream after this id.")
    result: Answer | None = Field(None, description="The whole answer, once done.")
    code: str | None = Field(None, description="Why it failed, when status is error.")
    message: str | None = None


async def submit(
    redis: Redis, keys: Keys, session: SessionRecord, question: str, max_new_tokens: int, sampling: Sampling,
    session_ttl_s: int, after_media: str | None = None,
) -> str:
    """Queue a question for the session's worker; returns the answer id. With `after_media` (a
    media entry's id), the worker starts it once that entry's frames are in the cache. ApiError
    429 when the session's question backlog is full, 404 when the session is gone, 409 when it failed."""
    answer_id = uuid.uuid4().hex
    asked_at = time.time()
    message = Question(
        answer_id=answer_id, question=question, max_new_tokens=max_new_tokens, asked_at=asked_at, sampling=sampling,
        after_media=after_media,
    )
    queued, woke = await redis.eval(
        scripts.SUBMIT_QUESTION_LUA, 4, keys.questions(session.id), keys.asked(session.id), keys.session(session.id),
        keys.asked_questions(session.id),
        protocol.QUESTIONS_BACKLOG, message.model_dump_json(), answer_id, asked_at, protocol.ASKED_MAXLEN, session_ttl_s,
        question,
    )
    if woke:
        await enqueue(redis, keys, session.id, session.model, asked_at)
    if queued == 0:
        raise ApiError(429, "too_many_questions", "too many unanswered questions on this session")
    if queued == -1:
        raise ApiError(404, "session_not_found", f"no session {session.id}")
    if queued < 0:
        raise ApiError(409, "session_error", "the session failed; see its error")
    return answer_id


def cancel_soon(redis: Redis, keys: Keys, session_id: str, answer_id: str) -> None:
    """Mark an answer whose client left cancelled (its worker stops it at its next token, or never
    begins it), from a task of its own: the request's own task is being cancelled, and could
    await nothing more."""

    async def cancelling() -> None:
        try:
            await redis.eval(
                scripts.CANCEL_ANSWER_LUA, 2, keys.session(session_id), keys.cancel(session_id, answer_id),
                protocol.ANSWER_TTL_S,
            )
        except FAILURES as err:
            log.warning("answer %s: its client left, and Redis failed to take the cancel (%s)", answer_id, err)

    task = asyncio.create_task(cancelling())
    _cancelling.add(task)
    task.add_done_callback(_cancelling.discard)


class AskedAnswer(AnswerStatus):
    """An answer of the session's conversation, with its question."""

    question: str
    asked_at: float = Field(description="Unix time the question was asked.")


async def conversation(redis: Redis, keys: Keys, session_id: str, limit: int) -> list[AskedAnswer]:
    """The latest `limit` questions of the session and their answers, oldest first; answers
    forgotten after ANSWER_TTL_S are left out."""
    asked = await redis.zrange(keys.asked(session_id), -limit, -1, withscores=True)
    if not asked:
        return []
    texts = await redis.hmget(keys.asked_questions(session_id), [answer_id for answer_id, _ in asked])
    now, listed = time.time(), []
    for (answer_id, asked_at_s), text in zip(asked, texts, strict=True):
        found = await status(redis, keys, session_id, answer_id.decode())
        if found.status == "pending" and now - asked_at_s > protocol.ANSWER_TTL_S:
            continue  # its stream expired
        listed.append(AskedAnswer(**found.model_dump(), question=(text or b"").decode(), asked_at=asked_at_s))
    return listed


async def status(redis: Redis, keys: Keys, session_id: str, answer_id: str) -> AnswerStatus:
    entries = await redis.xrange(keys.answer(session_id, answer_id))
    text, last_id = [], None
    for entry_id, fields in entries:
        last_id = entry_id.decode()
        event = AnswerEnvelope.model_validate_json(fields[b"m"]).event
        if event.type == "done":
            return AnswerStatus(
                answer_id=answer_id, status="done", answer=event.answer, tokens=event.tokens,
                last_event_id=last_id, result=event.answered(answer_id),
            )
        if event.type != "token":
            return AnswerStatus(
                answer_id=answer_id, status="error", answer="".join(text), tokens=len(text),
                last_event_id=last_id, code=event.code, message=event.message,
            )
        text.append(event.text)
    return AnswerStatus(
        answer_id=answer_id, status="streaming" if entries else "pending", answer="".join(text), tokens=len(text),
        last_event_id=last_id,
    )

"""Questions and answers: `POST /sessions/{id}/ask` (a JSON answer, Server-Sent Events, or 202
and an answer id), `GET /sessions/{id}/answers` (the conversation) and
`GET /sessions/{id}/answers/{answer_id}` (look up or resume)."""

import re
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app import answer_stream, answers, sse
from app.answer_stream import AnswerStream, Failed, Finished, TimedOut, Token
from app.answers import AnswerStatus, AskedAnswer
from app.deps import AuthorizedSession, KeysDep, Metrics, RedisDep, Settings
from app.errors import ApiError, ErrorBody
from streamvqa import protocol
from streamvqa.protocol import Answer, AskOptions, QuestionText, SessionState

router = APIRouter(tags=["questions"])
ANSWER_ID = re.compile(r"[0-9a-f]{32}")
SSE_RESPONSE = {"content": {sse.EVENT_STREAM: {}}, "description": "With `stream` or `Accept: text/event-stream`: "
                "`started` (`{\"answer_id\", \"location\"}`, asking only), `token` events (`{\"text\"}`), then one "
                "`done` (the answer) or `error` (`{\"code\", \"message\"}`)."}


class AskRequest(AskOptions):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"question": "What is the person holding?", "max_new_tokens": 64},
                {"question": "What changed in the last minute?", "stream": True},
                {"question": "Summarise the video so far.", "wait_s": 2},
                {"question": "Describe the scene.", "temperature": 0.7, "top_p": 0.9, "seed": 42, "stop": ["\n"]},
            ]
        },
    )

    question: QuestionText
    stream: bool = Field(False, strict=True, description="Stream the answer as Server-Sent Events.")
    wait_s: float | None = Field(
        None, ge=0, le=300, strict=True,
        description="Wait at most this long; an answer not done by then is 202 with its id, to fetch at "
        "`GET /sessions/{id}/answers/{answer_id}`. Without it, `ask` waits up to the gateway's ASK_TIMEOUT_S.",
    )


class AnswerPending(BaseModel):
    answer_id: str
    status: str = Field(description="pending or streaming.")
    location: str = Field(description="Where to fetch or resume the answer.")


REFUSAL_STATUS = {"session_error": 409, "no_video": 409, "context_full": 409, "question_too_long": 422}  # a worker's error events, as HTTP statuses


async def raise_if_left(request: Request) -> None:
    """499 for a blocking request whose client has left (leaving its answer stream cancels the answer)."""
    if await request.is_disconnected():
        raise ApiError(499, "client_closed_request", "the client left; its answer was cancelled")


def refusal(error: Failed) -> ApiError:
    """A worker's refusal of a question (or failure while answering) as an HTTP error."""
    if error.code == "session_reset":  # its worker died or stopped while answering: ask again
        return ApiError(503, error.code, error.message, {"Retry-After": "1"})
    return ApiError(REFUSAL_STATUS.get(error.code, 500), error.code, error.message)


def _answer_url(session_id: str, answer_id: str) -> str:
    return f"/sessions/{session_id}/answers/{answer_id}"


@router.post(
    "/sessions/{session_id}/ask",
    responses={
        200: SSE_RESPONSE,
        202: {"model": AnswerPending, "description": "`wait_s` passed before the answer was done."},
        409: {"model": ErrorBody, "description": "`no_video`: no frame in the session's cache yet; `session_error`: "
              "the session's media failed; `context_full`: the question does not fit in what is left of the model's context."},
        504: {"model": ErrorBody, "description": "`answer_timeout`: no answer within ASK_TIMEOUT_S."},
    },
)
async def ask(
    session: AuthorizedSession, body: AskRequest, request: Request, redis: RedisDep, keys: KeysDep,
    settings: Settings, metrics: Metrics,
) -> Answer:
    """Ask about what the session has seen so far."""
    if session.state == SessionState.ERROR:
        raise ApiError(409, "session_error", f"the session failed: {session.error}")
    streaming = body.stream or sse.wants_events(request)  # streamed, it waits ASK_TIMEOUT_S whatever `wait_s` says
    wait_s = settings.ask_timeout_s if streaming or body.wait_s is None else min(body.wait_s, settings.ask_timeout_s)
    via, idle_s = ("sse", sse.KEEPALIVE_S) if streaming else ("rest", answer_stream.LEAVE_CHECK_S)
    stream = await answer_stream.ask(
        redis, keys, session, body.question, body, settings.session_ttl_s, metrics, via, wait_s, idle_s
    )
    location = _answer_url(session.id, stream.answer_id)
    if streaming:
        started = sse.frame("started", {"answer_id": stream.answer_id, "location": location})  # no id: resuming starts after it
        return sse.response(_answer_frames(stream, first=started), headers={"Location": location})
    async with stream:
        async for item in stream:
            await raise_if_left(request)  # at each keepalive too
            if isinstance(item, Failed):
                raise refusal(item)
            if isinstance(item, Finished):
                return item.answer
    # timed out; the answer goes on
    if body.wait_s is None:
        raise ApiError(504, "answer_timeout", f"no answer within {settings.ask_timeout_s} s (answer {stream.answer_id})")
    found = await answers.status(redis, keys, session.id, stream.answer_id)
    pending = AnswerPending(answer_id=stream.answer_id, status=found.status, location=location)
    return JSONResponse(pending.model_dump(), status_code=202, headers={"Location": location})


CONVERSATION_LIMIT = 100  # answers one GET /sessions/{id}/answers returns, at most


class Conversation(BaseModel):
    answers: list[AskedAnswer] = Field(description="Oldest first: the order the questions were asked in.")


@router.get("/sessions/{session_id}/answers")
async def list_answers(
    session: AuthorizedSession, redis: RedisDep, keys: KeysDep,
    limit: int = Query(20, ge=1, le=CONVERSATION_LIMIT, description="The latest this many questions."),
) -> Conversation:
    """The session's latest questions with their answers as far as they have come, oldest first
    (answers are kept an hour; the session keeps its latest 1024 questions)."""
    return Conversation(answers=await answers.conversation(redis, keys, session.id, limit))


@router.get(
    "/sessions/{session_id}/answers/{answer_id}",
    responses={200: SSE_RESPONSE, 410: {"model": ErrorBody, "description": "`answer_expired`: older than an hour."}},
)
async def get_answer(
    session: AuthorizedSession, answer_id: str, request: Request, redis: RedisDep, keys: KeysDep, settings: Settings,
) -> AnswerStatus:
    """An answer as far as it has come. With `Accept: text/event-stream`, its events as
    Server-Sent Events from the start, or after the `Last-Event-ID` a client last saw."""
    if not ANSWER_ID.fullmatch(answer_id) or (asked := await redis.zscore(keys.asked(session.id), answer_id)) is None:
        raise ApiError(404, "answer_not_found", f"this session asked no question {answer_id}")
    found = await answers.status(redis, keys, session.id, answer_id)
    if sse.wants_events(request):
        since = sse.last_event_id(request, "0-0")
        if found.status in ("done", "error") and _entry(since) >= _entry(found.last_event_id):
            return sse.response(_nothing())  # the client has seen the whole answer
        return sse.response(_answer_frames(AnswerStream.follow(redis, keys, session.id, answer_id, settings.ask_timeout_s, since)))
    if found.status == "pending" and time.time() - asked > protocol.ANSWER_TTL_S:
        raise ApiError(410, "answer_expired", f"answers are kept {protocol.ANSWER_TTL_S} s")
    return found


def _entry(event_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = event_id.partition("-")
    return int(milliseconds), int(sequence or 0)


async def _nothing():
    return
    yield


async def _answer_frames(stream: AnswerStream, first: str | None = None) -> AsyncIterator:
    """The answer's items as Server-Sent Events (`first` before them); a client that leaves
    before the final one cancels an answer it asked."""
    async with stream:
        if first:
            yield first
        async for item in stream:
            match item:
                case Token(text, event_id):
                    yield sse.frame("token", {"text": text}, event_id)
                case Finished(answer, _, event_id):
                    yield sse.frame("done", answer.model_dump(mode="json"), event_id)
                case Failed(code, message, event_id):
                    yield sse.frame("error", {"code": code, "message": message}, event_id)
                case TimedOut(timeout_s):
                    message = f"no answer within {timeout_s} s; resume at {_answer_url(stream.session_id, stream.answer_id)}"
                    yield sse.frame("error", {"code": "answer_timeout", "message": message})
                case _:
                    yield sse.KEEPALIVE

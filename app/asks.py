"""Questions and answers: `POST /sessions/{id}/ask` (a JSON answer, Server-Sent Events, or 202
and an answer id), `GET /sessions/{id}/answers` (the conversation) and
`GET /sessions/{id}/answers/{answer_id}` (look up or resume)."""

import re
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app import answers, sse
from app.answers import AnswerStatus, AskedAnswer
from app.deps import AuthorizedSession, KeysDep, Metrics, RedisDep, Settings
from app.errors import ApiError, ErrorBody
from app.metrics import GatewayMetrics
from streamvqa import protocol
from streamvqa.protocol import Answer, AskOptions, DoneEvent, ErrorEvent, QuestionText, SessionRecord, SessionState

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


async def cancel_if_left(request: Request, redis: RedisDep, keys: KeysDep, session_id: str, answer_id: str) -> None:
    """A blocking request whose client has left: its answer cancelled (the worker stops it, or
    never begins it), and 499."""
    if await request.is_disconnected():
        answers.cancel_soon(redis, keys, session_id, answer_id)
        raise ApiError(499, "client_closed_request", "the client left; its answer was cancelled")


def refusal(error: ErrorEvent) -> ApiError:
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
    streaming = body.stream or sse.wants_events(request)
    answer_id = await submit(redis, keys, session, body.question, body, settings, metrics, "sse" if streaming else "rest")
    if streaming:
        location = _answer_url(session.id, answer_id)
        started = sse.frame("started", {"answer_id": answer_id, "location": location})  # no id: resuming starts after it
        events = _answer_events(redis, keys, session.id, answer_id, "0-0", settings, metrics, first=started, leaving_cancels=True)
        return sse.response(events, headers={"Location": location})
    wait_s = settings.ask_timeout_s if body.wait_s is None else min(body.wait_s, settings.ask_timeout_s)
    try:
        async for item in answers.events(redis, keys, session.id, answer_id, wait_s, idle_s=answers.LEAVE_CHECK_S):
            await cancel_if_left(request, redis, keys, session.id, answer_id)  # at each keepalive too
            if item is None:  # a keepalive: a blocking reply has nothing to send meanwhile
                continue
            _, event = item
            if event.type == "error":
                metrics.answers.labels("error").inc()
                raise refusal(event)
            if event.type == "done":
                metrics.answered(event)
                return event.answered(answer_id)
    except answers.AnswerTimeout as err:
        if body.wait_s is None:
            raise ApiError(504, "answer_timeout", f"no answer within {settings.ask_timeout_s} s (answer {answer_id})") from err
        found = await answers.status(redis, keys, session.id, answer_id)
        location = _answer_url(session.id, answer_id)
        pending = AnswerPending(answer_id=answer_id, status=found.status, location=location)
        return JSONResponse(pending.model_dump(), status_code=202, headers={"Location": location})
    raise ApiError(500, "answer_incomplete", "the answer stream ended without a final record")


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
    session: AuthorizedSession, answer_id: str, request: Request, redis: RedisDep, keys: KeysDep,
    settings: Settings, metrics: Metrics,
) -> AnswerStatus:
    """An answer as far as it has come. With `Accept: text/event-stream`, its events as
    Server-Sent Events from the start, or after the `Last-Event-ID` a client last saw."""
    if not ANSWER_ID.fullmatch(answer_id) or (asked := await answers.asked_at(redis, keys, session.id, answer_id)) is None:
        raise ApiError(404, "answer_not_found", f"this session asked no question {answer_id}")
    found = await answers.status(redis, keys, session.id, answer_id)
    if sse.wants_events(request):
        since = sse.last_event_id(request, "0-0")
        if found.status in ("done", "error") and _entry(since) >= _entry(found.last_event_id):
            return sse.response(_nothing())  # the client has seen the whole answer
        return sse.response(_answer_events(redis, keys, session.id, answer_id, since, settings, metrics))
    if found.status == "pending" and time.time() - asked > protocol.ANSWER_TTL_S:
        raise ApiError(410, "answer_expired", f"answers are kept {protocol.ANSWER_TTL_S} s")
    return found


def _entry(event_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = event_id.partition("-")
    return int(milliseconds), int(sequence or 0)


async def _nothing():
    return
    yield


async def submit(
    redis, keys, session: SessionRecord, question: str, options: AskOptions, settings, metrics: GatewayMetrics, via: str,
    after_media: str | None = None,
) -> str:
    """Queue a question (asked via `rest`, `sse`, `socket` or `openai`) with its length and
    sampling, and on a socket the media entry it follows; its answer id. 429 when the session's
    question backlog is full; 404 when it is gone, 409 when it failed."""
    try:
        answer_id = await answers.submit(
            redis, keys, session, question, options.answer_tokens, options.sampling(), settings.session_ttl_s, after_media
        )
    except answers.QuestionsBacklogFull as err:
        raise ApiError(429, "too_many_questions", "too many unanswered questions on this session") from err
    except answers.QuestionRefused as err:
        if err.code == "session_not_found":
            raise ApiError(404, err.code, f"no session {session.id}") from err
        raise ApiError(409, err.code, "the session failed; see its error") from err
    metrics.questions.labels(via).inc()
    return answer_id


async def _answer_events(
    redis, keys, session_id: str, answer_id: str, since: str, settings, metrics: GatewayMetrics, first: str | None = None,
    leaving_cancels: bool = False,
):
    """The answer's events as Server-Sent Events; with `leaving_cancels` (the asking request), a
    client that leaves before the final event cancels the answer."""
    over = False  # the final event came, or the gateway stopped waiting for it
    try:
        if first:
            yield first
        async for item in answers.events(redis, keys, session_id, answer_id, settings.ask_timeout_s, since):
            if item is None:
                yield sse.KEEPALIVE
                continue
            event_id, event = item
            if isinstance(event, DoneEvent):
                over = True
                metrics.answered(event)
                yield sse.frame("done", event.answered(answer_id).model_dump(mode="json"), event_id)
            elif isinstance(event, ErrorEvent):
                over = True
                metrics.answers.labels("error").inc()
                yield sse.frame("error", {"code": event.code, "message": event.message}, event_id)
            else:
                yield sse.frame("token", {"text": event.text}, event_id)
    except answers.AnswerTimeout:
        over = True
        message = f"no answer within {settings.ask_timeout_s} s; resume at {_answer_url(session_id, answer_id)}"
        yield sse.frame("error", {"code": "answer_timeout", "message": message})
    finally:
        if leaving_cancels and not over:  # the client left (the response was cancelled, or closed)
            answers.cancel_soon(redis, keys, session_id, answer_id)

"""An OpenAI-compatible API: `POST /v1/chat/completions` and `GET /v1/models`.

A completion answers against one session's live cache. The session is named by the body's
`session_id` and authorised by its token as the bearer key, so that the official client works
as `OpenAI(base_url=".../v1", api_key=token)` with `extra_body={"session_id": id}`. The last
message, a user's, is the question; the session's own conversation (every question and answer
before, and its system prompt) is already in its cache, so earlier messages are not sent again.
Errors on these routes take OpenAI's shape (app/errors.py).
"""

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from app import answers
from app.answers import AnswerTimeout
from app.asks import cancel_if_left, refusal, submit
from app.deps import SESSION_ID, KeysDep, Metrics, RedisDep, Settings, Store
from app.errors import ApiError, openai_responses
from app.metrics import GatewayMetrics
from streamvqa.protocol import (
    AskOptions, DoneEvent, ErrorEvent, Evidence, QuestionText, SessionRecord, SessionState, TokenEvent,
)

router = APIRouter(prefix="/v1", tags=["openai"])
MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 64
KEEPALIVE_EVENT = ": keepalive\n\n"
_END = object()
_QUESTION = TypeAdapter(QuestionText)
_bearer = HTTPBearer(auto_error=False, description="The session's token, as OpenAI's `api_key`.")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        None, description="Text, or text parts; the video comes from the session."
    )
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, strict=True, description="Send one more chunk, with `usage` and no choices, before [DONE].")


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "streamvqa-demo", "session_id": "3b03e9c6b4a54d0f9d2f0c5e8f1a7b21",
                 "messages": [{"role": "user", "content": "What do you see?"}], "temperature": 0.7, "seed": 1},
            ]
        },
    )

    session_id: str = Field(description="The session to answer about (the `openai` client: `extra_body`).")
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = Field(
        None, max_length=200, description="Informative: the session's own model answers, and the reply names it."
    )
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, strict=True, description="As `ask`'s (0 to 2, 0 greedy); default 0.")
    top_p: float | None = Field(None, strict=True)
    top_k: int | None = Field(None, strict=True)
    seed: int | None = Field(None, strict=True)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, strict=True, description="The answer's most tokens (1 to 1024); default 64.")
    max_completion_tokens: int | None = Field(
        None, strict=True, description="The same as max_tokens (OpenAI's newer name); given both, this one counts."
    )
    n: int = Field(1, ge=1, le=1, strict=True, description="One choice per completion.")
    user: str | None = Field(None, max_length=200, description="Accepted and not used.")

    @field_validator("messages")
    @classmethod
    def _a_user_question_last(cls, messages: list[Message]) -> list[Message]:
        last = messages[-1]
        if last.role != "user":
            raise ValueError(f"the last message is the question: its role must be 'user', not {last.role!r}")
        try:  # the rule of every way of asking
            _QUESTION.validate_python(last.text)
        except ValidationError as err:
            raise ValueError(f"the last message's text: {err.errors()[0]['msg']}") from err
        return messages

    def options(self) -> AskOptions:
        """The question's length and sampling, checked as `ask` checks them (ValidationError);
        `max_completion_tokens` counts over `max_tokens`, as in vLLM."""
        length = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stop": self.stop, "max_tokens": length,
        }
        return AskOptions.model_validate({name: value for name, value in given.items() if value is not None})


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens the question added to the cache, with its turn's markers.")
    completion_tokens: int
    total_tokens: int


class AnswerDetails(BaseModel):
    """What streamvqa says of an answer beyond OpenAI's fields (see `POST /sessions/{id}/ask`)."""

    # the fields of its protocol.Answer that OpenAI's have no place for, and the session

    answer_id: str
    session_id: str
    evidence: list[Evidence]
    recalled_s: list[int]
    video_time_s: float
    cache_tokens: int
    ttft_ms: float | None
    total_ms: float | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    streamvqa: AnswerDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "streamvqa"


class ModelCards(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


async def completion_session(
    body: ChatCompletionRequest, store: Store,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> SessionRecord:
    """The session `session_id` names, when the bearer key is its token: 404, 401 otherwise."""
    if not SESSION_ID.fullmatch(body.session_id):
        raise ApiError(404, "session_not_found", f"no session {body.session_id}")
    record, valid = await store.authenticate(body.session_id, credentials.credentials if credentials else None)
    if record is None:
        raise ApiError(404, "session_not_found", f"no session {body.session_id}")
    if credentials is None or not valid:
        raise ApiError(401, "invalid_api_key", "the API key must be the session's token (OpenAI(api_key=token))")
    await store.touch(body.session_id)
    return record


CompletionSession = Annotated[SessionRecord, Depends(completion_session)]


UNAVAILABLE = {429: "Over the rate limit; see Retry-After.", 503: "Redis is unreachable; see Retry-After."}
COMPLETION_ERRORS = openai_responses({
    400: "A bad request: an option out of range (`invalid_value`, `param` names it), or a body that does not parse.",
    401: "No bearer key, or not the session's token (`invalid_api_key`).",
    404: "No such session (`session_not_found`).",
    409: "`no_video`: no frame in the session's cache yet; `session_error`: its media failed; `context_full`: the "
    "question does not fit in what is left of the model's context.",
    413: "A body over the limit.",
    500: "A bug (`internal_error`); the gateway's log has the details.",
    **UNAVAILABLE,
    504: "`answer_timeout`: no answer within the gateway's ASK_TIMEOUT_S.",
})


@router.get("/models", responses=openai_responses(UNAVAILABLE))
async def list_models(store: Store, settings: Settings) -> ModelCards:
    """The models live workers serve now (a completion is answered by its session's model)."""
    served = sorted({worker.model for worker in await store.live_workers(None)} | {settings.model})
    return ModelCards(data=[ModelCard(id=name) for name in served])


@router.post(
    "/chat/completions",
    responses={
        **COMPLETION_ERRORS,
        422: {"description": "Not sent here: a bad body is a 400, as OpenAI answers it."},
        200: {"content": {"text/event-stream": {}}, "description": "With `stream`: `chat.completion.chunk` events, then `[DONE]`."},
    },
)
async def chat_completions(
    body: ChatCompletionRequest, session: CompletionSession, request: Request, redis: RedisDep, keys: KeysDep,
    settings: Settings, metrics: Metrics,
) -> ChatCompletion:
    """Answer the last user message about the session's video so far, as OpenAI's chat
    completions API does: one JSON completion, or with `stream` its chunks as Server-Sent Events.
    A client that leaves before the answer is done cancels it."""
    try:
        options = body.options()
    except ValidationError as err:
        first = err.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if param == "max_tokens" and body.max_completion_tokens is not None:
            param = "max_completion_tokens"  # the one that counted
        raise ApiError(400, "invalid_value", f"{param}: {first['msg']}" if param else first["msg"], param=param) from err
    if session.state == SessionState.ERROR:
        raise ApiError(409, "session_error", f"the session failed: {session.error}")
    answer_id = await submit(redis, keys, session, body.messages[-1].text, options, settings, metrics, "openai")
    events = answers.events(redis, keys, session.id, answer_id, settings.ask_timeout_s, idle_s=answers.LEAVE_CHECK_S)
    created, name = int(time.time()), session.model
    left = partial(cancel_if_left, request, redis, keys, session.id, answer_id)
    first = await _next_event(events, settings.ask_timeout_s, answer_id, left)  # a refusal is an error reply, not a failed stream
    if isinstance(first, ErrorEvent):
        metrics.answers.labels("error").inc()
        raise refusal(first)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        leave = partial(answers.cancel_soon, redis, keys, session.id, answer_id)
        chunks = _chunks(first, events, f"chatcmpl-{answer_id}", created, name, usage, metrics, leave)
        return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text, done = [], first
    while not isinstance(done, DoneEvent):
        text.append(done.text)
        done = await _next_event(events, settings.ask_timeout_s, answer_id, left)
        if isinstance(done, ErrorEvent):
            metrics.answers.labels("error").inc()
            raise refusal(done)
    metrics.answered(done)
    details = done.answered(answer_id).model_dump(include=set(AnswerDetails.model_fields))
    return ChatCompletion(
        id=f"chatcmpl-{answer_id}", created=created, model=name,
        choices=[Choice(message=ChatMessage(content=done.answer), finish_reason=done.finish_reason)],
        usage=_usage(done), streamvqa=AnswerDetails(**details, session_id=session.id),
    )


async def _next_event(
    events: AsyncIterator, timeout_s: float, answer_id: str, left: Callable[[], Awaitable[None]]
) -> TokenEvent | DoneEvent | ErrorEvent:
    """The answer's next event; 504 when none comes in time; `left` (which raises 499 once the
    client has left, its answer cancelled) awaited at every event and keepalive."""
    try:
        async for item in events:
            await left()
            if item is not None:
                return item[1]
    except AnswerTimeout as err:
        raise ApiError(504, "answer_timeout", f"no answer within {timeout_s} s (answer {answer_id})") from err
    raise ApiError(500, "answer_incomplete", "the answer stream ended without a final record")


async def _chunks(
    first: TokenEvent | DoneEvent, events: AsyncIterator, completion_id: str, created: int, model: str,
    include_usage: bool, metrics: GatewayMetrics, leave: Callable[[], None],
) -> AsyncIterator[str]:
    """`chat.completion.chunk` events: the role, a delta per piece of text, the finish reason
    (with `usage`), with `include_usage` a usage-only chunk, then `[DONE]`. A client that leaves
    before the final event calls `leave` (which cancels the answer)."""

    def chunk(choices: list[dict], **extra) -> str:
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def delta(content: dict, finish_reason: str | None = None) -> list[dict]:
        return [{"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}]

    event, over = first, False  # over: the final event came, or the gateway stopped waiting for it
    try:
        yield chunk(delta({"role": "assistant", "content": ""}))
        while True:
            if isinstance(event, (DoneEvent, ErrorEvent)):
                over = True
            if isinstance(event, DoneEvent):
                metrics.answered(event)
                usage = _usage(event).model_dump()
                yield chunk(delta({}, event.finish_reason), usage=usage)
                if include_usage:
                    yield chunk([], usage=usage)
                break
            if isinstance(event, ErrorEvent):
                metrics.answers.labels("error").inc()
                yield _error_data(event.code, event.message)
                break
            if event is None:
                yield KEEPALIVE_EVENT
            elif event.text:
                yield chunk(delta({"content": event.text}))
            item = await anext(events, _END)
            if item is _END:
                over = True
                yield _error_data("answer_incomplete", "the answer stream ended without a final record")
                break
            event = None if item is None else item[1]
    except AnswerTimeout:
        over = True
        yield _error_data("answer_timeout", "no answer in time")
    finally:
        if not over:  # the client left (the response was cancelled, or closed)
            leave()
    yield "data: [DONE]\n\n"


def _error_data(code: str, message: str) -> str:
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\n"


def _usage(done: DoneEvent) -> Usage:
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.tokens, total_tokens=done.prompt_tokens + done.tokens)

"""An OpenAI-compatible API: `POST /v1/chat/completions`, `GET /v1/models` and `GET /v1/models/{id}`.

A completion answers the user's last question against one session's live cache: a session the
request names (`session_id`, or the `X-Session-Id` header), or the one its media (a `video_url`
or `image_url` part in `messages`) is in, made for it when there is none (app/chat_sessions.py).
The reply names the session in its `X-Session-Id` header and its `session_id` field, so that the
next turn asks the same cache. Errors on these routes take OpenAI's shape (app/errors.py).
"""

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from redis.asyncio import Redis

from app import answer_stream, chat_messages
from app.answer_stream import AnswerItem, AnswerStream, Failed, Finished, Idle, TimedOut, Token
from app.asks import raise_if_left, refusal
from app.chat_messages import MAX_MESSAGES, Message
from app.chat_sessions import ChatSessions
from app.deps import KeysDep, Metrics, RedisDep, Settings, Store
from app.errors import ApiError, openai_error, openai_responses
from app.metrics import GatewayMetrics
from app.settings import GatewaySettings
from app.sessions import SessionStore
from streamvqa.protocol import AskOptions, Evidence, Keys, SessionRecord, SessionState, SessionWarning

router = APIRouter(prefix="/v1", tags=["openai"])
CHAT_PATH = "/v1/chat/completions"
SESSION_HEADER = "X-Session-Id"
KEEPALIVE_EVENT = ": keepalive\n\n"
WARNINGS = TypeAdapter(list[SessionWarning])  # a session record's `warnings`, as its hash holds them (JSON)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, strict=True, description="Send one more chunk, with `usage` and no choices, before [DONE].")


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "streamvqa-demo", "max_tokens": 32, "messages": [
                    {"role": "system", "content": "Answer in one sentence."},
                    {"role": "user", "content": [
                        {"type": "text", "text": "What happens in this video?"},
                        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t..."}},
                    ]},
                ]},
                {"model": "streamvqa-demo", "session_id": "3b03e9c6b4a54d0f9d2f0c5e8f1a7b21",
                 "messages": [{"role": "user", "content": "What do you see?"}], "temperature": 0.7, "seed": 1},
            ]
        },
    )

    session_id: str | None = Field(
        None, description="The session to ask (the `openai` client: `extra_body`); left out, the session of the media "
        "in `messages`, made for it when there is none.",
    )
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = Field(
        None, max_length=200, description="A model of `GET /v1/models` (404 `model_not_found` otherwise); the session's "
        "own when it names one. Left out: the session's model, or the gateway's default.",
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

    def options(self) -> AskOptions:
        """The question's length and sampling, checked as `ask` checks them (ApiError 400 naming
        the option); `max_completion_tokens` counts over `max_tokens`, as in vLLM."""
        length = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stop": self.stop, "max_tokens": length,
        }
        try:
            return AskOptions.model_validate({name: value for name, value in given.items() if value is not None})
        except ValidationError as err:
            first = err.errors()[0]
            param = str(first["loc"][0]) if first["loc"] else None
            if param == "max_tokens" and self.max_completion_tokens is not None:
                param = "max_completion_tokens"  # the one that counted
            message = f"{param}: {first['msg']}" if param else first["msg"]
            raise ApiError(400, "invalid_value", message, param=param) from err


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

    # the fields of its protocol.Answer that OpenAI's have no place for, the session, and its warnings

    answer_id: str
    session_id: str
    evidence: list[Evidence]
    recalled_s: list[int]
    video_time_s: float
    cache_tokens: int
    ttft_ms: float | None
    total_ms: float | None
    warnings: list[SessionWarning] = Field(
        description="The session's warnings when it answered (its record's `warnings`): what the user should know of "
        "its media, as a file cut short (`truncated_media`) or a cache at the model's context (`context_full`)."
    )


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    session_id: str = Field(description="The session asked (also the `X-Session-Id` header): name it in the next turn.")
    choices: list[Choice]
    usage: Usage
    streamvqa: AnswerDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time (s) the gateway started, from which it has served the model.")
    owned_by: str = "streamvqa"


class ModelCards(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


UNAVAILABLE = {429: "Over the rate limit; see Retry-After.", 503: "Redis is unreachable; see Retry-After."}
COMPLETION_ERRORS = openai_responses({
    400: "A bad request: an option out of range (`invalid_value`, `param` names it), a body or message that cannot be "
    "used (`invalid_request`), media that cannot be read or that the worker refuses (`invalid_media_url`, "
    "`media_unreachable`, `invalid_media`, "
    "`too_many_media`), a system message or model not the named session's (`system_prompt_mismatch`, `model_mismatch`).",
    401: "Not the session's token, nor (with API_KEYS) the key that owns it (`invalid_api_key`).",
    404: "No such session (`session_not_found`), or no such model (`model_not_found`).",
    409: "`no_video`: no frame in the session's cache yet; `session_error`: its media failed; `context_full`: the "
    "question does not fit in what is left of the model's context; `media_exists`: the named session has other media.",
    413: "A body over the limit (`body_too_large`), or media over its own (`media_too_large`).",
    500: "A bug (`internal_error`); the gateway's log has the details.",
    **UNAVAILABLE,
    503: "Redis is unreachable (`redis_unreachable`); no worker or no room for a session made for media (`no_worker`, "
    "`no_capacity`); another request kept making the session for the same media (`session_busy`); MAX_CHAT_MEDIA_REQUESTS "
    "requests held media in the gateway's memory while this one waited its turn (`media_busy`). See Retry-After.",
    504: "`answer_timeout`: no answer within the gateway's ASK_TIMEOUT_S; `ingest_timeout`: the media not read by then.",
})


async def known_models(store: SessionStore, settings: GatewaySettings, live: bool) -> list[str]:
    """The gateway's default model and those of live workers (`live`), or of every worker in
    the registry (the models `POST /sessions` knows)."""
    workers = await (store.live_workers(None) if live else store.workers())
    return sorted({worker.model for worker in workers} | {settings.model})


def _no_model(model: str) -> ApiError:
    return ApiError(
        404, "model_not_found", f"the model {model!r} does not exist: GET /v1/models lists the models served",
        param="model", type="invalid_request_error",
    )


@router.get("/models", responses=openai_responses(UNAVAILABLE))
async def list_models(request: Request, store: Store, settings: Settings) -> ModelCards:
    """The models live workers serve now, and the gateway's default."""
    created = request.app.state.started_at
    return ModelCards(data=[ModelCard(id=name, created=created) for name in await known_models(store, settings, live=True)])


@router.get(
    "/models/{model_id:path}",
    responses=openai_responses({404: "No live worker serves this model (`model_not_found`).", **UNAVAILABLE}),
)
async def get_model(model_id: str, request: Request, store: Store, settings: Settings) -> ModelCard:
    """One model of `GET /v1/models`."""
    if model_id not in await known_models(store, settings, live=True):
        raise _no_model(model_id)
    return ModelCard(id=model_id, created=request.app.state.started_at)


def _inlined(schema: dict) -> dict:
    """A model's JSON schema with its definitions written in place (no `$ref`): the schema of a
    body the route reads itself, for the OpenAPI document."""
    definitions = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            named = definitions[node["$ref"].rsplit("/", 1)[1]]
            return inline({**named, **{key: value for key, value in node.items() if key != "$ref"}})
        return {key: inline(value) for key, value in node.items()}

    return inline(schema)


REQUEST_BODY = {"required": True, "content": {"application/json": {"schema": _inlined(ChatCompletionRequest.model_json_schema())}}}


async def _read_body(request: Request) -> ChatCompletionRequest:
    """The request's JSON body, read as FastAPI reads one (RequestValidationError: a 400), keeping
    no copy of it: a body with a video is tens of MB, and only the media's bytes are held on, until
    they are sent (`chat_messages.MediaRef.take_url`, `chat_media.Media.take_chunks`)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid "
                                       "dictionary or object to extract fields from", "input": b""}])
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads decodes bytes
        del raw
        document = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        position = err.pos if isinstance(err, json.JSONDecodeError) else err.start
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error", "input": {}}]
        ) from None
    del text
    try:
        return ChatCompletionRequest.model_validate(document)  # its strings are the document's own, not copies
    except ValidationError as err:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in err.errors()]) from None


@router.post(
    "/chat/completions",
    openapi_extra={"requestBody": REQUEST_BODY},
    responses={
        **COMPLETION_ERRORS,
        422: {"description": "Not sent here: a bad body is a 400, as OpenAI answers it."},
        200: {"content": {"text/event-stream": {}}, "description": "With `stream`: `chat.completion.chunk` events, then `[DONE]`."},
    },
)
async def chat_completions(
    chat: Annotated[ChatSessions, Depends()], request: Request, response: Response,
    redis: RedisDep, keys: KeysDep, store: Store, settings: Settings, metrics: Metrics,
    x_session_id: Annotated[str | None, Header(description="The session to ask, as `session_id`.")] = None,
) -> ChatCompletion:
    """Answer the last user message about the session's video so far, as OpenAI's chat
    completions API does: one JSON completion, or with `stream` its chunks as Server-Sent Events.
    A client that leaves before the answer is done cancels it. A body that may carry media is
    read once one of MAX_CHAT_MEDIA_REQUESTS places is free (`chat_media.MediaSlots`)."""
    try:
        length = request.headers.get("content-length", "")
        if not length.isdigit() or int(length) > settings.max_body_bytes:  # a body that may carry a data URL
            await chat.room.take()
        body = await _read_body(request)
        options = body.options()
        if body.model is not None and body.model not in await known_models(store, settings, live=False):
            raise _no_model(body.model)
        dialogue = chat_messages.read(body.messages)
        if body.session_id and x_session_id and body.session_id != x_session_id:
            raise ApiError(400, "invalid_request", f"session_id and the {SESSION_HEADER} header name two sessions",
                           param="session_id")
        session = await chat.session_for(body.session_id or x_session_id, dialogue, body.model)
    finally:
        chat.room.leave()  # its media, if any, is sent on by now (or the request failed)
    named = {SESSION_HEADER: session.id}
    try:
        question = await chat.question(session, dialogue)
        return await _answer(body, session, question, options, request, redis, keys, settings, metrics, response)
    except ApiError as err:
        err.headers = {**(err.headers or {}), **named}
        raise


async def _answer(
    body: ChatCompletionRequest, session: SessionRecord, question: str, options: AskOptions, request: Request,
    redis: Redis, keys: Keys, settings: GatewaySettings, metrics: GatewayMetrics, response: Response,
) -> ChatCompletion | StreamingResponse:
    if session.state == SessionState.ERROR:
        raise ApiError(409, "session_error", f"the session failed: {session.error}")
    stream = await answer_stream.ask(
        redis, keys, session, question, options, settings.session_ttl_s, metrics, "openai", settings.ask_timeout_s,
        answer_stream.LEAVE_CHECK_S,
    )
    created, name, completion_id = int(time.time()), session.model, f"chatcmpl-{stream.answer_id}"
    try:
        first = await _next_item(stream, request)  # a refusal is an error reply, not a failed stream
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = _chunks(first, stream, completion_id, created, name, session.id, usage, redis, keys)
            headers = {"Cache-Control": "no-cache", SESSION_HEADER: session.id}
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        done = first
        while not isinstance(done, Finished):
            done = await _next_item(stream, request)
    except BaseException:
        stream.close()
        raise
    response.headers[SESSION_HEADER] = session.id
    return ChatCompletion(
        id=completion_id, created=created, model=name, session_id=session.id,
        choices=[Choice(message=ChatMessage(content=done.answer.answer), finish_reason=done.answer.finish_reason)],
        usage=_usage(done), streamvqa=await _details(redis, keys, session.id, done),
    )


async def _details(redis: Redis, keys: Keys, session_id: str, done: Finished) -> AnswerDetails:
    """The answer's details, with the session's warnings as its record holds them now (the
    worker adds them as it reads the media, after the session was looked up)."""
    warnings = await redis.hget(keys.session(session_id), "warnings")
    return AnswerDetails(
        **done.answer.model_dump(include=set(AnswerDetails.model_fields)), session_id=session_id,
        warnings=WARNINGS.validate_json(warnings or b"[]"),
    )


async def _next_item(stream: AnswerStream, request: Request) -> Token | Finished:
    """The answer's next token or its end; a refusal, a timeout (504) or a client that left (499,
    checked at every item and keepalive) as an error reply."""
    async for item in stream:
        await raise_if_left(request)
        if isinstance(item, Failed):
            raise refusal(item)
        if isinstance(item, TimedOut):
            raise ApiError(504, "answer_timeout", f"no answer within {item.timeout_s} s (answer {stream.answer_id})")
        if not isinstance(item, Idle):
            return item
    raise ApiError(500, "answer_incomplete", "the answer stream ended without a final record")


async def _chunks(
    first: Token | Finished, stream: AnswerStream, completion_id: str, created: int, model: str, session_id: str,
    include_usage: bool, redis: Redis, keys: Keys,
) -> AsyncIterator[str]:
    """`chat.completion.chunk` events: the role, a delta per piece of text, the finish reason
    (with `usage`, and the `streamvqa` details a whole completion has), with `include_usage` a
    usage-only chunk, then `[DONE]`. A client that leaves before the final event cancels the answer."""

    def chunk(choices: list[dict], **extra) -> str:
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "session_id": session_id, "choices": choices, **extra}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def delta(content: dict, finish_reason: str | None = None) -> list[dict]:
        return [{"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}]

    async def items() -> AsyncIterator[AnswerItem]:
        yield first
        async for item in stream:
            yield item

    async with stream:
        yield chunk(delta({"role": "assistant", "content": ""}))
        async for item in items():
            match item:
                case Token(text, _) if text:
                    yield chunk(delta({"content": text}))
                case Finished(answer, _, _):
                    usage = _usage(item).model_dump()
                    details = (await _details(redis, keys, session_id, item)).model_dump(mode="json")
                    yield chunk(delta({}, answer.finish_reason), usage=usage, streamvqa=details)
                    if include_usage:
                        yield chunk([], usage=usage)
                case Failed(code, message, _):
                    yield _error_data(code, message)
                case TimedOut():
                    yield _error_data("answer_timeout", "no answer in time")
                case Idle():
                    yield KEEPALIVE_EVENT
    yield "data: [DONE]\n\n"


def _error_data(code: str, message: str) -> str:
    return f"data: {json.dumps(openai_error(500, code, message))}\n\n"


def _usage(finished: Finished) -> Usage:
    prompt, completion = finished.done.prompt_tokens, finished.done.tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

"""The REST API. Each route parses, calls a service, and answers."""

import time

from fastapi import APIRouter, Request, status
from pydantic import BaseModel, Field

from app import answers
from app.deps import AuthorizedSession, KeysDep, RedisDep, Settings, Store
from app.errors import ApiError
from app.sessions import UploadRefused
from app.uploads import file_chunks
from streamvqa.protocol import MAX_ANSWER_TOKENS, Evidence, SessionOptions, SessionRecord, SessionState

router = APIRouter()

NO_WORKER_RETRY_S = 5


class CreatedSession(BaseModel):
    id: str
    token: str = Field(description="Send as 'Authorization: Bearer <token>' on every call for this session.")
    session: SessionRecord


class UploadReceipt(BaseModel):
    bytes: int


class AskRequest(BaseModel):
    question: str = Field(min_length=1, max_length=4000)
    max_new_tokens: int = Field(64, ge=1, le=MAX_ANSWER_TOKENS)


class Answer(BaseModel):
    answer_id: str
    answer: str
    tokens: int
    evidence: list[Evidence] = Field(description="The frames the answer attended to most, strongest first.")
    video_time_s: float = Field(description="Video time of the last frame the answer could see.")
    cache_tokens: int = Field(description="KV cache tokens when the answer finished.")
    ttft_ms: float = Field(description="From the question reaching the gateway to the first answer token.")
    total_ms: float


@router.get("/healthz")
async def healthz(redis: RedisDep) -> dict[str, str]:
    try:
        await redis.ping()
    except Exception as err:
        raise ApiError(503, "redis_unreachable", f"Redis is unreachable: {err}") from err
    return {"status": "ok"}


@router.post("/sessions", status_code=status.HTTP_201_CREATED)
async def create_session(store: Store, settings: Settings, options: SessionOptions | None = None) -> CreatedSession:
    options = options or SessionOptions()
    model = options.model or settings.model
    workers = await store.live_workers(model)
    retry = {"Retry-After": str(NO_WORKER_RETRY_S)}
    if not workers:
        raise ApiError(503, "no_worker", f"no worker serves model {model!r} now", retry)
    if not any(w.fits(options.budget_tokens) for w in workers):
        raise ApiError(
            503, "no_capacity", f"no worker serving {model!r} has room for a {options.budget_tokens}-token cache now", retry
        )
    record, token = await store.create(options, model)
    return CreatedSession(id=record.id, token=token, session=record)


@router.get("/sessions/{session_id}")
async def get_session(session: AuthorizedSession) -> SessionRecord:
    return session


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session: AuthorizedSession, store: Store) -> None:
    """Forget the session; its worker frees its memory within a few seconds."""
    await store.delete(session.id)


@router.post("/sessions/{session_id}/upload", status_code=status.HTTP_202_ACCEPTED)
async def upload(session: AuthorizedSession, request: Request, store: Store, settings: Settings) -> UploadReceipt:
    """A video file as the raw body or as the first file of a multipart form; decoding goes on after the reply."""
    if int(request.headers.get("content-length") or 0) > settings.max_upload_bytes:
        raise ApiError(413, "upload_too_large", f"the upload exceeds the limit of {settings.max_upload_bytes} bytes")
    chunks = file_chunks(request)
    try:
        total = await store.upload(session.id, chunks, settings.max_upload_bytes, settings.upload_stall_s)
    except UploadRefused as err:
        raise ApiError(err.status, err.code, str(err)) from err
    return UploadReceipt(bytes=total)


@router.post("/sessions/{session_id}/ask")
async def ask(session: AuthorizedSession, body: AskRequest, redis: RedisDep, keys: KeysDep, settings: Settings) -> Answer:
    """Ask about what the session has seen so far; waits for the whole answer."""
    if session.state == SessionState.ERROR:
        raise ApiError(409, "session_error", f"the session failed: {session.error}")
    started = time.monotonic()
    try:
        answer_id = await answers.submit(redis, keys, session.id, body.question, body.max_new_tokens)
    except answers.QuestionsBacklogFull as err:
        raise ApiError(429, "too_many_questions", "too many unanswered questions on this session") from err
    ttft_ms = None
    try:
        async for event in answers.events(redis, keys, answer_id, settings.ask_timeout_s):
            if ttft_ms is None:
                ttft_ms = (time.monotonic() - started) * 1000
            if event.type == "error":
                if event.code == "session_reset":  # its worker died while answering: ask again
                    raise ApiError(503, event.code, event.message, {"Retry-After": "1"})
                raise ApiError(409 if event.code == "session_error" else 500, event.code, event.message)
            if event.type == "done":
                return Answer(
                    answer_id=answer_id,
                    answer=event.answer,
                    tokens=event.tokens,
                    evidence=event.evidence,
                    video_time_s=event.video_time_s,
                    cache_tokens=event.cache_tokens,
                    ttft_ms=round(ttft_ms, 1),
                    total_ms=round((time.monotonic() - started) * 1000, 1),
                )
    except answers.AnswerTimeout as err:
        raise ApiError(504, "answer_timeout", f"no answer within {settings.ask_timeout_s} s (answer {answer_id})") from err
    raise ApiError(500, "answer_incomplete", "the answer stream ended without a final record")

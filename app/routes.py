"""The sessions API: create, list, look up, delete, upload, memory, events. Each route parses,
calls a service, and answers."""

import time

from fastapi import APIRouter, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from app import sse
from app.deps import AuthorizedSession, Caller, KeysDep, Metrics, OwnedSession, RedisDep, SessionViewer, Settings, Store
from app.errors import CLOSE, ApiError, ErrorBody
from app.sessions import NoPlace, Room, TooManySessions, UploadRefused
from app.settings import GatewaySettings
from app.tail import last_id, tail
from app.uploads import file_chunks
from streamvqa.protocol import EventEnvelope, MemoryReport, SessionOptions, SessionRecord

router = APIRouter(tags=["sessions"])

NO_WORKER_RETRY_S = 5


class CreatedSession(BaseModel):
    id: str
    token: str = Field(description="Send as 'Authorization: Bearer <token>' on every call for this session.")
    session: SessionRecord


class SessionList(BaseModel):
    sessions: list[SessionRecord] = Field(
        description="The caller's sessions, failed ones among them, newest first: those of its API key; without API "
        "keys, the one whose token it sends (every one of its address where ADDRESS_OWNS_SESSIONS is set)."
    )
    counted: int = Field(
        description="Of all the caller's sessions (its API key's, else its address's), listed or not, those that count "
        "toward `max_sessions`: all but the failed ones."
    )
    max_sessions: int = Field(description="The most sessions that count one caller may hold (MAX_SESSIONS_PER_KEY).")


class UploadReceipt(BaseModel):
    bytes: int


class WorkerMemory(BaseModel):
    """What one worker offers its sessions, and why."""

    worker: str
    dtype: str = Field("", description="What its model computes and caches in: `float32` or `bfloat16` (its DTYPE setting).")
    kv_memory: str = Field(description="Its KV_MEMORY setting: `auto`, a share of its device's memory, or bytes.")
    kv_memory_bytes: int = Field(description="Cache memory it offers now: what the setting states, or less while memory is short.")
    kv_free_bytes: int = Field(description="Of that, what its sessions have not reserved.")
    device_free_bytes: int = Field(description="Memory free on its device (to anyone) when it last looked.")
    host_memory: str = Field(description="Its HOST_MEMORY setting.")
    host_memory_bytes: int = Field(description="Host memory it offers host tiers now.")
    host_free_bytes: int = Field(description="Of that, what its sessions have not reserved.")
    ram_free_bytes: int = Field(description="RAM free (to anyone) when it last looked.")
    default_sessions: int = Field(description="Sessions with the default options its cache memory holds.")
    warning: str | None = Field(description="Set while that is under 2: why, and what to do.")
    pool_pages: int = Field(0, description="Pages of its KV pool, sized at start (on a CPU, RAM taken as they are written and given back as sessions end): every session's cache is a run of them.")
    pool_free_pages: int = Field(0, description="Of those, the pages no session leases.")
    pool_page_tokens: int = Field(0, description="Cache tokens a page holds (keys, values and rotated keys, in every layer).")
    pool_bytes: int = Field(0, description="Bytes of the whole pool.")
    pool_session_pages: dict[str, int] = Field(
        {}, description="Pages each of the caller's sessions (those `GET /sessions` lists) leases here, by session id."
    )
    host_pool_pages: int = Field(0, description="Pages of its host pool, sized at start as the KV pool is: every host tier (recall) is a run of them.")
    host_pool_free_pages: int = Field(0, description="Of those, the pages no session leases.")
    host_pool_page_tokens: int = Field(0, description="Stream places a host page holds (keys, values, kinds and times, in every layer).")
    host_pool_bytes: int = Field(0, description="Bytes of the whole host pool, in host memory (pinned on CUDA).")
    host_pool_session_pages: dict[str, int] = Field(
        {}, description="Host pages each of the caller's sessions with recall leases here, by session id."
    )


class ServedModel(BaseModel):
    name: str
    workers: int = Field(description="Live workers serving it.")
    sessions: int = Field(description="Sessions they hold.")
    max_sessions: int = Field(description="Sessions they may hold.")
    memory: list[WorkerMemory] = Field([], description="Each worker's memory for its sessions, read again as sessions come and go.")


class ModelList(BaseModel):
    default: str = Field(description="The model of a session created without one.")
    models: list[ServedModel] = Field(description="The models live workers serve now, by name.")


def _invalid(field: str, model: str, err: ValueError) -> RequestValidationError:
    """Options that do not fit the model: a 422 like any invalid field, naming `field`."""
    reason = str(err)
    if isinstance(err, ValidationError):  # the options checked again with the budget chosen
        reason = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())
    return RequestValidationError([{"loc": ("body", field), "msg": f"{model}: {reason}", "type": "value_error"}])


@router.post("/sessions", status_code=status.HTTP_201_CREATED)
async def create_session(
    store: Store, settings: Settings, caller: Caller, metrics: Metrics, options: SessionOptions | None = None
) -> CreatedSession:
    """Create a session. All options are optional; the reply holds the session's token."""
    options = options or SessionOptions()
    model = options.model or settings.model
    registry = await store.workers()
    workers = [w for w in registry if w.alive and w.model == model]
    retry = {"Retry-After": str(NO_WORKER_RETRY_S)}
    if not workers:
        if model != settings.model and model not in {w.model for w in registry}:
            raise ApiError(404, "model_not_found", f"no worker serves model {model!r}; GET /models lists the models served")
        raise ApiError(503, "no_worker", f"no worker serves model {model!r} now", retry)
    context_tokens = min((w.context_tokens for w in workers if w.context_tokens), default=0)
    try:
        options = options.within(context_tokens)
    except ValueError as err:  # a 422 like any invalid field, naming the model's limit
        raise _invalid("budget_tokens" if options.budget_tokens is not None else "policy", model, err) from err
    try:  # every worker of a model counts the same pins: the least is the safe side
        options.check_pins(min(w.opening_tokens for w in workers), min(w.turn_marker_tokens for w in workers))
    except ValueError as err:
        raise _invalid("pin_turns", model, err) from err
    peak_tokens = options.peak_tokens(context_tokens)
    tier = f" and a {options.host_tokens}-token host tier" if options.recall else ""
    no_room = f"no worker serving {model!r} has room now for a cache of {peak_tokens} tokens at its peak{tier}"
    if not any(w.fits(peak_tokens, options.host_tokens) for w in workers):
        raise ApiError(503, "no_capacity", no_room, retry)
    room = Room.of(workers, peak_tokens, options.host_tokens)
    try:
        record, token = await store.create(options, model, context_tokens, caller, settings.max_sessions_per_key, room)
    except TooManySessions as err:
        raise too_many_sessions(settings) from err
    except NoPlace as err:
        raise ApiError(503, "no_capacity", _no_place(err.short, model, room, no_room), retry) from err
    metrics.sessions_created.inc()
    return CreatedSession(id=record.id, token=token, session=record)


def too_many_sessions(settings: GatewaySettings) -> ApiError:
    """The 429 of a caller at MAX_SESSIONS_PER_KEY, saying how it ends one of its sessions."""
    held = f"this caller holds {settings.max_sessions_per_key} sessions (MAX_SESSIONS_PER_KEY), failed ones left out"
    if settings.api_key_list or settings.address_owns_sessions:
        owner = "with the same X-API-Key" if settings.api_key_list else "from the same address"
        how = f"GET /sessions lists them and DELETE /sessions/{{id}} ends one, {owner} or with its token"
    else:
        how = f"DELETE /sessions/{{id}} with its token ends one (sessions idle for {settings.session_ttl_s} s end by themselves)"
    return ApiError(429, "too_many_sessions", f"{held}; end one first: {how}")


def _no_place(short: str, model: str, room: Room, no_room: str) -> str:
    """Why NoPlace: no place, or `no_room` (what the session needs) and which memory is reserved,
    with what each worker offers (a session takes its memory on one worker, never across them)."""
    if short == "places":
        return f"the workers serving {model!r} hold as many active sessions as they may ({room.places}); idle ones leave them"
    memory, limits = ("cache", room.device_limits) if short == "device" else ("host tier", room.host_limits)
    mib = [f"{limit / 2**20:,.1f}" for limit in limits]
    offers = f"{mib[0]} MiB" if len(set(mib)) == 1 else f"{', '.join(mib)} MiB"
    each = f" on each of {len(mib)} workers" if len(mib) > 1 and len(set(mib)) == 1 else ""
    return (
        f"{no_room}: the sessions each worker holds or is about to take reserve the rest of the {memory} "
        f"memory it offers ({offers}{each}); idle ones give theirs back"
    )


@router.get("/models")
async def list_models(store: Store, settings: Settings, viewer: SessionViewer) -> ModelList:
    """The models sessions can be created with now (each served by at least one live worker), and
    what memory each worker offers. With API_KEYS it needs one (X-API-Key). The pages leased by
    session name only the caller's sessions, as `GET /sessions` lists them."""
    workers = await store.live_workers(None)
    own = {session.id for session in (await store.owned(viewer.owner, viewer.every, viewer.token))[0]}
    served = {}
    for worker in sorted(workers, key=lambda w: w.id):
        entry = served.setdefault(worker.model, ServedModel(name=worker.model, workers=0, sessions=0, max_sessions=0))
        entry.workers += 1
        entry.sessions += worker.sessions
        entry.max_sessions += worker.max_sessions
        entry.memory.append(WorkerMemory.model_validate({
            **worker.model_dump(include=set(WorkerMemory.model_fields)), "worker": worker.id,
            "warning": worker.memory_warning, "pool_session_pages": _only(worker.pool_session_pages, own),
            "host_pool_session_pages": _only(worker.host_pool_session_pages, own),
        }))
    return ModelList(default=settings.model, models=sorted(served.values(), key=lambda m: m.name))


def _only(pages: dict[str, int], own: set[str]) -> dict[str, int]:
    return {session_id: count for session_id, count in pages.items() if session_id in own}


@router.get("/sessions")
async def list_sessions(store: Store, settings: Settings, viewer: SessionViewer) -> SessionList:
    """The caller's sessions, failed ones among them: those created with the same API key, which
    ends any of them with `DELETE /sessions/{id}` without its token. Without API keys, of those
    created from the same client address, the one whose token is sent as the bearer token (every
    one, without a token, where ADDRESS_OWNS_SESSIONS is set). Tokens are not included."""
    sessions, counted = await store.owned(viewer.owner, viewer.every, viewer.token)
    return SessionList(sessions=sessions, counted=counted, max_sessions=settings.max_sessions_per_key)


@router.get("/sessions/{session_id}")
async def get_session(session: AuthorizedSession) -> SessionRecord:
    return session


@router.delete("/sessions/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session: OwnedSession, store: Store) -> None:
    """End the session: forget it and its answers; its worker stops what it does for it at its
    next step and frees its memory. With the session's token, or as its owner: the API key that
    created it (X-API-Key, or as the bearer token), or without API_KEYS, where
    ADDRESS_OWNS_SESSIONS is set, the address it was created from (with no bearer token)."""
    await store.delete(session)


UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}}}
            },
        },
    }
}


@router.post(
    "/sessions/{session_id}/upload", status_code=status.HTTP_202_ACCEPTED, openapi_extra=UPLOAD_BODY,
    responses={
        408: {"model": ErrorBody, "description": "`upload_too_slow`: under UPLOAD_MIN_BYTES_PER_S."},
        409: {"model": ErrorBody, "description": "`media_exists`: a second upload; `session_error`: the session failed."},
    },
)
async def upload(
    session: AuthorizedSession, request: Request, store: Store, settings: Settings, metrics: Metrics
) -> UploadReceipt:
    """A video file as the raw body or as the first file of a multipart form; decoding goes on
    after the reply. Its progress: `upload_bytes` and `media_duration_s` in the session, and
    `ingest` events on `GET /sessions/{id}/events`."""
    if int(request.headers.get("content-length") or 0) > settings.max_upload_bytes:
        raise ApiError(413, "upload_too_large", f"the upload exceeds the limit of {settings.max_upload_bytes} bytes")
    chunks = file_chunks(request, settings.upload_min_bytes_per_s)
    try:
        total = await store.upload(session, chunks, settings.max_upload_bytes, settings.upload_stall_s)
    except UploadRefused as err:
        raise ApiError(err.status, err.code, str(err), headers=CLOSE) from err
    metrics.upload_bytes.inc(total)
    return UploadReceipt(bytes=total)


@router.get("/sessions/{session_id}/memory")
async def memory(session: AuthorizedSession, redis: RedisDep, keys: KeysDep) -> MemoryReport:
    """What the session's bounded cache holds now: tokens per kind, and per span of video time
    how many frame tokens were appended, how many are still held on the device, and (with
    recall) how many are in the host tier; the rest were dropped (the dashboard's memory view).
    Updated by the worker at most once a second while it ingests, and after each answer."""
    stored = await redis.get(keys.memory(session.id))
    if stored is not None:
        return MemoryReport.model_validate_json(stored)
    return MemoryReport(
        policy=session.policy,
        budget_tokens=None if session.policy == "full" else session.budget_tokens,
        cache_tokens=session.cache_tokens, frame_tokens=0, text_tokens=0, evictions=0, evicted_tokens=0,
        frames=session.frames_ingested, video_time_s=session.video_time_s, spans=[], updated_at=session.created_at,
        recall=session.recall, host_budget_tokens=session.host_budget_tokens,
    )


@router.get(
    "/sessions/{session_id}/events",
    response_class=sse.StreamingResponse,
    responses={200: {"content": {sse.EVENT_STREAM: {}}, "description": "Server-Sent Events"}},
)
async def session_events(session: AuthorizedSession, request: Request, redis: RedisDep, keys: KeysDep, since: str | None = None):
    """The session's events as Server-Sent Events (`ingest`, `state`, `warning`, `error`): the
    same events a stream socket relays, named by type, each with an id. New events only, unless
    `since=0` (every retained event) or a `Last-Event-ID` to resume after. Ends with a `gone`
    event when the session is deleted or expires."""
    start = sse.last_event_id(request, "0-0" if since == "0" else "") or await last_id(redis, keys.events(session.id))
    return sse.response(_session_events(redis, keys, session.id, start))


async def _session_events(redis, keys, session_id: str, since: str):
    """Frames of the session's events; after each read that found none, a look whether the
    session is still there, and a keepalive once sse.KEEPALIVE_S passed without a frame."""
    said_at = time.monotonic()
    async for item in tail(redis, keys.events(session_id), since, EventEnvelope, 64, 0):
        if item is not None:
            event_id, event = item
            said_at = time.monotonic()
            yield sse.frame(event.type, event.model_dump(mode="json"), event_id)
        elif not await redis.exists(keys.session(session_id)):
            yield sse.frame("gone", {"type": "gone", "message": "the session was deleted or expired"})
            return
        elif time.monotonic() - said_at >= sse.KEEPALIVE_S:
            said_at = time.monotonic()
            yield sse.KEEPALIVE

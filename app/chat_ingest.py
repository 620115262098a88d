"""Media of a chat completion into its session, by the paths every client's media takes: a video
as an upload (`SessionStore.upload`: its limits, its backpressure), an image as a stream
socket's one `frames` message followed by its end. Then the wait until the worker has it all
in the session's cache."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis

from app import media_stream
from app.chat_media import Media, limit_bytes
from app.errors import ApiError
from app.sessions import SessionStore, UploadRefused
from app.settings import GatewaySettings
from streamvqa import protocol
from streamvqa.protocol import Keys, MediaEntry, MediaKind, SessionRecord, SessionState, frame_message, scripts

INGEST_POLL_S = 0.2
ADDED = {
    media_stream.GONE: (404, "session_not_found", "the session was deleted"),
    media_stream.FAILED: (409, "session_error", "the session failed"),
    media_stream.NOT_CLAIMED: (409, "media_exists", "another client is streaming into this session"),
}  # media_stream.add's refusals


async def ingest(store: SessionStore, session: SessionRecord, media: Media, settings: GatewaySettings) -> int:
    """Send the media into the session; its byte count. ApiError as an upload or a socket is refused."""
    try:
        if media.kind == "video":
            return await store.upload(session, _chunks(media.data), limit_bytes("video", settings), settings.upload_stall_s)
        return await _send_frame(store.redis, store.keys, session, media.data)
    except UploadRefused as err:
        raise ApiError(err.status, err.code, str(err), param=media.param) from err


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), protocol.MEDIA_CHUNK_BYTES):
        yield data[start : start + protocol.MEDIA_CHUNK_BYTES]


async def _send_frame(redis: Redis, keys: Keys, session: SessionRecord, image: bytes) -> int:
    """One image as a `frames` stream of one frame at 0 s: connect, the frame, end, disconnect."""
    connection = f"chat-{uuid.uuid4().hex[:16]}"
    claim = keys.streamer(session.id)
    claimed = await redis.eval(
        scripts.CLAIM_MEDIA_LUA, 2, keys.session(session.id), claim, "frames", connection,
        protocol.STREAMER_TTL_S * 1000, "",
    )
    if claimed in (-2, -3):
        raise UploadRefused(409, "media_exists", "this session already has its media")
    if claimed in (-1, -4):  # gone, failed: as ADD_MEDIA_ENTRY_LUA's -1, -2
        raise UploadRefused(*ADDED[-1 if claimed == -1 else -2])
    message = frame_message(0.0, image)
    try:
        for entry, frame_s in (
            (MediaEntry(MediaKind.CONNECT, format="frames", connection=connection), None),
            (MediaEntry(MediaKind.FRAME, data=message), 0.0),
            (MediaEntry(MediaKind.END), None),
        ):
            await _add(redis, keys, session, connection, entry, frame_s)
    finally:
        await _add(redis, keys, session, connection, MediaEntry(MediaKind.DISCONNECT, connection=connection), None, closing=True)
        await redis.eval(scripts.RELEASE_LUA, 1, claim, connection)
    return len(image)


async def _add(
    redis: Redis, keys: Keys, session: SessionRecord, connection: str, entry: MediaEntry, frame_s: float | None,
    closing: bool = False,
) -> None:
    stream_bytes = len(entry.data) if entry.kind == MediaKind.FRAME else 0
    added = await media_stream.add(redis, keys, session, connection, entry, stream_bytes, frame_s)
    if not closing and isinstance(added, int) and added in ADDED:
        raise UploadRefused(*ADDED[added])


async def wait_until_ingested(
    redis: Redis, keys: Keys, session_id: str, timeout_s: float, left: Callable[[], Awaitable[None]]
) -> str | None:
    """Wait until the worker has taken the session's media into its cache: None, or the
    session's error when it failed. ApiError 504 after `timeout_s`; `left` is awaited at each look
    (it raises once the client has gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, error = await redis.hmget(keys.session(session_id), "state", "error")
        if state is None:
            raise ApiError(404, "session_not_found", f"the session {session_id} was deleted while its media was read")
        if state.decode() == SessionState.INGESTED:
            return None
        if state.decode() == SessionState.ERROR:
            return (error or b"").decode() or "the media could not be read"
        await left()
        if time.monotonic() > deadline:
            raise ApiError(504, "ingest_timeout", f"the media was not read within {timeout_s:g} s; ask again later "
                           f"with session_id {session_id}")
        await asyncio.sleep(INGEST_POLL_S)

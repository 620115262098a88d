"""Media of a chat completion into its session, by the paths every client's media takes: a video
as an upload (`SessionStore.upload`: its limits, its backpressure), an image as a stream
socket's one `frames` message followed by its end. Then the wait until the worker has it all
in the session's cache, or has refused it: the session failed (a video), or the image's
`frames` stream ended with no frame decoded (the worker's `bad_frame` and `empty_stream` events,
as a stream socket hears them).

An image's stream is named by its content (`image_connection`), so that every request waiting for
the same image in the same session (the same content at the same moment, or sent again) finds
the worker's verdict in the session's events, whichever request sent it. A session made for
media the worker refused is deleted; its refusal is kept under `Keys.chat_refused` for
REFUSAL_TTL_S, for the requests that were waiting for it.
"""

from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis

from app import media_stream
from app.chat_media import Media, limit_bytes
from app.errors import ApiError
from app.sessions import SessionStore, UploadRefused
from app.settings import GatewaySettings
from app.tail import TailTimeout, tail
from streamvqa import protocol
from streamvqa.protocol import (
    EventEnvelope, Keys, MediaEntry, MediaErrorEvent, MediaKind, SessionRecord, SessionState, StateEvent, frame_message,
    scripts,
)

MEDIA_FIELD = "chat_media_sha256"  # in a session's hash: the SHA-256 of the media this route sent into it (its claim)
REFUSAL_TTL_S = 60  # how long the refusal of a session deleted for it is kept for requests that waited for it
IMAGE_TIME = "frame at 0.000 s: "  # how the worker's `bad_frame` names the one frame of an image
STREAM_ENDS = ("decode_failed", "empty_stream")  # errors that end a stream's connection (as app/streams.py closes a socket)
ADDED = {
    media_stream.GONE: (404, "session_not_found", "the session was deleted"),
    media_stream.FAILED: (409, "session_error", "the session failed"),
    media_stream.NOT_CLAIMED: (409, "media_exists", "another client is streaming into this session"),
}  # media_stream.add's refusals


async def ingest(store: SessionStore, session: SessionRecord, media: Media, settings: GatewaySettings) -> int:
    """Send the media into the session (taking its bytes: `Media.take_chunks`); its byte count.
    ApiError as an upload or a socket is refused."""
    try:
        if media.kind == "video":
            return await store.upload(session, _chunks(media), limit_bytes("video", settings), settings.upload_stall_s)
        image = b"".join(media.take_chunks())
        return await _send_frame(store.redis, store.keys, session, image_connection(media.sha256), image)
    except UploadRefused as err:
        raise ApiError(err.status, err.code, str(err), param=media.param) from err


def image_connection(sha256: str) -> str:
    """The `frames` stream that sends an image (of this SHA-256) into a session."""
    return f"chat-{sha256[:16]}"


async def _chunks(media: Media) -> AsyncIterator[bytes]:
    for chunk in media.take_chunks():
        yield chunk


async def _send_frame(redis: Redis, keys: Keys, session: SessionRecord, connection: str, image: bytes) -> int:
    """One image as a `frames` stream of one frame at 0 s: connect, the frame, end, disconnect."""
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
    redis: Redis, keys: Keys, session_id: str, media: Media, timeout_s: float, left: Callable[[], Awaitable[None]]
) -> str | None:
    """Wait until the worker has taken the media (claimed in the session's hash) into the
    session's cache: None; or why it will not: the session failed (its `error`), or the image's
    stream had no frame decoded (the worker's reason). ApiError 404 when the session is deleted
    (but for that media: its kept refusal), 503 when the request sending the media gave up
    before it was sent, 504 after `timeout_s`; `left` is awaited at each look (it raises once the
    client has gone)."""
    connection = image_connection(media.sha256) if media.kind == "image" else None
    reason = None  # the worker's `bad_frame` reason for the image
    settled, error = await _look(redis, keys, session_id, media.sha256)
    if settled:
        return error
    try:  # the session's retained events, then new ones
        async for item in tail(redis, keys.events(session_id), "0-0", EventEnvelope, 64, 0, timeout_s):
            await left()
            match item[1] if item is not None else None:
                case MediaErrorEvent(code="session_error", message=message):
                    return message
                case MediaErrorEvent(code="bad_frame", message=message, connection=c) if c == connection:
                    reason = message.removeprefix(IMAGE_TIME)
                case MediaErrorEvent(code=code, message=message, connection=c) if c == connection and code in STREAM_ENDS:
                    return reason or message
                case None | StateEvent():  # a read that found nothing (tail.READ_BLOCK_MS), or a state: the hash says
                    settled, error = await _look(redis, keys, session_id, media.sha256)
                    if settled:
                        return error
    except TailTimeout:
        pass
    raise ApiError(504, "ingest_timeout", f"the media was not read within {timeout_s:g} s; ask again later with "
                   f"session_id {session_id}")


async def _look(redis: Redis, keys: Keys, session_id: str, sha256: str) -> tuple[bool, str | None]:
    """What the session's hash says of its media: (settled, why it will not come): (True, None)
    once it is in the cache, (True, why) when it failed or was refused, (False, None) while it
    may still come."""
    state, error, claimed = await redis.hmget(keys.session(session_id), "state", "error", MEDIA_FIELD)
    if state is None:
        refused = await redis.get(keys.chat_refused(session_id))
        if refused is None:
            raise ApiError(404, "session_not_found", f"the session {session_id} was deleted while its media was read")
        return True, refused.decode()
    if state.decode() == SessionState.INGESTED:
        return True, None
    if state.decode() == SessionState.ERROR:
        return True, (error or b"").decode() or "the media could not be read"
    if claimed is None or claimed.decode() != sha256:
        raise ApiError(503, "session_busy", "the request sending this media gave up before it was sent; try again",
                       {"Retry-After": "1"})
    return False, None


async def forget_refused(store: SessionStore, session: SessionRecord, reason: str) -> None:
    """Delete a session made for media the worker refused (it counts no more; the same media sent
    again goes to a new session), keeping `reason` REFUSAL_TTL_S for the requests that wait for it."""
    await store.redis.set(store.keys.chat_refused(session.id), reason, ex=REFUSAL_TTL_S)
    await store.delete(session)

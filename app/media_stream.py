"""Entries into a session's media stream, from every writer that holds its media claim (a stream
socket, an upload, a chat completion's image): one script (ADD_MEDIA_ENTRY_LUA) checks the
session, the writer's claim, the frame's order and the byte offset, adds the entry and counts its
bytes; the session's worker is woken when it had let the session go. Each transport only turns
its input into entries and the refusals into its own replies (an upload is aborted whole,
SessionStore.upload; a socket is closed, app/media_forwarder.py)."""

import time

from redis.asyncio import Redis

from streamvqa import protocol
from streamvqa.pending import enqueue
from streamvqa.protocol import Keys, MediaEntry, SessionRecord, scripts

GONE, FAILED, NOT_CLAIMED, BYTES_LOST = -1, -2, -3, -4  # what the script refuses, besides 0 (a frame not after the last)


async def add(
    redis: Redis, keys: Keys, session: SessionRecord, connection: str, entry: MediaEntry, stream_bytes: int = 0,
    frame_s: float | None = None, offset: int | None = None,
) -> str | int:
    """Add `entry` for the writer `connection` (which counts `stream_bytes` more media bytes;
    a frame at video time `frame_s`; data that follows the media's first `offset` bytes): the
    new entry's id, 1 for data already added (a retry), 0 for a frame not after the session's
    last, or a refusal: GONE, FAILED, NOT_CLAIMED (another writer holds the stream), BYTES_LOST
    (Redis lost bytes before `offset`)."""
    pairs = [item for pair in entry.fields().items() for item in pair]
    now = time.time()
    added, woke = await redis.register_script(scripts.ADD_MEDIA_ENTRY_LUA)(
        keys=[keys.session(session.id), keys.media(session.id), keys.streamer(session.id)],
        args=[
            protocol.MEDIA_MAXLEN, stream_bytes, connection, "" if frame_s is None else repr(frame_s), now,
            "" if offset is None else offset, *pairs,
        ],
    )
    if woke:
        await enqueue(redis, keys, session.id, session.model, now)
    return added.decode() if isinstance(added, bytes) else int(added)

"""Room in a session's media stream. Its writers (an upload, a stream socket) wait while the
worker's backlog is full (MEDIA_BACKLOG_ENTRIES entries), so that a slow worker slows the client
instead of filling Redis."""

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis

from streamvqa import protocol
from streamvqa.protocol import Keys, SessionState

FULL = protocol.MEDIA_BACKLOG_ENTRIES
UPLOAD_POLL_S = (0.02, 0.2)  # first and longest wait between looks at a full backlog


class SessionGone(Exception):
    """The session was deleted (or expired) while its writer waited."""


class SessionFailed(Exception):
    """The session failed while its writer waited; the message is its error."""


class WorkerStalled(Exception):
    """The backlog stayed full for as long as the writer may wait."""


async def entries(redis: Redis, keys: Keys, session_id: str) -> int:
    """Media entries waiting for the session's worker."""
    return await redis.xlen(keys.media(session_id))


async def wait_for_room(
    redis: Redis,
    keys: Keys,
    session_id: str,
    stall_s: float,
    below: int = FULL,
    poll_s: tuple[float, float] = UPLOAD_POLL_S,
    stopping: Callable[[], bool] = lambda: False,
) -> int:
    """The backlog, once it holds fewer than `below` entries (or once `stopping()`). Between
    looks it waits `poll_s[0]`, doubled each time up to `poll_s[1]`. SessionGone, SessionFailed,
    or WorkerStalled when there is still no room after `stall_s`."""
    deadline = time.monotonic() + stall_s
    pause_s = poll_s[0]
    while (backlog := await entries(redis, keys, session_id)) >= below and not stopping():
        state, error = await redis.hmget(keys.session(session_id), "state", "error")
        if state is None:
            raise SessionGone(session_id)
        if state == SessionState.ERROR.encode():
            raise SessionFailed((error or b"").decode())
        if time.monotonic() > deadline:
            raise WorkerStalled(session_id)
        await asyncio.sleep(pause_s)
        pause_s = min(pause_s * 2, poll_s[1])
    return backlog

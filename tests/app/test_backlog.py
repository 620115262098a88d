"""Waiting for room in a session's media stream (app/backlog.py): at once when it has room,
once it drains, and not at all when the session is gone, has failed, or its worker stalls."""

import asyncio
import uuid

import pytest

from app import backlog
from streamvqa.protocol import Keys
from streamvqa.redis_client import close, connect

FULL = backlog.FULL


async def _session(redis, keys: Keys, state: str | None, entries: int) -> str:
    session_id = uuid.uuid4().hex
    if state is not None:
        await redis.hset(keys.session(session_id), mapping={"state": state, "error": "bad video"})
    async with redis.pipeline(transaction=False) as pipe:
        for _ in range(entries):
            pipe.xadd(keys.media(session_id), {"k": "data"})
        await pipe.execute()
    return session_id


def _run(redis_url: str, state: str | None, entries: int, drain: int = 0, stall_s: float = 5.0) -> int:
    """The backlog wait_for_room returns for a session in `state` with `entries` waiting, while
    `drain` of them are taken away after 0.2 s."""

    async def scenario() -> int:
        redis, keys = connect(redis_url), Keys(f"test-backlog-{uuid.uuid4().hex[:8]}:")
        session_id = await _session(redis, keys, state, entries)

        async def take() -> None:
            await asyncio.sleep(0.2)
            taken = await redis.xrange(keys.media(session_id), count=drain)
            await redis.xdel(keys.media(session_id), *[entry_id for entry_id, _ in taken])

        try:
            draining = asyncio.create_task(take()) if drain else None
            waited = await backlog.wait_for_room(redis, keys, session_id, stall_s)
            if draining:
                await draining
            return waited
        finally:
            await redis.delete(keys.session(session_id), keys.media(session_id))
            await close(redis)

    return asyncio.run(scenario())


def test_a_backlog_with_room_returns_at_once(redis_url):
    assert _run(redis_url, "ingesting", 3) == 3


def test_a_full_backlog_returns_once_the_worker_takes_an_entry(redis_url):
    assert _run(redis_url, "ingesting", FULL, drain=1) == FULL - 1


@pytest.mark.parametrize(
    ("state", "error"),
    [(None, backlog.SessionGone), ("error", backlog.SessionFailed), ("ingesting", backlog.WorkerStalled)],
)
def test_a_full_backlog_ends_the_wait_when_the_session_is_gone_or_failed_or_stalled(redis_url, state, error):
    with pytest.raises(error) as raised:
        _run(redis_url, state, FULL, stall_s=0.3)
    if error is backlog.SessionFailed:
        assert str(raised.value) == "bad video"

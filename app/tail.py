"""Following a Redis stream as it grows: a question's answer stream, a session's event stream.

Each entry holds one JSON envelope in its field `m` (streamvqa/protocol/events.py); `tail` yields
the event inside, with the entry's id, so that a client can resume after it.
"""

import asyncio
import time
from collections.abc import AsyncIterator

from pydantic import BaseModel
from redis.asyncio import Redis

from streamvqa.redis_client import xread

READ_BLOCK_MS = 1000  # the longest one read waits for a new entry


async def last_id(redis: Redis, stream: str) -> str:
    """The id of the stream's latest entry ("0-0" when it has none): a tail from it sees only new entries."""
    last = await redis.xrevrange(stream, count=1)
    return last[0][0].decode() if last else "0-0"


class TailTimeout(Exception):
    """The stream was followed for its `timeout_s`."""


async def tail(
    redis: Redis,
    stream: str,
    since: str,
    envelope: type[BaseModel],
    count: int,
    quiet_s: float,
    timeout_s: float | None = None,
) -> AsyncIterator[tuple[str, BaseModel] | None]:
    """(entry id, event) for each entry of `stream` after the entry id `since`, in order, as they
    come; `envelope` is the model of an entry's `m` (its field `event` is yielded). None after
    each `quiet_s` without an entry (0: after each read that found none, at most READ_BLOCK_MS
    apart), for the caller to keep its client's connection alive or to look whether to go on.
    At most `count` entries are read at once. TailTimeout once `timeout_s` has passed."""
    now = time.monotonic()
    deadline, quiet_since = now + timeout_s if timeout_s is not None else None, now
    while True:
        block_ms = READ_BLOCK_MS
        if deadline is not None:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TailTimeout(stream)
            block_ms = min(block_ms, remaining_ms)
        reply = await xread(redis, {stream: since}, count, block_ms)
        if not reply:
            if time.monotonic() - quiet_since >= quiet_s:
                quiet_since = time.monotonic()
                yield None
            continue
        quiet_since = time.monotonic()
        for _, entries in reply:
            for entry_id, fields in entries:
                since = entry_id.decode()
                yield since, envelope.model_validate_json(fields[b"m"]).event
        await asyncio.sleep(0)  # lets the other tasks run between full reads

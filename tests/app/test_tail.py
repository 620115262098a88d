"""Following a Redis stream (app/tail.py): entries in order with their ids, None while it is
quiet, and an end after its timeout."""

import asyncio
import time
import uuid

from app.tail import TailTimeout, tail
from streamvqa.protocol import AnswerEnvelope, TokenEvent
from streamvqa.redis_client import close, connect


def _entry(text: str) -> dict[str, str]:
    return {"m": AnswerEnvelope(event=TokenEvent(text=text)).model_dump_json()}


def test_a_tail_yields_the_entries_after_since_then_none_while_quiet_then_times_out(redis_url):
    async def scenario() -> tuple[list, list, float]:
        redis = connect(redis_url)
        stream = f"test-tail:{uuid.uuid4().hex}"
        try:
            ids = [(await redis.xadd(stream, _entry(text))).decode() for text in "abc"]
            seen, started = [], time.monotonic()
            try:
                async for item in tail(redis, stream, ids[0], AnswerEnvelope, 1, 0, timeout_s=1.5):
                    seen.append(None if item is None else (item[0], item[1].text))
            except TailTimeout:
                pass
            return seen, ids, time.monotonic() - started
        finally:
            await redis.delete(stream)
            await close(redis)

    seen, ids, elapsed_s = asyncio.run(scenario())
    assert seen[:2] == [(ids[1], "b"), (ids[2], "c")]  # after `since`, in order, one read at a time
    assert seen[2:] and set(seen[2:]) == {None}  # then one None per read that found nothing
    assert 1.4 < elapsed_s < 3


def test_a_tail_says_nothing_until_quiet_s_has_passed(redis_url):
    async def scenario() -> list:
        redis = connect(redis_url)
        stream = f"test-tail:{uuid.uuid4().hex}"
        try:
            items = []
            try:
                async for item in tail(redis, stream, "0-0", AnswerEnvelope, 16, quiet_s=60, timeout_s=1.2):
                    items.append(item)
            except TailTimeout:
                pass
            return items
        finally:
            await close(redis)

    assert asyncio.run(scenario()) == []

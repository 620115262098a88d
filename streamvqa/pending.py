"""The queue of sessions waiting for a worker of their model, and the model's admitted sessions.

Both are global keys (`pending:{model}`, `admitted:{model}`), each in a slot of its own on a
Redis Cluster, so no script touches them beside a session's keys. A session's own script decides
that it must wait for a worker and records when in its hash (`queued`); `enqueue` then adds it
to both. A process that dies between the two leaves `queued` set with no entry in the queue: the
session's next question or media after `REQUEUE_AFTER_S` queues it again (as it does for an
entry Redis lost).
"""

from redis.asyncio import Redis, RedisCluster

from streamvqa import protocol
from streamvqa.protocol import REQUEUE_AFTER_S, Keys


async def enqueue(redis: Redis | RedisCluster, keys: Keys, session_id: str, model: str, now: float) -> None:
    """Count the session among its model's admitted sessions and queue it for a worker."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zadd(keys.admitted(model), {session_id: now})
        pipe.xadd(keys.pending(model), {"session_id": session_id}, maxlen=protocol.PENDING_MAXLEN, approximate=True)
        await pipe.execute()


async def leave(redis: Redis | RedisCluster, keys: Keys, session_id: str, model: str) -> None:
    """The session no longer holds nor waits for a place (parked, failed, deleted). Missed (the
    process died first), the next create's count finds it out from the session's hash."""
    await redis.zrem(keys.admitted(model), session_id)

"""The queue of sessions waiting for a worker of their model, and the model's places.

Both are global keys (`pending:{model}`, `places:{model}`), each in a slot of its own on a
Redis Cluster, so no script touches them beside a session's keys. A session's own script decides
that it must wait for a worker and records when in its hash (`queued`); `enqueue` then adds it
to both, with the memory it reserved when it was created (its hash's `reserved`). A process
that dies between the two leaves `queued` set with no entry in the queue: the session's next
question or media after `REQUEUE_AFTER_S` queues it again (as it does for an entry Redis lost).
"""

from redis.asyncio import Redis, RedisCluster

from streamvqa import protocol
from streamvqa.protocol import REQUEUE_AFTER_S, Keys


def place(now: float, reserved: bytes | str) -> str:
    """A session's entry in `places:{model}`: when it was admitted, then the device and host bytes
    it reserves (`reserved`, as its hash holds them: "<device bytes> <host bytes>")."""
    return f"{now!r} {reserved.decode() if isinstance(reserved, bytes) else reserved}"


async def enqueue(redis: Redis | RedisCluster, keys: Keys, session_id: str, model: str, now: float) -> None:
    """Count the session among its model's admitted sessions, with the memory it reserves, and
    queue it for a worker. A session brought back is admitted whatever is left (as it is
    counted in its places): a worker takes it once it has room."""
    reserved = await redis.hget(keys.session(session_id), "reserved") or "0 0"
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.places(model), session_id, place(now, reserved))
        pipe.xadd(keys.pending(model), {"session_id": session_id}, maxlen=protocol.PENDING_MAXLEN, approximate=True)
        await pipe.execute()


async def leave(redis: Redis | RedisCluster, keys: Keys, session_id: str, model: str) -> None:
    """The session no longer holds nor waits for a place (parked, failed, deleted). Missed (the
    process died first), the next create's count finds it out from the session's hash."""
    await redis.hdel(keys.places(model), session_id)

"""Redis clients that ride out a restarted or briefly unreachable Redis: one server, or a Redis
Cluster (`REDIS_CLUSTER=true`, `REDIS_URL` naming any of its nodes)."""

import asyncio
from collections import defaultdict

import redis
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError, ConnectionError, RedisClusterException, RedisError, TimeoutError, TryAgainError,
)

POOL_WAIT_S = 5  # a caller waits this long for a free connection from a full pool
CLUSTER_READ_BLOCK_MS = 50  # the longest a read over several slots waits (see `xreadgroup`)

# What a client meets while Redis (or, on a cluster, a master until its replica takes over) is
# away: the gateway answers 503 `redis_unreachable`, the worker retries.
UNAVAILABLE = (ConnectionError, TimeoutError, ClusterDownError, TryAgainError, RedisClusterException)
# Every failure of a command (a cluster client also raises RedisClusterException, outside RedisError)
FAILURES = (RedisError, RedisClusterException)

# A command that meets a dropped connection (a restarted Redis, a network blip) is retried on a
# fresh one: 3 more tries, 50 ms to 1 s apart. Longer outages surface as errors that each
# process handles (the worker's loop retries with its own backoff; the gateway answers 503).
_RETRY = {
    "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
    "retry_on_error": [ConnectionError, TimeoutError],
    "health_check_interval": 30,
    "socket_keepalive": True,
}


def connect(
    url: str, max_connections: int | None = None, retry: bool = True, cluster: bool = False
) -> Redis | RedisCluster:
    """A client for `url`; with `max_connections`, callers wait for a free connection rather
    than opening more (on a cluster: at most that many per node, and a caller that finds none
    free fails at once). Without `retry`, a command whose connection fails or times out raises
    at once: for XREADGROUP, whose entries a lost reply would leave delivered but never seen, the
    caller reads its pending entries again instead. With `cluster`, a Redis Cluster client that
    follows the cluster's slots and failovers, and retries as above."""
    tries = 3 if retry else 0
    if cluster:
        return RedisCluster.from_url(
            url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), tries), max_connections=max_connections or 2**31,
            health_check_interval=30, socket_keepalive=True,
        )
    options = _RETRY if retry else {**_RETRY, "retry": Retry(ExponentialBackoff(), 0), "retry_on_error": []}
    if max_connections is None:
        return Redis.from_url(url, **options)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S, **options)
    return Redis(connection_pool=pool)


def connect_sync(url: str, cluster: bool = False) -> redis.Redis | SyncRedisCluster:
    """A blocking client (for the launcher, tests and benchmarks)."""
    return SyncRedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)


async def close(client: Redis | RedisCluster) -> None:
    await client.aclose()
    if isinstance(client, Redis):
        await client.connection_pool.aclose()


async def xread(client: Redis | RedisCluster, streams: dict[str, str], count: int, block_ms: int | None) -> list:
    """XREAD of streams in one slot (one session's)."""
    return await _read(client, ("XREAD",), streams, count, block_ms)


async def xreadgroup(
    client: Redis | RedisCluster, group: str, consumer: str, streams: dict[str, str], count: int, block_ms: int | None
) -> list:
    """XREADGROUP over `streams`. A cluster refuses one command over keys in several slots: there
    each slot's streams are read by a command of their own, all at once, each waiting at most
    CLUSTER_READ_BLOCK_MS (a new entry may wait that long to be read; an idle worker reads each
    of its sessions that often)."""
    command = ("XREADGROUP", "GROUP", group, consumer)
    if not isinstance(client, RedisCluster):
        return await _read(client, command, streams, count, block_ms)
    by_slot: dict[int, dict[str, str]] = defaultdict(dict)
    for stream, since in streams.items():
        by_slot[key_slot(stream.encode())][stream] = since
    if len(by_slot) == 1:
        return await _read(client, command, streams, count, block_ms)
    block = None if block_ms is None else min(block_ms, CLUSTER_READ_BLOCK_MS)
    replies = await asyncio.gather(*(_read(client, command, part, count, block) for part in by_slot.values()))
    return [row for reply in replies for row in reply]


async def _read(
    client: Redis | RedisCluster, command: tuple[str, ...], streams: dict[str, str], count: int, block_ms: int | None
) -> list:
    """XREAD or XREADGROUP of streams in one slot. On a cluster the command goes to the master of
    their slot, found from the client's own map of slots: redis-py would otherwise ask the node it
    started from which arguments are keys (COMMAND GETKEYS), and while that node is down every
    read would fail, even after its replica took over."""
    args = [*command, "COUNT", count, *(("BLOCK", block_ms) if block_ms is not None else ()), "STREAMS"]
    args += [*streams, *streams.values()]
    if not isinstance(client, RedisCluster):
        return await client.execute_command(*args) or []
    await client.initialize()
    node = client.get_node_from_key(next(iter(streams)))
    return await client.execute_command(*args, target_nodes=node) or []

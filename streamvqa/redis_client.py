"""Redis clients that ride out a restarted or briefly unreachable Redis."""

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

POOL_WAIT_S = 5  # a caller waits this long for a free connection from a full pool

# A command that meets a dropped connection (a restarted Redis, a network blip) is retried on a
# fresh one: 3 more tries, 50 ms to 1 s apart. Longer outages surface as errors that each
# process handles (the worker's loop retries with its own backoff; the gateway answers 503).
_RETRY = {
    "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
    "retry_on_error": [ConnectionError, TimeoutError],
    "health_check_interval": 30,
    "socket_keepalive": True,
}


def connect(url: str, max_connections: int | None = None, retry: bool = True) -> Redis:
    """A client for `url`; with `max_connections`, callers wait for a free connection rather
    than opening more. Without `retry`, a command whose connection fails or times out raises at
    once: for XREADGROUP, whose entries a lost reply would leave delivered but never seen, the
    caller reads its pending entries again instead."""
    options = _RETRY if retry else {**_RETRY, "retry": Retry(ExponentialBackoff(), 0), "retry_on_error": []}
    if max_connections is None:
        return Redis.from_url(url, **options)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S, **options)
    return Redis(connection_pool=pool)

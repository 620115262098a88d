"""Shared fixtures: a real Redis (REDIS_URL, else an embedded server), per-test key prefixes,
and real gateway and worker processes on loopback."""

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
import redis

from streamvqa.redis_server import EmbeddedRedis
from tests.support import Client, Stack


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def _delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"svqa-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    _delete_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One gateway and one worker, for the tests of a module (each test makes its own sessions)."""
    prefix = f"svqa-test-{uuid.uuid4().hex[:12]}:"
    stack = Stack(redis_url, prefix, tmp_path_factory.mktemp("stack"), MAX_UPLOAD_BYTES=str(4 * 1024 * 1024))
    stack.start("worker", "worker")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        yield stack
    finally:
        stack.stop()
        sys.stdout.write(f"\n--- worker log ---\n{stack.log('worker')}\n--- gateway log ---\n{stack.log('gateway')}\n")
        _delete_prefix(redis_url, prefix)


@pytest.fixture
def client(stack: Stack) -> Iterator[Client]:
    user = Client(stack.url)
    yield user
    user.http.close()

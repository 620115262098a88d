"""Shared fixtures: a real Redis (REDIS_URL, else an embedded server), a real local Redis
Cluster, and real gateway and worker processes on loopback, under a key prefix of their own."""

import os
from collections.abc import Iterator

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach a model hub, and fail fast if they try

import pytest

from streamvqa.redis_server import EmbeddedRedis, LocalCluster
from tests.support import Client, Stack, running_stack


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A Redis Cluster of 3 masters and 3 replicas on loopback, shared by the cluster tests
    (each under a key prefix of its own); a test that kills a node starts a cluster of its own."""
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One gateway and one worker, for the tests of a module (each test makes its own sessions)."""
    with running_stack(
        redis_url, tmp_path_factory.mktemp("stack"), MAX_UPLOAD_BYTES=str(4 * 1024 * 1024), MAX_SESSIONS="64"
    ) as stack:
        yield stack


@pytest.fixture
def client(stack: Stack) -> Iterator[Client]:
    user = Client(stack.url)
    yield user
    user.delete()
    user.http.close()

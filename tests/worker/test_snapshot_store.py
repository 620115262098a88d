"""A session's snapshot is stored by the worker that holds it, and by no other: a worker that
lost the session while it wrote a snapshot leaves the new holder's snapshot and files alone."""

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
from redis.asyncio import Redis

from streamvqa.protocol import Keys
from streamvqa.redis_client import connect
from tests.support import delete_prefix
from worker.snapshots import HostPages, SnapshotStore

BIG = 2048  # bytes of an engine snapshot: past the store's Redis limit below, so written to a file


@pytest.fixture
def keys(redis_url: str) -> Iterator[Keys]:
    """Keys under a prefix of the test's own, deleted after it."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    yield Keys(prefix)
    delete_prefix(redis_url, prefix)


def with_redis(redis_url: str, body: Callable[[Redis], Awaitable[None]]) -> None:
    """Run `body` with a client of the test's Redis, closed after it."""
    async def run() -> None:
        redis = connect(redis_url)
        try:
            await body(redis)
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_a_worker_that_lost_a_session_stores_no_snapshot_and_deletes_none_of_the_holders_files(redis_url, keys, tmp_path):
    session = uuid.uuid4().hex

    async def run(redis: Redis) -> None:
        old, new = (SnapshotStore(redis, keys, tmp_path, 1024, 60, worker) for worker in ("worker-a", "worker-b"))
        await redis.hset(keys.session(session), mapping={"state": "ready", "worker": "worker-a"})
        await redis.set(keys.lease(session), "worker-a")
        written, files = await old.save(session, b"a" * BIG, None, HostPages({0: b"page 0", 1: b"page 1"}, [0, 1], {}))
        assert written == BIG + 12 and sorted(files) == [0, 1]
        # the lease lapses and worker-b takes the session, restores it and snapshots it
        await redis.set(keys.lease(session), "worker-b")
        await redis.hset(keys.session(session), "worker", "worker-b")
        written, held = await new.save(session, b"b" * BIG, None, HostPages({1: b"page 1, b"}, [0, 1], files))
        assert written == BIG + 9 and held[0] == files[0] and held[1] != files[1]
        # worker-a, not knowing, snapshots what it still has: refused, and what it wrote is gone
        written, _ = await old.save(session, b"c" * BIG, None, HostPages({0: b"page 0, c"}, [0, 1], files))
        assert written == 0
        snapshot = await new.load(session)
        assert snapshot.engine == b"b" * BIG and snapshot.pages == held
        assert [new.read_page(session, held, number) for number in (0, 1)] == [b"page 0", b"page 1, b"]
        stored = (await redis.hget(keys.snapshot(session), "path")).decode()
        assert sorted(path.name for path in tmp_path.iterdir()) == sorted([f"{session}.pages", stored.rsplit("/", 1)[1]])
        assert sorted(path.name for path in (tmp_path / f"{session}.pages").iterdir()) == sorted(held.values())
        # with no lease at all (a Redis that restarted), the worker the session names still stores
        await redis.delete(keys.lease(session))
        assert (await new.save(session, b"d" * 10, None))[0] == 10
        assert (await old.save(session, b"e" * 10, None))[0] == 0
        assert (await new.load(session)).engine == b"d" * 10
        assert [path.name for path in tmp_path.iterdir()] == [f"{session}.pages"]  # in Redis now: no file left

    with_redis(redis_url, run)


def test_each_stored_snapshot_deletes_the_file_of_the_one_it_replaced_and_no_other_sessions(redis_url, keys, tmp_path):
    session, other = uuid.uuid4().hex, uuid.uuid4().hex

    async def run(redis: Redis) -> None:
        store = SnapshotStore(redis, keys, tmp_path, 1024, 60, "worker-a")
        for held in (session, other):
            await redis.hset(keys.session(held), mapping={"state": "ready", "worker": "worker-a"})
            await redis.set(keys.lease(held), "worker-a")
        assert (await store.save(other, b"o" * BIG, None))[0] == BIG
        others = sorted(path.name for path in tmp_path.iterdir())
        assert len(others) == 1 and others[0].startswith(f"{other}.")
        # to a file, a file, into Redis (the file before it goes), and a file again
        for engine in (b"a" * BIG, b"b" * (BIG + 1), b"c" * 10, b"d" * (BIG + 2)):
            assert (await store.save(session, engine, None))[0] == len(engine)
        stored = (await redis.hget(keys.snapshot(session), "path")).decode()
        mine = sorted(path.name for path in tmp_path.glob(f"{session}.*"))
        assert mine == [stored.rsplit("/", 1)[1]]
        assert (tmp_path / mine[0]).read_bytes() == b"d" * (BIG + 2)
        assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*others, *mine])
        assert (tmp_path / others[0]).read_bytes() == b"o" * BIG
        # the session ends: its file goes, the other's stays
        store.delete_file(session)
        assert [path.name for path in tmp_path.iterdir()] == others

    with_redis(redis_url, run)

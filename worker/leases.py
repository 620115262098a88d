"""A worker's hold on its sessions and its place among the workers.

- **Leases**: one key per session (`lease`) with a TTL, held by one worker, renewed by its
  heartbeat; a session whose lease lapsed (its worker died or stopped) is queued again for
  another worker, once (the scripts decide who).
- **Registry**: each worker's `WorkerInfo` in one hash, written at each heartbeat; an entry
  that expired is a dead worker, forgotten after DEAD_WORKER_FORGET_S.
"""

import logging
import time
from collections.abc import Mapping

from redis.asyncio import Redis

from engine import KVPool, PageRuns, Run
from streamvqa.pending import enqueue, leave
from streamvqa.protocol import Keys, WorkerInfo, scripts
from worker.capacity import Capacity, Counters
from worker.hosted import Hosted
from worker.pins import PinCosts

log = logging.getLogger(__name__)

DEAD_WORKER_FORGET_S = 3600  # workers silent this long leave the registry


def pool_fields(pool: KVPool | None, sessions: Mapping[str, Hosted]) -> dict:
    """The registry's fields of the worker's KV pool and its host pool: their pages, and those
    each session leases."""
    if pool is None:
        return {}
    caches = {session_id: hosted.engine.cache for session_id, hosted in sessions.items()}
    fields = _pages("pool", pool, {session_id: cache.lease for session_id, cache in caches.items()})
    if pool.host is not None:
        tiers = {session_id: cache.host and cache.host.run for session_id, cache in caches.items()}
        fields |= _pages("host_pool", pool.host, tiers)
    return fields


def _pages(name: str, pool: PageRuns, runs: Mapping[str, Run | None]) -> dict:
    """`name`_pages, _free_pages, _page_tokens, _bytes and _session_pages (by session, of those with a run)."""
    return {
        f"{name}_pages": pool.total_pages,
        f"{name}_free_pages": pool.free_pages,
        f"{name}_page_tokens": pool.page_tokens,
        f"{name}_bytes": pool.nbytes,
        f"{name}_session_pages": {session_id: run.pages for session_id, run in runs.items() if run is not None},
    }


class Leases:
    def __init__(
        self, redis: Redis, keys: Keys, worker_id: str, model: str, lease_ttl_s: float, max_sessions: int,
        capacity: Capacity, counters: Counters, pins: PinCosts,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.model = model
        self.lease_ttl_s = lease_ttl_s
        self.lease_ms = int(lease_ttl_s * 1000)
        self.margin_s = lease_ttl_s * 0.8  # act on a lease only this long after renewing it
        self.max_sessions = max_sessions
        self.capacity = capacity
        self.counters = counters
        self.pins = pins
        self._take = redis.register_script(scripts.TAKE_LEASE_LUA)
        self._renew = redis.register_script(scripts.RENEW_LEASE_LUA)
        self._release = redis.register_script(scripts.RELEASE_LUA)
        self._requeue = redis.register_script(scripts.REQUEUE_LUA)
        self._park = redis.register_script(scripts.PARK_LUA)

    # -- a session's lease ----------------------------------------------------------------------

    async def take(self, session_id: str) -> bool:
        """Take the lease and be named in the session's hash; False when another worker holds it
        or the session is gone."""
        keys = [self.keys.lease(session_id), self.keys.session(session_id)]
        return await self._take(keys=keys, args=[self.worker_id, self.lease_ms]) == 1

    async def renew(self, session_id: str, hosted: Hosted) -> bool:
        """Renew the lease; `hosted` learns until when it surely holds, or that it is lost."""
        renewed_at = time.monotonic()
        keys = [self.keys.lease(session_id), self.keys.session(session_id)]
        held = bool(await self._renew(keys=keys, args=[self.worker_id, self.lease_ms]))
        if held:
            hosted.lease_until = renewed_at + self.margin_s
        else:
            hosted.lost = True
        return held

    async def release(self, session_id: str) -> None:
        await self._release(keys=[self.keys.lease(session_id)], args=[self.worker_id])

    async def requeue(self, session_id: str, worker_id: str | None = None, model: str | None = None) -> bool:
        """Queue a session of `worker_id` (a dead one; by default this one) again for a worker of
        `model` (by default this one's)."""
        now = time.time()
        keys = [self.keys.session(session_id), self.keys.lease(session_id)]
        if not await self._requeue(keys=keys, args=[worker_id or self.worker_id, now]):
            return False
        await enqueue(self.redis, self.keys, session_id, model or self.model, now)
        return True

    async def park(self, session_id: str, failed: bool) -> bool:
        """Let an idle (or failed) session go, out of the model's admitted sessions; False while
        work arrives for it."""
        keys = [
            self.keys.session(session_id), self.keys.lease(session_id), self.keys.questions(session_id),
            self.keys.media(session_id), self.keys.streamer(session_id),
        ]
        if not await self._park(keys=keys, args=[self.worker_id, "1" if failed else "0"]):
            return False
        await leave(self.redis, self.keys, session_id, self.model)
        return True

    # -- the registry ---------------------------------------------------------------------------

    async def advertise(self, sessions: Mapping[str, Hosted], claiming: set[str]) -> None:
        """Write this worker's entry: its room, its sessions (and those it is opening) and counters."""
        held = [hosted.record for hosted in sessions.values()]
        capacity, counters = self.capacity, self.counters
        capacity.refresh(held)
        info = WorkerInfo(
            id=self.worker_id,
            model=self.model,
            sessions=len(sessions),
            max_sessions=self.max_sessions,
            expires_at=time.time() + self.lease_ttl_s,
            session_ids=[*sessions, *claiming],
            kv_bytes_per_token=capacity.kv_bytes_per_token,
            kv_free_bytes=capacity.kv_free_bytes(held),
            context_tokens=capacity.context_tokens,
            dtype=capacity.dtype,
            host_bytes_per_token=capacity.host_bytes_per_token,
            index_bytes_per_host_token=capacity.index_bytes_per_host_token,
            opening_tokens=self.pins.opening_tokens,
            turn_marker_tokens=self.pins.turn_marker_tokens,
            host_free_bytes=capacity.host_free_bytes(held),
            kv_memory=capacity.kv.setting.text,
            kv_memory_bytes=capacity.kv_memory_bytes,
            device_free_bytes=capacity.kv.free_bytes,
            host_memory=capacity.host.setting.text,
            host_memory_bytes=capacity.host_memory_bytes,
            ram_free_bytes=capacity.host.free_bytes,
            default_sessions=capacity.default_sessions,
            memory_warning=capacity.warning,
            **pool_fields(capacity.pool, sessions),
            host_bytes=sum(h.host_bytes for h in sessions.values()),
            ingest_lag_s=round(max((h.lag_s for h in sessions.values()), default=0.0), 3),
            **{**vars(counters), "retrieval_ms": round(counters.retrieval_ms, 3)},  # every counter, by its name
        )
        await self.redis.hset(self.keys.workers(), self.worker_id, info.model_dump_json())

    async def withdraw(self) -> None:
        await self.redis.hdel(self.keys.workers(), self.worker_id)

    async def forget_dead_workers(self) -> None:
        """Put the sessions of workers whose advertisement lapsed back in the pending queue (a
        Lua script makes sure only one worker does, and only once their leases lapsed); forget
        workers silent for DEAD_WORKER_FORGET_S."""
        now = time.time()
        for worker_id, raw in (await self.redis.hgetall(self.keys.workers())).items():
            info = WorkerInfo.model_validate_json(raw)
            if info.alive or info.id == self.worker_id:
                continue
            for session_id in info.session_ids:
                if await self.requeue(session_id, info.id, info.model):
                    log.info("session %s of the dead worker %s is free again", session_id, info.id)
            if info.expires_at < now - DEAD_WORKER_FORGET_S:
                await self.redis.hdel(self.keys.workers(), worker_id)

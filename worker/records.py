"""What a worker writes about the sessions it holds: their records (fields and state changes),
their events, their memory reports, and the acknowledgement of the entries it is done with.

Every write leaves a session that is gone (deleted, expired) gone: the scripts check its hash.
"""

import time

from redis.asyncio import Redis

from engine import Session
from streamvqa import protocol
from streamvqa.protocol import (
    IngestEvent, Keys, MediaErrorEvent, MemoryReport, SessionState, StateEvent, WarningEvent, check_transition, scripts,
)
from worker.hosted import Hosted
from worker.threads import Threads

MEMORY_INTERVAL_S = 1.0  # the shortest time between two memory reports of a session while it ingests


class RecordWriter:
    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: int, threads: Threads) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = session_ttl_s
        self.threads = threads
        self._update = redis.register_script(scripts.UPDATE_RECORD_LUA)
        self._set_if_live = redis.register_script(scripts.SET_IF_LIVE_LUA)
        self._upload_ack = redis.register_script(scripts.UPLOAD_ACK_LUA)
        self._abandon_upload = redis.register_script(scripts.ABANDON_UPLOAD_LUA)

    async def set(
        self, session_id: str, state: SessionState | None = None, from_state: SessionState | None = None, **fields: object
    ) -> bool:
        """Write fields, then the state (only from `from_state` when given, a change that
        protocol.TRANSITIONS allows), and restart the session's idle clock, atomically. False
        when the session is gone."""
        if state is not None and from_state is not None:
            check_transition(from_state, state)
        args = [self.ttl_s, state or "", from_state or "", *_pairs(fields)]
        return bool(await self._update(keys=list(self.keys.session_data(session_id)), args=args))

    async def event(self, session_id: str, event: IngestEvent | StateEvent | WarningEvent | MediaErrorEvent) -> None:
        document = protocol.EventEnvelope(event=event).model_dump_json()
        stream = self.keys.events(session_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, {"m": document}, maxlen=protocol.EVENTS_MAXLEN, approximate=True)
            pipe.expire(stream, self.ttl_s)
            await pipe.execute()

    async def warn(self, session_id: str, hosted: Hosted, code: str, message: str, **fields: object) -> None:
        """A warning the session keeps (its record's `warnings`, with `fields`) and sends as an
        event; said once."""
        if hosted.record.warn(code, message):
            await self.set(session_id, warnings=[warning.model_dump() for warning in hosted.record.warnings], **fields)
            await self.event(session_id, WarningEvent(code=code, message=message))

    async def context_full(self, session_id: str, hosted: Hosted, why: str) -> None:
        """The cache reached the model's context (`why`): later frames are not taken (said once)."""
        hosted.record.context_full = True
        message = f"{why}: later frames are not taken; ask about what it holds, or use a policy that evicts"
        await self.warn(session_id, hosted, "context_full", message, context_full=True)

    async def consume(self, stream: str, *entry_ids: bytes) -> None:
        """Acknowledge entries and delete them: done with."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, protocol.GROUP, *entry_ids)
            pipe.xdel(stream, *entry_ids)
            await pipe.execute()

    async def consume_upload(self, session_id: str, entry_id: bytes, fields: dict[str, object]) -> None:
        """Record an upload's progress and acknowledge its entry in one step, so that a worker
        taking over finds the spool file and the count in agreement."""
        keys = [self.keys.session(session_id), self.keys.media(session_id)]
        await self._upload_ack(keys=keys, args=[entry_id, *_pairs(fields)])

    async def abandon_upload(self, session_id: str) -> bool:
        """Free the media slot of an upload whose connection is gone; False while the connection
        still holds its claim or entries wait."""
        keys = [self.keys.session(session_id), self.keys.streamer(session_id), self.keys.media(session_id)]
        return bool(await self._abandon_upload(keys=keys))

    async def report_memory(self, session_id: str, hosted: Hosted, force: bool = False) -> None:
        """Write what the session's cache holds (GET /sessions/{id}/memory), at most every
        MEMORY_INTERVAL_S unless `force`."""
        if not force and time.monotonic() - hosted.memory_at < MEMORY_INTERVAL_S:
            hosted.memory_stale = True  # reported at a later turn
            return
        hosted.memory_at, hosted.memory_stale = time.monotonic(), False
        memory, stats = await self.threads.engine(lambda: (hosted.engine.memory(), hosted.engine.stats()))
        report = MemoryReport.of(memory, stats, hosted.record.recall)
        keys = [self.keys.session(session_id), self.keys.memory(session_id)]
        await self._set_if_live(keys=keys, args=[report.model_dump_json(), self.ttl_s])


def progress(engine: Session) -> dict[str, object]:
    """The record's fields that follow the cache."""
    stats = engine.stats()
    return {
        "frames_ingested": stats.frames,
        "video_time_s": round(stats.video_time_s, 3),
        "cache_tokens": stats.cache_tokens,
        "tokens_seen": stats.tokens_seen,
    }


def _pairs(fields: dict[str, object]) -> list[str]:
    return [item for pair in protocol.to_hash(**fields).items() for item in pair]

"""The worker's loop: take sessions by lease, answer their questions first, then ingest their media.

One event loop does all Redis I/O. The engine runs on one thread of its own (one model, one
device); decoding runs on another. Each turn reads every stream the worker owns in one
XREADGROUP, answers the questions it got, stores the media, then decodes a few frames of each
session that has an upload ready, so questions never wait behind a whole video.
"""

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from engine import Session, SessionConfig, VisionLanguageModel
from streamvqa import protocol
from streamvqa.protocol import (
    AnswerEnvelope,
    DoneEvent,
    ErrorEvent,
    Keys,
    Question,
    SessionRecord,
    SessionState,
    TokenEvent,
    WorkerInfo,
)
from worker.decode import DecodeError
from worker.ingest import UploadIngest
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_COUNT = 8  # entries per stream per turn
IDLE_BLOCK_MS = 500  # how long an idle turn waits for new entries
DEAD_WORKER_FORGET_S = 3600  # workers silent this long leave the registry

# Renews a lease only while this worker holds it (ARGV[1]); returns 1 when renewed.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Deletes a lease only while this worker holds it.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class Hosted:
    """A session this worker holds."""

    record: SessionRecord
    engine: Session
    ingest: UploadIngest | None = None
    media_closed: bool = False  # the upload ended, failed or was aborted: no more media is read
    error: str | None = None
    lost: bool = False  # the lease or the session is gone; dropped at the next turn

    @property
    def decoding(self) -> bool:
        return self.ingest is not None and self.ingest.decoding


class Worker:
    def __init__(self, settings: WorkerSettings, model: VisionLanguageModel, redis: Redis) -> None:
        self.settings = settings
        self.model = model
        self.redis = redis
        self.id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.keys = Keys(settings.redis_prefix)
        self.sessions: dict[str, Hosted] = {}  # at most settings.max_sessions
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._decode_thread = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self._stopping = asyncio.Event()
        self._transition = redis.register_script(protocol.TRANSITION_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._lease_ms = int(settings.lease_ttl_s * 1000)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        self.settings.spool_dir.mkdir(parents=True, exist_ok=True)
        await self._ensure_group(self.keys.pending(self.model.name))
        await self._advertise()
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("worker %s serves %s (at most %d sessions)", self.id, self.model.name, self.settings.max_sessions)
        backoff_s = 0.1
        try:
            while not self._stopping.is_set():
                try:
                    await self._turn()
                    backoff_s = 0.1
                except RedisConnectionError as err:
                    log.warning("Redis unreachable (%s); retrying in %.1f s", err, backoff_s)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, 5.0)
        finally:
            heartbeat.cancel()
            await self._shutdown()

    # -- one turn ------------------------------------------------------------------------------

    async def _turn(self) -> None:
        for session_id in [sid for sid, hosted in self.sessions.items() if hosted.lost]:
            self._drop(session_id)
        streams = self._streams_to_read()
        busy = any(hosted.decoding for hosted in self.sessions.values())
        try:
            reply = await self.redis.xreadgroup(
                protocol.GROUP, self.id, streams, count=READ_COUNT, block=None if busy else IDLE_BLOCK_MS
            )
        except ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            await self._forget_vanished()
            return
        entries = {key.decode(): rows for key, rows in reply}
        for session_id in list(self.sessions):
            for entry_id, fields in entries.get(self.keys.questions(session_id), []):
                await self._answer(session_id, entry_id, fields)
        for session_id in list(self.sessions):
            for entry_id, fields in entries.get(self.keys.media(session_id), []):
                await self._receive_media(session_id, entry_id, fields)
        for entry_id, fields in entries.get(self.keys.pending(self.model.name), []):
            await self._claim(entry_id, fields)
        for session_id, hosted in list(self.sessions.items()):
            if hosted.decoding:
                await self._decode_step(session_id, hosted)

    def _streams_to_read(self) -> dict[str, str]:
        streams = {}
        for session_id, hosted in self.sessions.items():
            streams[self.keys.questions(session_id)] = ">"
            if not hosted.media_closed and not hosted.decoding:
                streams[self.keys.media(session_id)] = ">"
        if len(self.sessions) < self.settings.max_sessions:
            streams[self.keys.pending(self.model.name)] = ">"
        return streams

    # -- sessions ------------------------------------------------------------------------------

    async def _claim(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        session_id = fields[b"session_id"].decode()
        pending = self.keys.pending(self.model.name)
        try:
            if not await self.redis.set(self.keys.lease(session_id), self.id, nx=True, px=self._lease_ms):
                return  # another worker holds it
            stored = await self.redis.hgetall(self.keys.session(session_id))
            if not stored:
                await self._release(keys=[self.keys.lease(session_id)], args=[self.id])
                return  # expired while it waited
            stored.pop(b"token_sha256", None)
            record = SessionRecord.from_hash(stored)
            try:
                config = SessionConfig(policy=record.policy, budget_tokens=record.budget_tokens)
                engine = await self._in_engine(Session, self.model, config)
            except ValueError as err:
                await self._set(session_id, state=SessionState.ERROR, error=str(err), worker=self.id)
                await self._release(keys=[self.keys.lease(session_id)], args=[self.id])
                return
            self.sessions[session_id] = Hosted(record, engine)
            await self._transition(
                keys=[self.keys.session(session_id)], args=[SessionState.READY, SessionState.PENDING]
            )
            await self._report(session_id, self.sessions[session_id])
            log.info("took session %s", session_id)
        finally:
            await self._consume(pending, entry_id)

    def _drop(self, session_id: str) -> None:
        hosted = self.sessions.pop(session_id)
        if hosted.ingest is not None:
            hosted.ingest.close()
        log.info("dropped session %s", session_id)

    async def _forget_vanished(self) -> None:
        for session_id, hosted in self.sessions.items():
            if not await self.redis.exists(self.keys.session(session_id)):
                hosted.lost = True

    async def _fail(self, session_id: str, hosted: Hosted, message: str) -> None:
        hosted.error = message
        hosted.media_closed = True
        if hosted.ingest is not None:
            hosted.ingest.close()
            hosted.ingest = None
        await self._set(session_id, state=SessionState.ERROR, error=message)
        log.info("session %s failed: %s", session_id, message)

    # -- questions -----------------------------------------------------------------------------

    async def _answer(self, session_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        hosted = self.sessions[session_id]
        started = time.monotonic()
        try:
            question = Question.model_validate_json(fields[b"m"])
        except ValueError:
            log.warning("session %s: dropped a malformed question", session_id)
            await self._consume(self.keys.questions(session_id), entry_id)
            return
        stream = self.keys.answer(question.answer_id)
        try:
            if hosted.error:
                await self._publish(stream, ErrorEvent(code="session_error", message=hosted.error))
                return
            pieces = hosted.engine.ask(question.question, question.max_new_tokens)
            answer, tokens = [], 0
            while (piece := await self._in_engine(next, pieces, None)) is not None:
                tokens += 1
                if piece:
                    answer.append(piece)
                    await self._publish(stream, TokenEvent(text=piece))
            stats = hosted.engine.stats()
            done = DoneEvent(
                answer="".join(answer),
                tokens=tokens,
                video_time_s=stats.video_time_s,
                cache_tokens=stats.cache_tokens,
                worker_ms=round((time.monotonic() - started) * 1000, 1),
            )
            await self._publish(stream, done)
            await self._report(session_id, hosted)
        except Exception as err:
            log.exception("session %s: answering failed", session_id)
            await self._publish(stream, ErrorEvent(code="internal_error", message=f"answering failed: {err}"))
        finally:
            await self._consume(self.keys.questions(session_id), entry_id)

    async def _publish(self, stream: str, event: TokenEvent | DoneEvent | ErrorEvent) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, {"m": AnswerEnvelope(event=event).model_dump_json()}, maxlen=protocol.ANSWER_MAXLEN)
            pipe.expire(stream, protocol.ANSWER_TTL_S)
            await pipe.execute()

    # -- media ---------------------------------------------------------------------------------

    async def _receive_media(self, session_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        hosted = self.sessions[session_id]
        kind = fields.get(b"type", b"").decode()
        try:
            if hosted.media_closed:
                return
            if kind == "abort":
                await self._fail(session_id, hosted, "the upload was aborted before it finished")
                return
            if hosted.ingest is None:
                spool = self.settings.spool_dir / f"{self.id}-{session_id}.upload"
                hosted.ingest = UploadIngest(
                    spool, hosted.record.fps, self.settings.max_frame_side, self.settings.max_upload_bytes
                )
                await self._set(session_id, state=SessionState.INGESTING)
            if kind == "data":
                hosted.ingest.write(fields[b"data"])
                await self._set(session_id, upload_bytes=hosted.ingest.bytes_received)
            elif kind == "end":
                hosted.media_closed = True
                hosted.ingest.finish()
            else:
                raise DecodeError(f"unknown media entry {kind!r}")
        except (DecodeError, OSError) as err:
            await self._fail(session_id, hosted, str(err))
        finally:
            await self._consume(self.keys.media(session_id), entry_id)

    async def _decode_step(self, session_id: str, hosted: Hosted) -> None:
        assert hosted.ingest is not None
        try:
            frames = await self._in_thread(self._decode_thread, hosted.ingest.next_frames, self.settings.frames_per_step)
            if frames:
                images, times = [f.image for f in frames], [f.time_s for f in frames]
                await self._in_engine(hosted.engine.append_frames, images, times)
        except DecodeError as err:
            await self._fail(session_id, hosted, str(err))
            return
        except Exception as err:
            log.exception("session %s: ingest failed", session_id)
            await self._fail(session_id, hosted, f"ingest failed: {err}")
            return
        if hosted.ingest.exhausted:
            hosted.ingest.close()
            hosted.ingest = None
            if hosted.engine.stats().frames == 0:
                await self._fail(session_id, hosted, "the video has no frames")
                return
            await self._transition(
                keys=[self.keys.session(session_id)], args=[SessionState.INGESTED, SessionState.INGESTING]
            )
        await self._report(session_id, hosted)

    # -- bookkeeping ---------------------------------------------------------------------------

    async def _report(self, session_id: str, hosted: Hosted) -> None:
        stats = hosted.engine.stats()
        await self._set(
            session_id,
            worker=self.id,
            frames_ingested=stats.frames,
            video_time_s=round(stats.video_time_s, 3),
            cache_tokens=stats.cache_tokens,
        )

    async def _set(self, session_id: str, **fields: object) -> None:
        """Update the session's record and restart its idle clock."""
        session_key, media_key, questions_key = self.keys.session_data(session_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(session_key, mapping=protocol.to_hash(**fields))
            for key in (session_key, media_key, questions_key):
                pipe.expire(key, self.settings.session_ttl_s)
            await pipe.execute()

    async def _consume(self, stream: str, entry_id: bytes) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, protocol.GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def _ensure_group(self, stream: str) -> None:
        try:
            await self.redis.xgroup_create(stream, protocol.GROUP, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def _advertise(self) -> None:
        info = WorkerInfo(
            id=self.id,
            model=self.model.name,
            sessions=len(self.sessions),
            max_sessions=self.settings.max_sessions,
            expires_at=time.time() + self.settings.lease_ttl_s,
        )
        await self.redis.hset(self.keys.workers(), self.id, info.model_dump_json())

    async def _heartbeat(self) -> None:
        """Renew leases and the worker's advertisement; mark sessions whose lease was lost."""
        while True:
            await asyncio.sleep(self.settings.lease_ttl_s / 3)
            try:
                await self._advertise()
                for session_id, hosted in list(self.sessions.items()):
                    renewed = await self._renew(keys=[self.keys.lease(session_id)], args=[self.id, self._lease_ms])
                    if not renewed or not await self.redis.exists(self.keys.session(session_id)):
                        hosted.lost = True
                await self._forget_dead_workers()
            except RedisConnectionError as err:
                log.warning("heartbeat: Redis unreachable (%s)", err)

    async def _forget_dead_workers(self) -> None:
        horizon = time.time() - DEAD_WORKER_FORGET_S
        for worker_id, raw in (await self.redis.hgetall(self.keys.workers())).items():
            if WorkerInfo.model_validate_json(raw).expires_at < horizon:
                await self.redis.hdel(self.keys.workers(), worker_id)

    async def _shutdown(self) -> None:
        """Release every session (their caches die with this process) and leave the registry."""
        try:
            for session_id, hosted in list(self.sessions.items()):
                await self._fail(session_id, hosted, "the worker holding this session stopped")
                await self._release(keys=[self.keys.lease(session_id)], args=[self.id])
                self._drop(session_id)
            await self.redis.hdel(self.keys.workers(), self.id)
        except RedisConnectionError as err:
            log.warning("shutdown: Redis unreachable (%s)", err)
        finally:
            self._engine_thread.shutdown(wait=True, cancel_futures=True)
            self._decode_thread.shutdown(wait=True, cancel_futures=True)

    async def _in_engine(self, fn: Callable[..., T], *args: object) -> T:
        return await self._in_thread(self._engine_thread, fn, *args)

    @staticmethod
    async def _in_thread(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

"""Sessions in Redis, as the gateway sees them: create, look up, authenticate, hand media over."""

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from streamvqa import protocol
from streamvqa.protocol import Keys, SessionOptions, SessionRecord, SessionState, WorkerInfo

# Claims a live session's media slot for an upload and marks it ingesting. KEYS[1] = its hash.
# Returns 1 when claimed, 0 when the session already has media, -1 when it is gone.
START_UPLOAD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], 'media', 'upload') == 0 then return 0 end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'pending' or state == 'ready' then redis.call('HSET', KEYS[1], 'state', 'ingesting') end
return 1
"""
# Gives up an unfinished upload: tells the worker to drop its bytes, frees the media slot and
# puts the session back to ready (pending while no worker holds it). KEYS = hash, media stream;
# ARGV[1] = the media stream's MAXLEN.
ABORT_UPLOAD_LUA = """
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'abort')
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'media')
if redis.call('HGET', KEYS[1], 'state') == 'ingesting' then
  redis.call('HSET', KEYS[1], 'state', redis.call('HEXISTS', KEYS[1], 'worker') == 1 and 'ready' or 'pending')
end
return 1
"""
# Counts an owner's live sessions (forgetting those that expired or were deleted) and adds a new
# one when under the limit. KEYS[1] = the owner's set; ARGV = limit, the session hash key
# prefix, the new id, the set's TTL. Returns 1 when added.
RESERVE_LUA = """
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[2] .. id) == 0 then redis.call('SREM', KEYS[1], id) end
end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
ROOM_POLL_S = (0.02, 0.2)  # first and longest wait between checks of a full media backlog


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class UploadRefused(Exception):
    """The upload cannot go on; `code` and the message are for the client."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class TooManySessions(Exception):
    pass


class SessionStore:
    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.session_ttl_s = session_ttl_s
        self._start_upload = redis.register_script(START_UPLOAD_LUA)
        self._abort_upload = redis.register_script(ABORT_UPLOAD_LUA)
        self._reserve = redis.register_script(RESERVE_LUA)

    async def live_workers(self, model: str | None) -> list[WorkerInfo]:
        """The live workers serving `model` (None: any model)."""
        entries = await self.redis.hvals(self.keys.workers())
        workers = (WorkerInfo.model_validate_json(raw) for raw in entries)
        return [w for w in workers if w.alive and model in (None, w.model)]

    async def create(
        self, options: SessionOptions, model: str, owner: str, max_per_owner: int
    ) -> tuple[SessionRecord, str]:
        """Store a new session and queue it for a worker serving `model`; returns it and its token.
        TooManySessions when `owner` already holds `max_per_owner` live sessions."""
        token = secrets.token_urlsafe(32)
        record = SessionRecord(
            id=uuid.uuid4().hex,
            model=model,
            policy=options.policy,
            budget_tokens=options.budget_tokens,
            fps=options.fps,
            policy_options=options.policy_options.chosen(),
            system_prompt=options.system_prompt,
        )
        owned = self.keys.owner(owner)
        if not await self._reserve(keys=[owned], args=[max_per_owner, self.keys.session(""), record.id, self.session_ttl_s]):
            raise TooManySessions()
        session_key, media_key, questions_key, *_ = self.keys.session_data(record.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            fields = {**protocol.to_hash(**record.model_dump()), "token_sha256": _digest(token), "owner": owner}
            pipe.hset(session_key, mapping=fields)
            for stream in (media_key, questions_key):
                pipe.xgroup_create(stream, protocol.GROUP, id="0", mkstream=True)
            for key in self.keys.session_data(record.id):
                pipe.expire(key, self.session_ttl_s)
            pipe.xadd(
                self.keys.pending(model),
                {"session_id": record.id},
                maxlen=protocol.PENDING_MAXLEN,
                approximate=True,
            )
            await pipe.execute()
        return record, token

    async def owned(self, owner: str) -> list[SessionRecord]:
        """The owner's live sessions, newest first."""
        ids = [member.decode() for member in await self.redis.smembers(self.keys.owner(owner))]
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hgetall(self.keys.session(session_id))
            stored = await pipe.execute()
        records = []
        for fields in stored:
            if fields:
                fields.pop(b"token_sha256", None)
                records.append(SessionRecord.from_hash(fields))
        return sorted(records, key=lambda r: r.created_at, reverse=True)

    async def authenticate(self, session_id: str, token: str | None) -> tuple[SessionRecord | None, bool]:
        """The session (None when unknown) and whether `token` is its token."""
        fields = await self.redis.hgetall(self.keys.session(session_id))
        if not fields:
            return None, False
        expected = fields.pop(b"token_sha256", b"").decode()
        valid = token is not None and hmac.compare_digest(_digest(token), expected)
        return SessionRecord.from_hash(fields), valid

    async def touch(self, session_id: str) -> None:
        """Restart the session's idle clock."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in self.keys.session_data(session_id):
                pipe.expire(key, self.session_ttl_s)
            await pipe.execute()

    async def delete(self, session_id: str) -> None:
        """Remove the session's data; its worker notices within a heartbeat and frees its memory."""
        await self.redis.delete(*self.keys.session_data(session_id), self.keys.streamer(session_id))

    async def upload(self, session_id: str, chunks: AsyncIterator[bytes], max_bytes: int, stall_s: float) -> int:
        """Move an upload's bytes into the session's media stream; returns the byte count.

        Waits while the stream holds MEDIA_BACKLOG_ENTRIES entries, so a slow worker slows the
        client instead of filling Redis. Raises UploadRefused when the session already has media,
        when the upload is empty or over `max_bytes`, when the session fails meanwhile, or when
        the backlog stays full for `stall_s`. An unfinished upload (those, or the client going
        away) frees the session's media slot so that the client can try again.
        """
        session_key, stream = self.keys.session(session_id), self.keys.media(session_id)
        claimed = await self._start_upload(keys=[session_key])
        if claimed == 0:
            raise UploadRefused(409, "media_exists", "this session already has its media")
        if claimed < 0:
            raise UploadRefused(404, "session_not_found", f"no session {session_id}")
        total = 0
        finished = False
        try:
            async for chunk in chunks:
                total += len(chunk)
                if total > max_bytes:
                    raise UploadRefused(413, "upload_too_large", f"the upload exceeds the limit of {max_bytes} bytes")
                await self._wait_for_room(session_key, stream, stall_s)
                await self.redis.xadd(
                    stream, {"type": "data", "data": chunk}, maxlen=protocol.MEDIA_MAXLEN, approximate=True
                )
            if total == 0:
                raise UploadRefused(400, "empty_upload", "the upload is empty")
            await self.redis.xadd(stream, {"type": "end", "bytes": str(total)}, maxlen=protocol.MEDIA_MAXLEN, approximate=True)
            finished = True
        finally:
            if not finished:
                await self._abort_upload(keys=[session_key, stream], args=[protocol.MEDIA_MAXLEN])
        return total

    async def _wait_for_room(self, session_key: str, stream: str, stall_s: float) -> None:
        deadline = time.monotonic() + stall_s
        pause_s = ROOM_POLL_S[0]
        while await self.redis.xlen(stream) >= protocol.MEDIA_BACKLOG_ENTRIES:
            state, error = await self.redis.hmget(session_key, "state", "error")
            if state == SessionState.ERROR.encode():
                raise UploadRefused(409, "session_error", f"the session failed: {(error or b'').decode()}")
            if time.monotonic() > deadline:
                raise UploadRefused(503, "worker_stalled", "the session's worker stopped reading the upload")
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, ROOM_POLL_S[1])

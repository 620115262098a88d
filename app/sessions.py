"""Sessions in Redis, as the gateway sees them: create, look up, authenticate, hand media over."""

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from streamvqa import protocol
from streamvqa.protocol import Keys, SessionOptions, SessionRecord, SessionState, WorkerInfo

# Queues a session that no worker holds (it left its worker idle) for a worker of its model,
# once (`queued` holds when; after REQUEUE_AFTER_S without a worker, a lost entry is replaced):
# a Lua function the scripts that bring work to a session call. `hash`, `pending`, `admitted`
# are keys; `id` the session id, `maxlen` the pending MAXLEN, `now` the time.
REQUEUE_AFTER_S = 30
WAKE_LUA = f"""
local function wake(hash, pending, admitted, id, maxlen, now)
  local found = redis.call('HMGET', hash, 'worker', 'queued', 'state')
  local waiting = found[2] and tonumber(now) - tonumber(found[2]) < {REQUEUE_AFTER_S}
  if (not found[1] or found[1] == '') and not waiting and found[3] ~= 'error' then
    redis.call('HSET', hash, 'queued', now)
    redis.call('XADD', pending, 'MAXLEN', '~', maxlen, '*', 'session_id', id)
    redis.call('ZADD', admitted, now, id)
  end
end
"""
# Stores a new session and queues it, unless its owner holds ARGV[1] sessions already (-1) or
# the model's live workers have no place for it (-2). KEYS = the owner's set, the hash, media
# and question streams, the model's pending queue and admitted set; ARGV = owner limit, the hash
# key prefix, the id, the owner set's TTL, the places (live workers' MAX_SESSIONS), the time,
# the pending MAXLEN, then the hash's field, value pairs. Returns 1 when created.
CREATE_LUA = """
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[2] .. id) == 0 then redis.call('SREM', KEYS[1], id) end
end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return -1 end
for _, id in ipairs(redis.call('ZRANGE', KEYS[6], 0, -1)) do
  local found = redis.call('HMGET', ARGV[2] .. id, 'state', 'worker', 'queued')
  if not found[1] or found[1] == 'error' or ((not found[2] or found[2] == '') and not found[3]) then
    redis.call('ZREM', KEYS[6], id)
  end
end
if redis.call('ZCARD', KEYS[6]) >= tonumber(ARGV[5]) then return -2 end
redis.call('HSET', KEYS[2], 'queued', ARGV[6], unpack(ARGV, 8))
redis.call('XGROUP', 'CREATE', KEYS[3], 'workers', '0', 'MKSTREAM')
redis.call('XGROUP', 'CREATE', KEYS[4], 'workers', '0', 'MKSTREAM')
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[7], '*', 'session_id', ARGV[3])
redis.call('ZADD', KEYS[6], ARGV[6], ARGV[3])
redis.call('SADD', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
# Claims a live session's media slot for an upload, marks it ingesting and claims its media for
# this request (renewed while it lives: a worker gives up an upload whose claim lapsed). KEYS =
# its hash, the model's pending queue and admitted set, the streamer claim; ARGV = the id, the
# pending MAXLEN, the time, the upload's connection id, the claim's TTL (ms). Returns 1 when
# claimed, 0 when the session already has media, -1 when it is gone.
START_UPLOAD_LUA = WAKE_LUA + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], 'media', 'upload') == 0 then return 0 end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'pending' or state == 'ready' then redis.call('HSET', KEYS[1], 'state', 'ingesting') end
redis.call('SET', KEYS[4], ARGV[4], 'PX', ARGV[5])
wake(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3])
return 1
"""
# Adds an upload's entry while the session lives, once: ARGV[2] is the upload's bytes queued
# before it, ARGV[3] its own (a call retried after its reply was lost finds them counted).
# KEYS = hash, media stream; ARGV = MAXLEN, offset, bytes, then the entry's field, value pairs.
# Returns 1, -1 when the session is gone, -2 when bytes before it are missing (Redis lost them).
UPLOAD_ADD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local queued = tonumber(redis.call('HGET', KEYS[1], 'upload_queued') or '0')
if queued > tonumber(ARGV[2]) then return 1 end
if queued < tonumber(ARGV[2]) then return -2 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 4))
redis.call('HINCRBY', KEYS[1], 'upload_queued', ARGV[3])
return 1
"""
# Gives up an unfinished upload: tells the worker to drop its bytes, frees the media slot and
# puts the session back to ready (pending while no worker ever held it). KEYS = hash, media
# stream; ARGV[1] = the media stream's MAXLEN. Nothing is written for a session that is gone.
ABORT_UPLOAD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'abort')
redis.call('HDEL', KEYS[1], 'media', 'upload_queued')
if redis.call('HGET', KEYS[1], 'state') == 'ingesting' then
  redis.call('HSET', KEYS[1], 'state', redis.call('HEXISTS', KEYS[1], 'worker') == 1 and 'ready' or 'pending')
end
return 1
"""
# Deletes a session with every answer it was asked, at once. KEYS = the session's keys (the
# asked set first), then the model's admitted set; ARGV = the answer keys' prefix, the id.
DELETE_LUA = """
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do redis.call('DEL', ARGV[1] .. id) end
redis.call('ZREM', KEYS[#KEYS], ARGV[2])
return redis.call('DEL', unpack(KEYS, 1, #KEYS - 1))
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


class NoPlace(Exception):
    """The model's live workers hold (or are about to take) as many sessions as they may."""


class SessionStore:
    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.session_ttl_s = session_ttl_s
        self._create = redis.register_script(CREATE_LUA)
        self._start_upload = redis.register_script(START_UPLOAD_LUA)
        self._upload_add = redis.register_script(UPLOAD_ADD_LUA)
        self._abort_upload = redis.register_script(ABORT_UPLOAD_LUA)
        self._delete = redis.register_script(DELETE_LUA)
        self._renew_claim = redis.register_script(protocol.RENEW_CLAIM_LUA)
        self._release = redis.register_script(protocol.RELEASE_LUA)

    async def workers(self) -> list[WorkerInfo]:
        """Every worker in the registry, alive or not (those silent for an hour are forgotten)."""
        return [WorkerInfo.model_validate_json(raw) for raw in await self.redis.hvals(self.keys.workers())]

    async def live_workers(self, model: str | None) -> list[WorkerInfo]:
        """The live workers serving `model` (None: any model)."""
        return [w for w in await self.workers() if w.alive and model in (None, w.model)]

    async def create(
        self, options: SessionOptions, model: str, context_tokens: int, owner: str, max_per_owner: int, places: int
    ) -> tuple[SessionRecord, str]:
        """Store a new session and queue it for a worker serving `model`; returns it and its token.
        TooManySessions when `owner` already holds `max_per_owner` live sessions; NoPlace when
        the model's workers already hold or are about to take `places` sessions (counted in one
        script, so that concurrent creates never admit more)."""
        token = secrets.token_hex(32)  # never begins with "-", so `--token <token>` works on any command line
        record = SessionRecord(
            id=uuid.uuid4().hex,
            model=model,
            policy=options.policy,
            budget_tokens=options.budget_tokens,
            fps=options.fps,
            policy_options=options.policy_options.chosen(),
            system_prompt=options.system_prompt,
            recall=options.recall,
            host_budget_tokens=options.host_tokens,
            retrieval_tokens=options.borrowed_tokens,
            pin_turns=options.pin_turns,
            context_tokens=context_tokens,
        )
        fields = {**protocol.to_hash(**record.model_dump()), "token_sha256": _digest(token), "owner": owner}
        keys = [
            self.keys.owner(owner), self.keys.session(record.id), self.keys.media(record.id),
            self.keys.questions(record.id), self.keys.pending(model), self.keys.admitted(model),
        ]
        args = [
            max_per_owner, self.keys.session(""), record.id, self.session_ttl_s, places, time.time(),
            protocol.PENDING_MAXLEN, *[item for pair in fields.items() for item in pair],
        ]
        created = await self._create(keys=keys, args=args)
        if created == -1:
            raise TooManySessions()
        if created == -2:
            raise NoPlace()
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

    async def delete(self, session: SessionRecord) -> None:
        """Remove the session's data and its answers at once; its worker stops at its next step
        (an answer under way stops at its next token) and frees its memory."""
        asked = self.keys.asked(session.id)
        keys = [
            asked, *(key for key in self.keys.session_data(session.id) if key != asked),
            self.keys.streamer(session.id), self.keys.lease(session.id),
        ]
        await self._delete(keys=[*keys, self.keys.admitted(session.model)], args=[self.keys.answer(session.id, ""), session.id])

    async def upload(
        self, session: SessionRecord, chunks: AsyncIterator[bytes], max_bytes: int, stall_s: float
    ) -> int:
        """Move an upload's bytes into the session's media stream; returns the byte count.

        Waits while the stream holds MEDIA_BACKLOG_ENTRIES entries, so a slow worker slows the
        client instead of filling Redis. Raises UploadRefused when the session already has media,
        when the upload is empty or over `max_bytes`, when the session fails or is deleted
        meanwhile, or when the backlog stays full for `stall_s`. An unfinished upload (those, or
        the client going away) frees the session's media slot so that the client can try again.
        """
        session_key, stream, claim = self.keys.session(session.id), self.keys.media(session.id), self.keys.streamer(session.id)
        connection = f"upload-{uuid.uuid4().hex[:16]}"
        claimed = await self._start_upload(
            keys=[session_key, self.keys.pending(session.model), self.keys.admitted(session.model), claim],
            args=[session.id, protocol.PENDING_MAXLEN, time.time(), connection, protocol.STREAMER_TTL_S * 1000],
        )
        if claimed == 0:
            raise UploadRefused(409, "media_exists", "this session already has its media")
        if claimed < 0:
            raise UploadRefused(404, "session_not_found", f"no session {session.id}")
        total = 0
        finished = False
        holding = asyncio.create_task(self._hold_claim(claim, connection))
        try:
            async for chunk in chunks:
                if total + len(chunk) > max_bytes:
                    raise UploadRefused(413, "upload_too_large", f"the upload exceeds the limit of {max_bytes} bytes")
                await self._wait_for_room(session_key, stream, stall_s)
                await self._add_upload_entry(session, total, {"type": "data", "data": chunk})
                total += len(chunk)
            if total == 0:
                raise UploadRefused(400, "empty_upload", "the upload is empty")
            await self._add_upload_entry(session, total, {"type": "end", "bytes": str(total)})
            finished = True
        finally:
            holding.cancel()
            if not finished:
                await self._abort_upload(keys=[session_key, stream], args=[protocol.MEDIA_MAXLEN])
            await self._release(keys=[claim], args=[connection])
        return total

    async def _hold_claim(self, claim: str, connection: str) -> None:
        """Renew an upload's claim on the session's media while the upload lasts."""
        while True:
            await asyncio.sleep(protocol.STREAMER_TTL_S / 3)
            try:
                await self._renew_claim(keys=[claim], args=[connection, protocol.STREAMER_TTL_S * 1000])
            except RedisError:
                pass  # the upload's own next step fails too, and says so

    async def _add_upload_entry(self, session: SessionRecord, offset: int, fields: dict[str, bytes | str]) -> None:
        """Add the upload's entry that follows its first `offset` bytes."""
        pairs = [item for pair in fields.items() for item in pair]
        keys = [self.keys.session(session.id), self.keys.media(session.id)]
        size = len(fields["data"]) if "data" in fields else 0
        added = await self._upload_add(keys=keys, args=[protocol.MEDIA_MAXLEN, offset, size, *pairs])
        if added == -1:
            raise UploadRefused(404, "session_not_found", "the session was deleted during the upload")
        if added == -2:
            raise UploadRefused(503, "redis_unreachable", "Redis lost part of the upload (it restarted); upload it again")

    async def _wait_for_room(self, session_key: str, stream: str, stall_s: float) -> None:
        deadline = time.monotonic() + stall_s
        pause_s = ROOM_POLL_S[0]
        while await self.redis.xlen(stream) >= protocol.MEDIA_BACKLOG_ENTRIES:
            state, error = await self.redis.hmget(session_key, "state", "error")
            if state is None:
                raise UploadRefused(404, "session_not_found", "the session was deleted during the upload")
            if state == SessionState.ERROR.encode():
                raise UploadRefused(409, "session_error", f"the session failed: {(error or b'').decode()}")
            if time.monotonic() > deadline:
                raise UploadRefused(503, "worker_stalled", "the session's worker stopped reading the upload")
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, ROOM_POLL_S[1])

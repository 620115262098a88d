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
from streamvqa.pending import REQUEUE_AFTER_S, enqueue, leave
from streamvqa.redis_client import FAILURES
from streamvqa.protocol import Keys, SessionOptions, SessionRecord, SessionState, WorkerInfo

# Marks a session that no worker holds (it left its worker idle) as waiting for a worker of its
# model, once (`queued` holds when; after REQUEUE_AFTER_S without a worker, a lost entry is
# replaced): a Lua function the scripts that bring work to a session call. `waking` wraps such a
# script so that it returns {its result, 1 when it marked the session}; the caller then queues it
# (`streamvqa.pending.enqueue`: the queue is a global key, in another slot than the session's).
WAKE_LUA = f"""
local woke = 0
local function wake(hash, now)
  local found = redis.call('HMGET', hash, 'worker', 'queued', 'state')
  local waiting = found[2] and tonumber(now) - tonumber(found[2]) < {REQUEUE_AFTER_S}
  if (not found[1] or found[1] == '') and not waiting and found[3] ~= 'error' then
    redis.call('HSET', hash, 'queued', now)
    woke = 1
  end
end
local function body()
"""


def waking(body: str) -> str:
    """A script whose body may call `wake(hash, now)`; it returns {the body's result, woke}."""
    return WAKE_LUA + body + "\nend\nreturn {body(), woke}\n"


# Stores a new session, queued (`queued` is the time), with its media and question streams and
# their group, for CREATE_GRACE_S: it gets SESSION_TTL_S once it holds its places. KEYS = the
# hash, media and question streams; ARGV = the grace TTL (s), the time, then the hash's field,
# value pairs.
CREATE_LUA = """
redis.call('HSET', KEYS[1], 'queued', ARGV[2], unpack(ARGV, 3))
redis.call('XGROUP', 'CREATE', KEYS[2], 'workers', '0', 'MKSTREAM')
redis.call('XGROUP', 'CREATE', KEYS[3], 'workers', '0', 'MKSTREAM')
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return 1
"""
CREATE_GRACE_S = 60  # a session whose gateway died while creating it is gone this soon
# Adds ARGV[2] to its owner's set (KEYS[1]) unless it holds ARGV[1] sessions already, and gives
# the set a TTL of ARGV[3] s. Returns 1, or 0 when it is full.
TAKE_OWNED_LUA = """
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
# Adds ARGV[2] to a model's admitted sessions (KEYS[1]) at time ARGV[3], unless they hold the
# ARGV[1] places of its live workers already. Returns 1, or 0 when they are full.
TAKE_PLACE_LUA = """
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return 1
"""
# Removes members of a sorted set whose score is still the one read (ARGV: member, score pairs),
# so that one added again since it was read stays. Returns how many went.
DROP_UNCHANGED_LUA = """
local dropped = 0
for i = 1, #ARGV, 2 do
  if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i])) == tonumber(ARGV[i + 1]) then
    dropped = dropped + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return dropped
"""
# Claims a live session's media slot for an upload, marks it ingesting and claims its media for
# this request (renewed while it lives: a worker gives up an upload whose claim lapsed). KEYS =
# its hash, the streamer claim; ARGV = the time, the upload's connection id, the claim's TTL
# (ms). Returns 1 when claimed, 0 when the session already has media, -1 when it is gone.
START_UPLOAD_LUA = waking("""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], 'media', 'upload') == 0 then return 0 end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'pending' or state == 'ready' then redis.call('HSET', KEYS[1], 'state', 'ingesting') end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
wake(KEYS[1], ARGV[1])
return 1
""")
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
# asked set first); ARGV = the answer keys' prefix.
DELETE_LUA = """
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do redis.call('DEL', ARGV[1] .. id) end
return redis.call('DEL', unpack(KEYS))
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
        self._take_owned = redis.register_script(TAKE_OWNED_LUA)
        self._take_place = redis.register_script(TAKE_PLACE_LUA)
        self._drop_unchanged = redis.register_script(DROP_UNCHANGED_LUA)
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
        the model's workers already hold or are about to take `places` sessions (checked and
        taken in one script on the model's admitted set, so that concurrent creates never admit
        more). The session is written first, with a short TTL that becomes SESSION_TTL_S once
        both places are taken: a gateway that dies part-way leaves nothing that lasts."""
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
        session_keys = [self.keys.session(record.id), self.keys.media(record.id), self.keys.questions(record.id)]
        now = time.time()
        await self._create(
            keys=session_keys, args=[CREATE_GRACE_S, now, *[item for pair in fields.items() for item in pair]]
        )
        owned = self.keys.owner(owner)
        try:
            await self._forget_gone_owned(owner)
            if await self.redis.scard(owned) >= max_per_owner:  # the common refusal, before a place is taken
                raise TooManySessions()
            await self._forget_unadmitted(model)
            if not await self._take_place(keys=[self.keys.admitted(model)], args=[places, record.id, now]):
                raise NoPlace()
            if not await self._take_owned(keys=[owned], args=[max_per_owner, record.id, self.session_ttl_s]):
                await leave(self.redis, self.keys, record.id, model)
                raise TooManySessions()
        except BaseException:
            await self.redis.delete(*session_keys)
            raise
        await enqueue(self.redis, self.keys, record.id, model, now)
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in session_keys:
                pipe.expire(key, self.session_ttl_s)
            await pipe.execute()
        return record, token

    async def _forget_gone_owned(self, owner: str) -> None:
        """Drop from the owner's set the sessions that are gone (a session's hash is written
        before its id joins the set, and an id is never reused: a missing hash is gone for good)."""
        ids = list(await self.redis.smembers(self.keys.owner(owner)))
        if not ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.exists(self.keys.session(session_id.decode()))
            found = await pipe.execute()
        gone = [session_id for session_id, exists in zip(ids, found, strict=True) if not exists]
        if gone:
            await self.redis.srem(self.keys.owner(owner), *gone)

    async def _forget_unadmitted(self, model: str) -> None:
        """Drop from the model's admitted sessions those gone, failed, or parked (no worker, not
        queued), unless one was admitted again since it was read."""
        admitted = await self.redis.zrange(self.keys.admitted(model), 0, -1, withscores=True)
        if not admitted:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, _ in admitted:
                pipe.hmget(self.keys.session(session_id.decode()), "state", "worker", "queued")
            found = await pipe.execute()
        unadmitted = []
        for (session_id, score), (state, worker, queued) in zip(admitted, found, strict=True):
            if state is None or state == SessionState.ERROR.encode() or (not worker and queued is None):
                unadmitted += [session_id, repr(score)]
        if unadmitted:
            await self._drop_unchanged(keys=[self.keys.admitted(model)], args=unadmitted)

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
        await self._delete(keys=keys, args=[self.keys.answer(session.id, "")])
        await leave(self.redis, self.keys, session.id, session.model)

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
        now = time.time()
        claimed, woke = await self._start_upload(
            keys=[session_key, claim], args=[now, connection, protocol.STREAMER_TTL_S * 1000]
        )
        if woke:
            await enqueue(self.redis, self.keys, session.id, session.model, now)
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
            except FAILURES:
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

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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class UploadTooLarge(Exception):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the upload exceeds the limit of {max_bytes} bytes")


class UploadStalled(Exception):
    """The session's media backlog stayed full: no worker is consuming it."""


class SessionStore:
    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.session_ttl_s = session_ttl_s
        self._transition = redis.register_script(protocol.TRANSITION_LUA)

    async def live_workers(self, model: str) -> list[WorkerInfo]:
        entries = await self.redis.hvals(self.keys.workers())
        workers = (WorkerInfo.model_validate_json(raw) for raw in entries)
        return [w for w in workers if w.alive and w.model == model]

    async def create(self, options: SessionOptions, model: str) -> tuple[SessionRecord, str]:
        """Store a new session and queue it for a worker serving `model`; returns it and its token."""
        token = secrets.token_urlsafe(32)
        record = SessionRecord(
            id=uuid.uuid4().hex,
            model=model,
            policy=options.policy,
            budget_tokens=options.budget_tokens,
            fps=options.fps,
        )
        session_key, media_key, questions_key = self.keys.session_data(record.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(session_key, mapping={**protocol.to_hash(**record.model_dump()), "token_sha256": _digest(token)})
            for stream in (media_key, questions_key):
                pipe.xgroup_create(stream, protocol.GROUP, id="0", mkstream=True)
            for key in (session_key, media_key, questions_key):
                pipe.expire(key, self.session_ttl_s)
            pipe.xadd(
                self.keys.pending(model),
                {"session_id": record.id},
                maxlen=protocol.PENDING_MAXLEN,
                approximate=True,
            )
            await pipe.execute()
        return record, token

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

    async def start_upload(self, session_id: str) -> bool:
        """Claim the session's media slot for an upload; False when it already has media."""
        key = self.keys.session(session_id)
        if not await self.redis.hsetnx(key, "media", "upload"):
            return False
        await self._transition(
            keys=[key], args=[SessionState.INGESTING, SessionState.PENDING, SessionState.READY]
        )
        return True

    async def push_media(
        self, session_id: str, chunks: AsyncIterator[bytes], max_bytes: int, stall_s: float
    ) -> int:
        """Move an upload's bytes into the session's media stream; returns the byte count.

        Waits while the stream holds MEDIA_BACKLOG_ENTRIES entries, so a slow worker slows the
        client instead of filling Redis. Raises UploadTooLarge past `max_bytes` and UploadStalled
        when the backlog stays full for `stall_s`. Either way, and when the client goes away,
        the worker is told to abort.
        """
        stream = self.keys.media(session_id)
        total = 0
        finished = False
        try:
            async for chunk in chunks:
                total += len(chunk)
                if total > max_bytes:
                    raise UploadTooLarge(max_bytes)
                await self._wait_for_room(stream, stall_s)
                await self._xadd(stream, {"type": "data", "data": chunk})
            await self._xadd(stream, {"type": "end", "bytes": str(total)})
            finished = True
        finally:
            if not finished:
                await self._xadd(stream, {"type": "abort"})
        return total

    async def _wait_for_room(self, stream: str, stall_s: float) -> None:
        deadline = time.monotonic() + stall_s
        while await self.redis.xlen(stream) >= protocol.MEDIA_BACKLOG_ENTRIES:
            if time.monotonic() > deadline:
                raise UploadStalled()
            await asyncio.sleep(0.02)

    async def _xadd(self, stream: str, fields: dict) -> None:
        await self.redis.xadd(stream, fields, maxlen=protocol.MEDIA_MAXLEN, approximate=True)

"""Sessions in Redis, as the gateway sees them: create, look up, authenticate, hand media over."""

import asyncio
import hashlib
import hmac
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from redis.asyncio import Redis

from app import backlog, media_stream
from streamvqa import protocol
from streamvqa.pending import enqueue, leave, place
from streamvqa.redis_client import FAILURES
from streamvqa.protocol import (
    Keys, MediaEntry, MediaKind, SessionOptions, SessionRecord, SessionState, WorkerInfo, reserved_device_bytes, scripts,
)

CREATE_GRACE_S = 60  # a session whose gateway died while creating it is gone this soon
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # what `create` makes: an id in any other form is no session's


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class UploadRefused(Exception):
    """The upload cannot go on; `code` and the message are for the client."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class TooManySessions(Exception):
    """The owner holds as many sessions as it may (failed ones do not count)."""


class NoPlace(Exception):
    """The model's live workers hold (or are about to take) as many sessions as they may
    (`short` "places"), or their sessions reserve so much of their cache memory ("device") or
    host memory ("host") that this one's would not fit."""

    def __init__(self, short: str) -> None:
        super().__init__(short)
        self.short = short


NO_PLACE = {0: "places", -1: "device", -2: "host"}  # scripts.TAKE_PLACE_LUA's refusals
UPLOAD_REFUSED = {
    media_stream.GONE: (404, "session_not_found", "the session was deleted during the upload"),
    media_stream.FAILED: (409, "session_error", "the session failed during the upload"),
    media_stream.NOT_CLAIMED: (409, "media_exists", "the session's media was taken over during the upload"),
    media_stream.BYTES_LOST: (503, "redis_unreachable", "Redis lost part of the upload (it restarted); upload it again"),
}  # media_stream.add's refusals, as an upload's replies


@dataclass(frozen=True)
class Room:
    """What a model's live workers offer, each (empty: not known), and what a new session reserves
    on one of them."""

    places: int
    device_bytes: int  # the session's peak cache (and its host tier's index), on a worker's device
    host_bytes: int  # its host tier, in a worker's RAM
    device_limits: tuple[int, ...]  # the cache memory each worker offers
    host_limits: tuple[int, ...]  # the host memory each offers, worker by worker as device_limits

    @classmethod
    def of(cls, workers: Iterable[WorkerInfo], peak_tokens: int, host_tokens: int) -> "Room":
        """The live workers of one model (which share its bytes per token) and a session's needs."""
        workers = list(workers)
        known = all(w.kv_bytes_per_token and w.kv_memory_bytes for w in workers)  # not a worker that offers no figure
        return cls(
            places=sum(w.max_sessions for w in workers),
            device_bytes=max(
                reserved_device_bytes(peak_tokens, host_tokens, w.kv_bytes_per_token, w.index_bytes_per_host_token)
                for w in workers
            ),
            host_bytes=host_tokens * max(w.host_bytes_per_token for w in workers),
            device_limits=tuple(w.kv_memory_bytes for w in workers) if known else (),
            host_limits=tuple(w.host_memory_bytes for w in workers) if known else (),
        )

    def limits(self) -> list[int]:
        """Each worker's device and host bytes, in turn (scripts.TAKE_PLACE_LUA's arguments)."""
        return [limit for pair in zip(self.device_limits, self.host_limits, strict=True) for limit in pair]


class SessionStore:
    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.session_ttl_s = session_ttl_s
        self._create = redis.register_script(scripts.CREATE_SESSION_LUA)
        self._take_owned = redis.register_script(scripts.TAKE_OWNED_LUA)
        self._take_place = redis.register_script(scripts.TAKE_PLACE_LUA)
        self._drop_unchanged = redis.register_script(scripts.DROP_UNCHANGED_LUA)
        self._start_upload = redis.register_script(scripts.START_UPLOAD_LUA)
        self._abort_upload = redis.register_script(scripts.ABORT_UPLOAD_LUA)
        self._delete = redis.register_script(scripts.DELETE_SESSION_LUA)
        self._renew_claim = redis.register_script(scripts.RENEW_MEDIA_CLAIM_LUA)
        self._release = redis.register_script(scripts.RELEASE_LUA)

    async def workers(self) -> list[WorkerInfo]:
        """Every worker in the registry, alive or not (those silent for an hour are forgotten)."""
        return [WorkerInfo.model_validate_json(raw) for raw in await self.redis.hvals(self.keys.workers())]

    async def live_workers(self, model: str | None) -> list[WorkerInfo]:
        """The live workers serving `model` (None: any model)."""
        return [w for w in await self.workers() if w.alive and model in (None, w.model)]

    async def create(
        self, options: SessionOptions, model: str, context_tokens: int, owner: str, max_per_owner: int, room: Room
    ) -> tuple[SessionRecord, str]:
        """Store a new session and queue it for a worker serving `model`; returns it and its token.
        TooManySessions when `owner` already holds `max_per_owner` sessions that have not failed
        (ended and expired ones are gone, and failed ones are left out, at once); NoPlace when
        the model's workers already hold or are about to take `room.places` sessions, or when
        those sessions and this one cannot each be placed whole on one worker's memory (checked
        and taken in one script on the model's places, so that concurrent creates never admit more).
        The session is written first, with a short TTL that becomes SESSION_TTL_S once both
        places are taken: a gateway that dies part-way leaves nothing that lasts."""
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
        reserved = f"{room.device_bytes} {room.host_bytes}"  # given again each time it is brought back
        fields = {
            **protocol.to_hash(**record.model_dump()), "token_sha256": _digest(token), "owner": owner, "reserved": reserved,
        }
        session_keys = [self.keys.session(record.id), self.keys.media(record.id), self.keys.questions(record.id)]
        now = time.time()
        await self._create(
            keys=session_keys, args=[CREATE_GRACE_S, now, *[item for pair in fields.items() for item in pair]]
        )
        owned = self.keys.owner(owner)
        try:
            failed = await self._failed_owned(owner, max_per_owner)
            if await self.redis.scard(owned) - len(failed) >= max_per_owner:  # the common refusal, before a place is taken
                raise TooManySessions()
            await self._forget_unadmitted(model)
            taken = await self._take_place(keys=[self.keys.places(model)], args=[
                room.places, record.id, place(now, reserved), room.device_bytes, room.host_bytes, *room.limits(),
            ])
            if taken != 1:
                raise NoPlace(NO_PLACE[taken])
            if not await self._take_owned(keys=[owned], args=[max_per_owner, record.id, self.session_ttl_s, *failed]):
                await leave(self.redis, self.keys, record.id, model)
                raise TooManySessions()
        except BaseException:
            await self.redis.delete(*session_keys)
            raise
        await enqueue(self.redis, self.keys, record.id, model, now)
        await self.touch(record.id)
        return record, token

    async def _failed_owned(self, owner: str, max_failed: int) -> list[bytes]:
        """The owner's failed sessions, which do not count toward its limit (an error is final).
        Drops from the owner's set the sessions that are gone, ended or expired (a session's hash
        is written before its id joins the set, and an id is never reused: a missing hash is gone
        for good), and the failed ones past the newest `max_failed`: those are no longer listed
        (their token still reads them until they expire), so that the set holds at most
        `max_failed` failed sessions beside the live ones."""
        ids = list(await self.redis.smembers(self.keys.owner(owner)))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self.keys.session(session_id.decode()), "state", "created_at")
            found = await pipe.execute()
        gone, failed = [], []
        for session_id, (state, created_at) in zip(ids, found, strict=True):
            if state is None:
                gone.append(session_id)
            elif state == SessionState.ERROR.encode():
                failed.append((float(created_at or 0), session_id))
        failed = [session_id for _, session_id in sorted(failed, reverse=True)]  # newest first
        gone += failed[max_failed:]
        if gone:
            await self.redis.srem(self.keys.owner(owner), *gone)
        return failed[:max_failed]

    async def _forget_unadmitted(self, model: str) -> None:
        """Drop from the model's places those of sessions gone, failed, or parked (no worker, not
        queued), with the memory they reserve, unless one was admitted again since it was read."""
        admitted = list((await self.redis.hgetall(self.keys.places(model))).items())
        if not admitted:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, _ in admitted:
                pipe.hmget(self.keys.session(session_id.decode()), "state", "worker", "queued")
            found = await pipe.execute()
        unadmitted = []
        for (session_id, entry), (state, worker, queued) in zip(admitted, found, strict=True):
            if state is None or state == SessionState.ERROR.encode() or (not worker and queued is None):
                unadmitted += [session_id, entry]
        if unadmitted:
            await self._drop_unchanged(keys=[self.keys.places(model)], args=unadmitted)

    async def owned(self, owner: str, every: bool = True, token: str | None = None) -> tuple[list[SessionRecord], int]:
        """The owner's sessions, failed ones among them, newest first: every one, or (not `every`)
        only the one whose token is `token`; and how many of all of them have not failed."""
        ids = [member.decode() for member in await self.redis.smembers(self.keys.owner(owner))]
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hgetall(self.keys.session(session_id))
            stored = await pipe.execute()
        digest = _digest(token) if token is not None else None
        records, counted = [], 0
        for fields in stored:
            if fields:
                expected = fields.pop(b"token_sha256", b"").decode()
                record = SessionRecord.from_hash(fields)
                counted += record.state != SessionState.ERROR
                if every or (digest is not None and hmac.compare_digest(digest, expected)):
                    records.append(record)
        return sorted(records, key=lambda r: r.created_at, reverse=True), counted

    async def authenticate(
        self, session_id: str, token: str | None, owner: str | None = None
    ) -> tuple[SessionRecord | None, bool]:
        """The session (None when unknown) and whether `token` is its token or, when `owner` is
        given, `owner` is who created it."""
        fields = await self.redis.hgetall(self.keys.session(session_id)) if SESSION_ID.fullmatch(session_id) else None
        if not fields:
            return None, False
        expected = fields.pop(b"token_sha256", b"").decode()
        valid = token is not None and hmac.compare_digest(_digest(token), expected)
        owned = owner is not None and fields.get(b"owner", b"").decode() == owner
        return SessionRecord.from_hash(fields), valid or owned

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
        await self._delete(keys=keys, args=[self.keys.answer(session.id, ""), self.keys.cancel(session.id, "")])
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
                await self._wait_for_room(session.id, stall_s)
                await self._add_upload_entry(session, connection, total, MediaEntry(MediaKind.DATA, data=chunk))
                total += len(chunk)
            if total == 0:
                raise UploadRefused(400, "empty_upload", "the upload is empty")
            await self._add_upload_entry(session, connection, total, MediaEntry(MediaKind.END, upload_bytes=total))
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

    async def _add_upload_entry(self, session: SessionRecord, connection: str, offset: int, entry: MediaEntry) -> None:
        """Add the upload's entry that follows its first `offset` bytes, as the writer `connection`."""
        added = await media_stream.add(self.redis, self.keys, session, connection, entry, len(entry.data), offset=offset)
        if isinstance(added, int) and added in UPLOAD_REFUSED:
            raise UploadRefused(*UPLOAD_REFUSED[added])

    async def _wait_for_room(self, session_id: str, stall_s: float) -> None:
        try:
            await backlog.wait_for_room(self.redis, self.keys, session_id, stall_s)
        except backlog.SessionGone as err:
            raise UploadRefused(404, "session_not_found", "the session was deleted during the upload") from err
        except backlog.SessionFailed as err:
            raise UploadRefused(409, "session_error", f"the session failed: {err}") from err
        except backlog.WorkerStalled as err:
            raise UploadRefused(503, "worker_stalled", "the session's worker stopped reading the upload") from err

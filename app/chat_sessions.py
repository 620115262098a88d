"""The session a chat completion asks, and the question it asks it.

- **Named** (`session_id` in the body, or the `X-Session-Id` header): the session, when the
  bearer key is its token, or the key that owns it (with API_KEYS; without them, the address
  that made it through this route). Media in the messages is added if it has none yet.
- **Media and no name**: the caller's session for this content (model, opening, media by its
  SHA-256), found by a key with the session's TTL; else a new session made as `POST /sessions`
  makes one (the caller's limits; one request at a time per content, under a short lock), its
  media sent as an upload (or an image as a socket's frame) by the one request that claims it
  in the session's hash, and read by the worker before the question is asked. A caller at
  MAX_SESSIONS_PER_KEY has its least recently used idle session of this route ended to make
  room (`_end_idle`): a chat user is never locked out by conversations it has left.

The question: what the user asked after the last answer, after the earlier turns the session
has not answered itself (matched by their answers' text), as a transcript: turns it answered are
in its cache already, and not asked again.
"""

import asyncio
import hashlib
import time
import uuid
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import TypeAdapter, ValidationError

from app import chat_ingest, chat_media
from app.chat_ingest import MEDIA_FIELD
from app.chat_messages import MAX_MESSAGES, Dialogue, Turn
from app.chat_media import Media, MediaRoom
from app.deps import ChatMediaSlots, KeysDep, Metrics, RedisDep, Settings, Store, address_of, session_owner
from app.errors import ApiError
from app.routes import create_session
from streamvqa.protocol import AnswerEnvelope, QuestionText, SessionOptions, SessionRecord, SessionState, scripts

MADE_FIELD = "chat_made"  # set in a session's hash when this route made it: its owner's address may name it
USED_FIELD = "chat_used_at"  # in a session's hash: when a request of this route last began to use it (unix s)
# A session this route made is ended to make room for a new one (at MAX_SESSIONS_PER_KEY) only once
# it has been idle this long: no request began to use it, and no answer of it ended, since.
CHAT_IDLE_S = 2.0
MAKE_ROOM_TRIES = 3  # sessions ended, at most, for one new session (requests at the same moment take the room too)
MAKING_TTL_S = 10  # the most one request holds the right to make the session for some content
MAKING_POLL_S = 0.05
TRANSCRIPT_HEAD = "Earlier in this conversation:"
_QUESTION = TypeAdapter(QuestionText)
IDLE_STATES = (SessionState.READY.encode(), SessionState.INGESTED.encode())  # no media being read
_bearer = HTTPBearer(
    auto_error=False, description="The session's token; or, with API_KEYS, an API key (it owns the sessions it makes)."
)


class ChatSessions:
    def __init__(
        self, request: Request, store: Store, redis: RedisDep, keys: KeysDep, settings: Settings, metrics: Metrics,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
        slots: ChatMediaSlots,
    ) -> None:
        self.request, self.store, self.redis, self.keys, self.settings, self.metrics = request, store, redis, keys, settings, metrics
        # this request's hold on a slot while it has media in memory: its body's (taken by the
        # route before reading it, when it may carry a data URL) or a fetch's, until the media is sent
        self.room = MediaRoom(slots)
        self.bearer = credentials.credentials if credentials else None
        # who owns what this request makes: with API_KEYS its valid key (None without), else its address
        self.caller = session_owner(settings, request.headers.get("x-api-key"), self.bearer, address_of(request))

    async def session_for(self, session_id: str | None, dialogue: Dialogue, model: str | None) -> SessionRecord:
        """The session to ask (see the module's text), of `model` (None: the session's own, or the
        gateway's default); ApiError when there is none to ask."""
        media = await self._media(dialogue)
        if session_id is not None:
            session = await self._named(session_id)
            if model is not None and model != session.model:
                raise ApiError(400, "model_mismatch", f"the session's model is {session.model!r}, not {model!r}", param="model")
            _check_opening(session, dialogue.opening)
            if media is not None:
                await self._add_media(session, media)
            return session
        if media is None:
            raise ApiError(
                400, "invalid_request", "no session to ask: send the video or image in the messages (a `video_url` or "
                "`image_url` part), or name a session with `session_id`", param="session_id",
            )
        return await self._for_content(media, dialogue.opening, model or self.settings.model)

    async def question(self, session: SessionRecord, dialogue: Dialogue) -> str:
        """The question to ask: the user's, after the earlier turns the session has not answered."""
        unseen = await self._unseen(session, dialogue.turns)
        text = dialogue.question
        if unseen:
            lines = [TRANSCRIPT_HEAD, *(f"User: {turn.question}\nAssistant: {turn.answer}" for turn in unseen)]
            text = "\n".join(lines) + "\n\n" + dialogue.question
        try:
            return _QUESTION.validate_python(text)
        except ValidationError as err:
            reason = err.errors()[0]["msg"].removeprefix("Value error, ")
            what = f"the question, with the {len(unseen)} earlier turns the session has not answered before it" if unseen else (
                "the question (the user's text after the last assistant message)"
            )
            raise ApiError(400, "invalid_request", f"{what}: {reason}", param="messages") from err

    # -- finding the session ---------------------------------------------------------------------

    async def _named(self, session_id: str) -> SessionRecord:
        record, valid = await self.store.authenticate(session_id, self.bearer)
        if record is None:
            raise ApiError(404, "session_not_found", f"no session {session_id}")
        if not valid and not await self._owns(session_id):
            raise ApiError(
                401, "invalid_api_key", "the API key must be the session's token (OpenAI(api_key=token)), or with "
                "API_KEYS the key that owns the session",
            )
        await self._use(session_id)
        return record

    async def _use(self, session_id: str) -> None:
        """Restart the session's idle clock, and say when this route last began to use it: only
        while it lives. A session deleted since it was read (for media the worker refused) does
        not come back as a hash of this one field, without a TTL, where this request would then
        claim its media."""
        keys = self.keys.session_data(session_id)
        await self.redis.eval(
            scripts.UPDATE_RECORD_LUA, len(keys), *keys, self.settings.session_ttl_s, "", "", USED_FIELD, repr(time.time())
        )

    async def _owns(self, session_id: str) -> bool:
        """Whether the caller owns the session: its API key (with API_KEYS), or without them its
        address, for a session this route made (no token was ever handed out for it)."""
        owner, made = await self.redis.hmget(self.keys.session(session_id), "owner", MADE_FIELD)
        if owner is None or self.caller is None or owner.decode() != self.caller:
            return False
        return bool(self.settings.api_key_list) or made is not None

    async def _for_content(self, media: Media, opening: str | None, model: str) -> SessionRecord:
        if (caller := self.caller) is None:
            raise ApiError(
                401, "invalid_api_key", "with API keys set, a video or image without a session_id needs an API key as "
                "the bearer key (OpenAI(api_key=key))",
            )
        content = hashlib.sha256(f"{model}\0{opening or ''}\0{media.sha256}".encode()).hexdigest()
        session = await self._found(caller, content) or await self._made(caller, content, model, opening)
        await self._add_media(session, media)
        return session

    async def _found(self, caller: str, content: str) -> SessionRecord | None:
        """The caller's session for this content, while it lives and has not failed."""
        index = self.keys.chat_media(caller, content)
        found = await self.redis.get(index)
        if found is None:
            return None
        record, owned = await self.store.authenticate(found.decode(), None, owner=caller)
        if record is None or not owned or record.state == SessionState.ERROR:
            return None
        await self._use(record.id)
        await self.redis.expire(index, self.settings.session_ttl_s)
        return record

    async def _made(self, caller: str, content: str, model: str, opening: str | None) -> SessionRecord:
        """A new session for this content, indexed by it for SESSION_TTL_S. One request at a time
        makes it (a lock of MAKING_TTL_S): another with the same content at the same moment waits
        for the lock, then finds the session made."""
        making, mark = self.keys.chat_media_making(caller, content), uuid.uuid4().hex
        deadline = time.monotonic() + 2 * MAKING_TTL_S
        while not await self.redis.set(making, mark, nx=True, ex=MAKING_TTL_S):
            if time.monotonic() > deadline:
                raise ApiError(503, "session_busy", "another request is making the session for this media; try again",
                               {"Retry-After": "1"})
            await asyncio.sleep(MAKING_POLL_S)
        try:
            session = await self._found(caller, content)  # made while this request waited
            if session is None:
                session = await self._create(caller, _options(model, opening))
                await self.redis.hset(self.keys.session(session.id), mapping={MADE_FIELD: "1", USED_FIELD: repr(time.time())})
                await self.redis.set(self.keys.chat_media(caller, content), session.id, ex=self.settings.session_ttl_s)
            return session
        finally:
            await self.redis.eval(scripts.RELEASE_LUA, 1, making, mark)

    async def _create(self, caller: str, options: SessionOptions) -> SessionRecord:
        """A session made as `POST /sessions` makes one; at the caller's limit, after ending its
        least recently used idle session of this route (`_end_idle`), when it has one."""
        ended = 0
        while True:
            try:
                return (await create_session(self.store, self.settings, caller, self.metrics, options)).session
            except ApiError as err:
                if err.code != "too_many_sessions" or ended == MAKE_ROOM_TRIES or not await self._end_idle(caller):
                    raise
                ended += 1

    async def _end_idle(self, caller: str) -> bool:
        """End the caller's least recently used session of this route that is idle: its media in
        the cache (or none coming), no question waiting or being answered, and nothing begun or
        answered for CHAT_IDLE_S (waiting for the least recent one until then, once). False when
        every one is busy, or the caller has none."""
        for look in range(2):
            idle = await self._idle_since(caller)
            if not idle:
                return False
            since, session_id = min(idle)
            wait_s = since + CHAT_IDLE_S - time.time()
            if wait_s <= 0:
                record, _ = await self.store.authenticate(session_id, None)
                if record is not None:
                    await self.store.delete(record)
                return True
            if look == 0:
                await asyncio.sleep(min(wait_s, CHAT_IDLE_S))
        return False

    async def _idle_since(self, caller: str) -> list[tuple[float, str]]:
        """(when it was last used, id) of each of the caller's sessions of this route with its
        media in (or none coming) and no question waiting or being answered: used when a
        request began to use it or its latest answer ended, whichever came last."""
        ids = [member.decode() for member in await self.redis.smembers(self.keys.owner(caller))]
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self.keys.session(session_id), MADE_FIELD, USED_FIELD, "state")
                pipe.xlen(self.keys.questions(session_id))
                pipe.zrange(self.keys.asked(session_id), -1, -1)
            found = await pipe.execute()
        quiet = [
            (session_id, float(used or 0), latest[0].decode() if latest else None)
            for session_id, (made, used, state), waiting, latest in zip(ids, found[::3], found[1::3], found[2::3], strict=True)
            if made is not None and state in IDLE_STATES and waiting == 0
        ]
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, _, answer_id in quiet:
                if answer_id is not None:
                    pipe.xrevrange(self.keys.answer(session_id, answer_id), count=1)
            ends = iter(await pipe.execute())
        idle = []
        for session_id, used, answer_id in quiet:
            end = next(ends) if answer_id is not None else []
            answered = int(end[0][0].split(b"-")[0]) / 1000 if end else 0.0  # an entry's id begins with its time in ms
            idle.append((max(used, answered), session_id))
        return idle

    # -- its media --------------------------------------------------------------------------------

    async def _media(self, dialogue: Dialogue) -> Media | None:
        """The dialogue's media, loaded; a session holds one video or image (sent again each turn,
        as chat clients do, it is the same): 400 for two different ones."""
        loaded: Media | None = None
        for ref in dialogue.media:
            media = await chat_media.load(ref, self.settings, self.room)
            if loaded is not None and media.sha256 != loaded.sha256:
                raise ApiError(
                    400, "too_many_media", "a session holds one video or image, and these messages carry two different "
                    "ones: start a new conversation for the other", param=ref.param,
                )
            loaded = loaded or media
        return loaded

    async def _add_media(self, session: SessionRecord, media: Media) -> None:
        """Send the media into the session, unless this route sent it there already or another
        request sends it now (the first to claim it in the session's hash sends it); then wait
        until it is read. A session with other media is 409 `media_exists`; media the worker
        refuses is 400 `invalid_media`, for every request that waits for it and for the same
        media sent again (a session made for it is deleted: sent again, it goes to a new one)."""
        session_key = self.keys.session(session.id)
        try:
            claim = await self.redis.eval(scripts.CLAIM_FIELD_LUA, 1, session_key, MEDIA_FIELD, media.sha256)
            if claim == 1:
                try:
                    if session.media is not None:
                        raise ApiError(409, "media_exists", "this session has its media already: name no session to "
                                       "send a new video or image", param=media.param)
                    self.metrics.upload_bytes.inc(await chat_ingest.ingest(self.store, session, media, self.settings))
                except BaseException:
                    await self.redis.hdel(session_key, MEDIA_FIELD)  # not sent: the next request may send it
                    raise
            elif claim is not None and claim.decode() != media.sha256:
                raise ApiError(409, "media_exists", "this session has another video or image: name no session to send "
                               "a new one", param=media.param)
        finally:  # sent on, here or by another request: its bytes leave this gateway's memory
            media.chunks.clear()
            self.room.leave()
        await self._until_ingested(session, media)  # a session gone (no claim): its kept refusal's 400, else a 404

    async def _until_ingested(self, session: SessionRecord, media: Media) -> None:
        async def left() -> None:
            if await self.request.is_disconnected():
                raise ApiError(499, "client_closed_request", "the client left while its media was read")

        error = await chat_ingest.wait_until_ingested(
            self.redis, self.keys, session.id, media, self.settings.ask_timeout_s, left
        )
        if error is not None:
            if await self.redis.hget(self.keys.session(session.id), MADE_FIELD) is not None:
                await chat_ingest.forget_refused(self.store, session, error)
            raise ApiError(400, "invalid_media", f"the {media.kind} cannot be read: {error}", param=media.param)

    # -- its conversation -------------------------------------------------------------------------

    async def _unseen(self, session: SessionRecord, turns: tuple[Turn, ...]) -> tuple[Turn, ...]:
        """The turns after the last one whose answer the session gave (of its latest answers)."""
        if not turns:
            return ()
        asked = await self.redis.zrange(self.keys.asked(session.id), -(MAX_MESSAGES // 2), -1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for answer_id in asked:
                pipe.xrevrange(self.keys.answer(session.id, answer_id.decode()), count=1)
            finals = await pipe.execute()
        given = set()
        for entries in finals:
            if entries:
                event = AnswerEnvelope.model_validate_json(entries[0][1][b"m"]).event
                if event.type == "done" and event.answer.strip():
                    given.add(event.answer.strip())
        answered = [index for index, turn in enumerate(turns) if turn.answer.strip() in given]
        return turns[answered[-1] + 1 :] if answered else turns


def _check_opening(session: SessionRecord, opening: str | None) -> None:
    """A system message to a session must be its own opening (or be left out): it cannot change."""
    if opening is None or opening == session.system_prompt:
        return
    own = f"its system prompt {session.system_prompt[:60]!r}..." if session.system_prompt else "the model's default"
    raise ApiError(
        400, "system_prompt_mismatch", f"the session's opening, set when it was made, is {own}: a system message to it "
        "must be the same, or be left out (a session made for media in the messages takes the system message as its "
        "opening)", param="messages",
    )


def _options(model: str, opening: str | None) -> SessionOptions:
    try:
        return SessionOptions(model=model, system_prompt=opening)
    except ValidationError as err:
        reason = err.errors()[0]["msg"]
        raise ApiError(400, "invalid_request", f"the system message, the new session's opening: {reason}", param="messages") from err

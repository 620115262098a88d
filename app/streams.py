"""Live video over a WebSocket: `WS /sessions/{id}/stream`.

The client authenticates (bearer header or `token` query parameter), sends a `start` message
naming its format, then binary messages: container bytes cut anywhere (`webm`, `mp4`) or one
timed image each (`frames`). The gateway moves them into the session's media stream, tells the
client when the worker falls behind (`backpressure`), relays the session's events (ingest
progress, warnings, errors, state changes), answers questions asked on the socket (`ask`), and
closes with a code from `CloseCode` when something is wrong. One socket streams into a session
at a time; a client that reconnects continues the same stream. A `start` without a format opens
a socket that only watches and asks. docs/streaming.md is the protocol, with an example.

One module, over 400 lines, on purpose: a socket's reading, forwarding, relaying and asking run
as tasks of one connection and share its state (its claim, its inbox, its close); the Redis
work they need is in app/backlog.py, app/media_stream.py, app/tail.py and protocol/scripts.py.
"""

import asyncio
import contextlib
import json
import logging
import uuid

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis

from app import answer_stream, backlog, media_stream
from app.answer_stream import Failed, Finished, TimedOut, Token
from app.deps import SESSION_ID, KeysDep, Limiter, LimitedCaller, Metrics, RedisDep, Settings, Store, origin_allowed
from app.errors import ApiError
from app.limits import MessageRate
from app.metrics import GatewayMetrics
from app.sessions import SessionStore
from app.settings import GatewaySettings
from app.tail import tail
from streamvqa import protocol
from streamvqa.redis_client import FAILURES
from streamvqa.protocol import (
    AnswerDoneEvent,
    AnswerErrorEvent,
    AnswerStartedEvent,
    AnswerTokenEvent,
    AskMessage,
    BackpressureEvent,
    CloseCode,
    EventEnvelope,
    Keys,
    MediaEntry,
    MediaErrorEvent,
    MediaKind,
    SessionRecord,
    StartedEvent,
    StartMessage,
    WarningEvent,
    parse_frame_header,
    scripts,
)

log = logging.getLogger(__name__)
router = APIRouter()

MAX_ASKING = 4  # questions a socket may have unanswered at once
START_TIMEOUT_S = 10  # a socket that sends no `start` within this is closed
INBOX_BYTES = 8 * 1024 * 1024  # bytes read ahead of Redis per socket; the socket is not read while over
PAUSED_MESSAGES = 32  # messages a client may still send after `backpressure`; one more closes it (4429)
CLAIM_WAIT_S = 2.0  # how long a connecting socket waits for the previous one's claim to be released (or lapse)
ROOM_POLL_S = 0.05  # between looks at a full media backlog (the client is paused meanwhile)
CLEANUP_WAIT_S = 2.0  # how long a closing socket waits for its tasks to end

_END = object()  # the client's `end` message, in the inbox
_LEFT = object()  # the client closed the socket: what it sent before is forwarded, then the socket ends


class StreamClosed(Exception):
    """Close the socket with `code`; `reason` is sent with it (at most 123 bytes)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


@router.websocket("/sessions/{session_id}/stream")
async def stream(
    websocket: WebSocket, session_id: str, redis: RedisDep, keys: KeysDep, store: Store, settings: Settings,
    metrics: Metrics, limiter: Limiter, caller: LimitedCaller, token: str | None = None,
) -> None:
    """Stream live video into a session; events come back on the same socket."""
    await websocket.accept()
    state = websocket.app.state
    connection = StreamConnection(websocket, redis, keys, store, settings, metrics, session_id)
    if not origin_allowed(websocket, settings):  # another site's page, which could use a token it found
        origin = websocket.headers["origin"][:60]
        await connection.close(CloseCode.FORBIDDEN_ORIGIN, f"a page of {origin} may not open sockets here (CORS_ORIGINS)")
        return
    if state.stream_sockets >= settings.max_stream_sockets:
        await connection.close(CloseCode.TRY_AGAIN_LATER, "this gateway streams as many sockets as it may")
        return
    state.stream_sockets += 1
    metrics.stream_sockets.inc()
    try:
        await limiter.check(caller)
        await connection.run(token)
    except ApiError as err:  # over the rate limit
        metrics.rate_limited.inc()
        await connection.close(CloseCode.TOO_MANY, err.message)
    except StreamClosed as closed:
        await connection.close(closed.code, closed.reason)
    except WebSocketDisconnect:
        pass
    except FAILURES as err:
        log.warning("stream socket of session %s: Redis failed (%s)", session_id, err)
        await connection.close(CloseCode.TRY_AGAIN_LATER, "Redis is unreachable; connect again in a few seconds")
    except Exception:
        log.exception("stream socket of session %s failed", session_id)
        await connection.close(1011, "the gateway failed; the error is in its log")
    finally:
        state.stream_sockets -= 1
        metrics.stream_sockets.dec()


class StreamConnection:
    def __init__(
        self,
        websocket: WebSocket,
        redis: Redis,
        keys: Keys,
        store: SessionStore,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        session_id: str,
    ) -> None:
        self.websocket = websocket
        self.redis = redis
        self.keys = keys
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.session_id = session_id
        self.id = uuid.uuid4().hex[:16]
        self.format: str | None = None  # None: the socket only watches and asks
        self.record: SessionRecord | None = None  # the session, as it was when the socket connected
        self._stream_bytes = 0  # the session's stream bytes in Redis, as far as this socket knows
        self._rate = MessageRate(settings.ws_messages_per_s)
        self._asking: set[asyncio.Task] = set()  # at most MAX_ASKING
        # Set when the socket ends: its loops stop at their next step. Cancelling them is not
        # enough, since redis-py can swallow a cancellation that lands inside a command.
        self._stopping = False
        self._inbox: asyncio.Queue = asyncio.Queue()  # bounded by INBOX_BYTES, counted in _inbox_bytes
        self._inbox_bytes = 0
        self._inbox_drained = asyncio.Event()
        self._paused = False  # a `backpressure` event told the client to stop
        self._media_received = 0  # media messages (and `end`) taken from the client, in order
        self._media_forwarded = 0  # of them, those the forwarder is done with
        self._media_moved = asyncio.Event()  # set when it is done with one
        self._last_media: str | None = None  # the id of the last media entry this socket added
        self._sent_while_paused = 0
        self._ended = False
        self._send_lock = asyncio.Lock()
        self._claim = redis.register_script(scripts.CLAIM_MEDIA_LUA)
        self._renew = redis.register_script(scripts.RENEW_MEDIA_CLAIM_LUA)
        self._release = redis.register_script(scripts.RELEASE_LUA)
        self._open_socket = redis.register_script(scripts.OPEN_SOCKET_LUA)

    async def run(self, token: str | None) -> None:
        self.record = record = await self._authenticate(token)
        start = await self._start()
        self.format = start.format
        sockets = self.keys.sockets(self.session_id)
        if not await self._count_socket():
            raise StreamClosed(
                CloseCode.TOO_MANY, f"this session has {self.settings.max_sockets_per_session} sockets open already"
            )
        try:
            claimed, last_frame_s = await self._claim_media(record, start.resume) if self.format else (0, None)
            self._stream_bytes = claimed
            try:
                since = await self._last_event_id()
                if self.format:
                    await self._add(MediaEntry(MediaKind.CONNECT, format=self.format, connection=self.id))
                await self.send(
                    StartedEvent(
                        format=self.format,
                        connection=self.id,
                        bytes_received=claimed,
                        last_frame_s=last_frame_s,
                        frames=record.frames_ingested,
                        video_time_s=record.video_time_s,
                    )
                )
                await self._serve(since)
            finally:
                for task in self._asking:
                    task.cancel()
                if self.format:
                    await self._add(MediaEntry(MediaKind.DISCONNECT, connection=self.id), closing=True)
                    await self._release(keys=[self.keys.streamer(self.session_id)], args=[self.id])
        finally:
            await self.redis.zrem(sockets, self.id)

    async def _count_socket(self) -> bool:
        ttl_ms = protocol.STREAMER_TTL_S * 1000
        limit = self.settings.max_sockets_per_session
        return bool(await self._open_socket(keys=[self.keys.sockets(self.session_id)], args=[self.id, ttl_ms, limit]))

    async def send(self, event: BaseModel) -> None:
        async with self._send_lock:
            await self.websocket.send_text(event.model_dump_json())

    async def close(self, code: int, reason: str) -> None:
        try:
            async with self._send_lock:
                await self.websocket.close(code, reason.encode()[:123].decode(errors="ignore"))
        except (RuntimeError, WebSocketDisconnect, OSError):
            pass  # already closed

    # -- set-up --------------------------------------------------------------------------------

    async def _authenticate(self, token: str | None) -> SessionRecord:
        header = self.websocket.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            token = header[7:].strip()
        if not SESSION_ID.fullmatch(self.session_id):
            raise StreamClosed(CloseCode.NOT_FOUND, f"no session {self.session_id}")
        record, valid = await self.store.authenticate(self.session_id, token)
        if record is None:
            raise StreamClosed(CloseCode.NOT_FOUND, f"no session {self.session_id}")
        if not valid:
            raise StreamClosed(CloseCode.UNAUTHORIZED, "send this session's token as a bearer header or ?token=")
        return record

    async def _start(self) -> StartMessage:
        try:
            message = await asyncio.wait_for(self.websocket.receive(), START_TIMEOUT_S)
        except TimeoutError as err:
            raise StreamClosed(CloseCode.BAD_REQUEST, f"no start message within {START_TIMEOUT_S} s") from err
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        try:
            return StartMessage.model_validate_json(message.get("text") or "")
        except ValidationError as err:
            raise StreamClosed(
                CloseCode.BAD_REQUEST, 'first send {"type": "start", "format": "webm" | "mp4" | "frames" | null}'
            ) from err

    async def _claim_media(self, record: SessionRecord, resume: str | None) -> tuple[int, float | None]:
        """Claim the session's media for this socket (taking it over from `resume`, the client's
        previous connection, if that still holds it); the stream bytes and the last frame's time
        received before it."""
        deadline = asyncio.get_running_loop().time() + CLAIM_WAIT_S
        while True:
            claimed = await self._claim(
                keys=[self.keys.session(self.session_id), self.keys.streamer(self.session_id)],
                args=[self.format, self.id, protocol.STREAMER_TTL_S * 1000, resume or ""],
            )
            if claimed != -3 or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)  # a reconnecting client's old socket may still be closing
        if claimed == -1:
            raise StreamClosed(CloseCode.NOT_FOUND, "the session is gone")
        if claimed == -2:
            raise StreamClosed(CloseCode.CONFLICT, f"the session already has {record.media} media")
        if claimed == -3:
            raise StreamClosed(CloseCode.CONFLICT, "another socket is streaming into this session")
        if claimed == -4:
            raise StreamClosed(CloseCode.CONFLICT, f"the session failed: {record.error}")
        stream_bytes, last_frame_s = claimed
        return int(stream_bytes), float(last_frame_s) if last_frame_s else None

    async def _last_event_id(self) -> str:
        last = await self.redis.xrevrange(self.keys.events(self.session_id), count=1)
        return last[0][0].decode() if last else "0-0"

    # -- serving -------------------------------------------------------------------------------

    async def _serve(self, since: str) -> None:
        """Run the socket's tasks until the client has left and what it sent is forwarded, or
        until one of them finds a reason to close."""
        receive = asyncio.create_task(self._receive())
        main = asyncio.create_task(self._forward()) if self.format else receive  # what ends the socket
        tasks = {receive, main, asyncio.create_task(self._relay(since)), asyncio.create_task(self._keep_claim())}
        try:
            while main in tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raises StreamClosed or the failure
        finally:
            self._stopping = True
            self._inbox.put_nowait(_LEFT)  # a forwarder that outlived its cancellation ends here
            self._inbox_drained.set()
            for task in tasks:
                task.cancel()
            if tasks:
                _, late = await asyncio.wait(tasks, timeout=CLEANUP_WAIT_S)
                for task in late:
                    log.warning("socket %s: %s did not stop within %s s", self.id, task.get_coro().__name__, CLEANUP_WAIT_S)

    async def _receive(self) -> None:
        """Socket to inbox. Text messages are control messages: `{"type": "end"}` ends the stream,
        `{"type": "ask", ...}` asks a question."""
        while not self._stopping:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                await self._inbox.put(_LEFT)
                return
            if not self._rate.take():
                self.metrics.rate_limited.inc()
                raise StreamClosed(CloseCode.TOO_MANY, f"more than {self.settings.ws_messages_per_s:g} messages per second")
            data = message.get("bytes")
            if data is not None:
                if not self.format:
                    raise StreamClosed(CloseCode.BAD_REQUEST, "this socket's start named no format: it sends no media")
                if self._ended:
                    raise StreamClosed(CloseCode.BAD_REQUEST, "media after the end of the stream")
                if self._paused:
                    self._sent_while_paused += 1
                    if self._sent_while_paused > PAUSED_MESSAGES:
                        raise StreamClosed(CloseCode.TOO_MANY, "the client kept sending while paused")
                while self._inbox_bytes > INBOX_BYTES and not self._stopping:  # not reading: TCP slows the client
                    self._inbox_drained.clear()
                    await self._inbox_drained.wait()
                self._inbox_bytes += len(data)
                self.metrics.stream_bytes.inc(len(data))
                await self._inbox.put(data)
                self._media_received += 1
            else:
                await self._control(message.get("text") or "")

    async def _control(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            message = None
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "end" and message == {"type": "end"} and self.format:
            self._ended = True
            await self._inbox.put(_END)
            self._media_received += 1
        elif kind == "ask":
            try:
                question = AskMessage.model_validate(message)
            except ValidationError as err:
                detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
                await self.send(AnswerErrorEvent(ref=_ref(message), code="invalid_request", message=detail))
                return
            if len(self._asking) >= MAX_ASKING:
                busy = f"this socket has {MAX_ASKING} questions unanswered; wait for one"
                await self.send(AnswerErrorEvent(ref=question.ref, code="too_many_questions", message=busy))
                return
            task = asyncio.create_task(self._answer(question, self._media_received))
            self._asking.add(task)
            task.add_done_callback(self._asking.discard)
        else:
            usage = '{"type": "ask", "question": "..."}' + (' or {"type": "end"}' if self.format else "")
            await self.send(MediaErrorEvent(code="bad_message", message=f"text messages: {usage}"))

    async def _answer(self, question: AskMessage, media_before: int) -> None:
        """Ask, once the `media_before` media messages the client sent before the question are in
        the media stream (the worker starts it once they are in the cache), then send the answer's
        events as they come. A socket that closes before the final event cancels the answer."""
        ref, answer_id = question.ref, None
        try:
            after_media = await self._media_sent(media_before)
            stream = await answer_stream.ask(
                self.redis, self.keys, self.record, question.question, question, self.settings.session_ttl_s, self.metrics,
                "socket", self.settings.ask_timeout_s, after_media=after_media,
            )
            answer_id = stream.answer_id
            async with stream:  # a socket that closes (or fails) before the final event cancels the answer
                await self.send(AnswerStartedEvent(answer_id=answer_id, ref=ref))
                async for item in stream:
                    match item:
                        case Token(text, _):
                            await self.send(AnswerTokenEvent(answer_id=answer_id, ref=ref, text=text))
                        case Finished(answer, _, _):
                            await self.send(AnswerDoneEvent.of(answer, ref))
                        case Failed(code, message, _):
                            await self.send(AnswerErrorEvent(answer_id=answer_id, ref=ref, code=code, message=message))
                        case TimedOut(timeout_s):
                            message = f"no answer within {timeout_s} s"
                            await self.send(AnswerErrorEvent(answer_id=answer_id, ref=ref, code="answer_timeout", message=message))
        except ApiError as err:
            await self.send(AnswerErrorEvent(answer_id=answer_id, ref=ref, code=err.code, message=err.message))
        except (WebSocketDisconnect, RuntimeError) as err:
            log.info("socket %s: answer %s not delivered (%s)", self.id, answer_id, err)
        except Exception as err:
            if isinstance(err, FAILURES):
                log.warning("socket %s: answer %s: Redis failed (%s)", self.id, answer_id, err)
                code, message = "redis_unreachable", "Redis is unreachable; ask again in a few seconds"
            else:
                log.exception("socket %s: answering %s failed", self.id, answer_id)
                code, message = "internal_error", "the gateway failed; the error is in its log"
            with contextlib.suppress(Exception):  # the socket may be gone too
                await self.send(AnswerErrorEvent(answer_id=answer_id, ref=ref, code=code, message=message))

    async def _media_sent(self, count: int) -> str | None:
        """Wait until the first `count` media messages taken from the client are in the session's
        media stream; the id of the last entry the socket added (None: none yet)."""
        while self._media_forwarded < count and not self._stopping:
            self._media_moved.clear()
            await self._media_moved.wait()
        return self._last_media

    async def _forward(self) -> None:
        """Inbox to the media stream, waiting while the worker's backlog is full; returns once
        the client has left and everything it sent is in the stream."""
        while True:
            item = await self._inbox.get()
            if item is _LEFT or self._stopping:
                return
            if item is _END:
                await self._add(MediaEntry(MediaKind.END))
            else:
                await self._forward_media(item)
                self._inbox_bytes -= len(item)
                self._inbox_drained.set()
            self._media_forwarded += 1
            self._media_moved.set()

    async def _forward_media(self, message: bytes) -> None:
        if self.format == "frames":
            try:
                time_s = parse_frame_header(message)
            except ValueError as err:
                await self.send(MediaErrorEvent(code="bad_frame", message=str(err), connection=self.id))
                return
            await self._wait_for_room()
            if not await self._add(MediaEntry(MediaKind.FRAME, data=message), len(message), frame_s=time_s):
                message = f"frame at {time_s:.3f} s skipped: not after the previous frame the session received"
                await self.send(WarningEvent(code="frame_skipped", message=message))
            return
        for start in range(0, len(message), protocol.MEDIA_CHUNK_BYTES):
            chunk = message[start : start + protocol.MEDIA_CHUNK_BYTES]
            await self._wait_for_room()
            await self._add(MediaEntry(MediaKind.DATA, data=chunk), len(chunk))

    async def _wait_for_room(self) -> None:
        """Return when the media backlog has room; tell the client while it has none (from full
        until half full)."""
        waiting = await backlog.entries(self.redis, self.keys, self.session_id)
        if waiting < backlog.FULL:
            return
        self._paused, self._sent_while_paused = True, 0
        await self.send(BackpressureEvent(paused=True, backlog=waiting))
        try:
            waiting = await backlog.wait_for_room(
                self.redis, self.keys, self.session_id, self.settings.upload_stall_s, below=backlog.FULL // 2,
                poll_s=(ROOM_POLL_S, ROOM_POLL_S), stopping=lambda: self._stopping,
            )
        except backlog.SessionGone as err:
            raise StreamClosed(CloseCode.NOT_FOUND, "the session is gone") from err
        except backlog.SessionFailed as err:
            raise StreamClosed(CloseCode.UNDECODABLE, "the session failed") from err
        except backlog.WorkerStalled as err:
            raise StreamClosed(CloseCode.TRY_AGAIN_LATER, "the session's worker stopped reading the stream") from err
        self._paused = False
        await self.send(BackpressureEvent(paused=False, backlog=waiting))

    async def _add(
        self, entry: MediaEntry, stream_bytes: int = 0, closing: bool = False, frame_s: float | None = None
    ) -> bool:
        """Add a media entry, unless the session is gone or failed or another socket took the
        stream over (then close, unless `closing`); False for a frame not after the last one."""
        offset = self._stream_bytes if entry.kind == MediaKind.DATA else None
        added = await media_stream.add(self.redis, self.keys, self.record, self.id, entry, stream_bytes, frame_s, offset)
        if isinstance(added, str):  # added: its entry's id
            self._last_media, added = added, 1
        if added == 1:
            self._stream_bytes += stream_bytes
        if added >= 0 or closing:
            return added == 1
        if added == media_stream.GONE:
            raise StreamClosed(CloseCode.NOT_FOUND, "the session is gone")
        if added == media_stream.NOT_CLAIMED:
            raise StreamClosed(CloseCode.CONFLICT, "another socket took this session's stream over")
        if added == media_stream.BYTES_LOST:
            raise StreamClosed(CloseCode.TRY_AGAIN_LATER, "Redis lost bytes of the stream; connect again and send on from bytes_received")
        raise StreamClosed(CloseCode.UNDECODABLE, "the session failed")

    async def _relay(self, since: str) -> None:
        """The session's events to the socket; an error about this connection closes it. A
        streaming socket skips the state changes of other connections' streams."""
        async for item in tail(self.redis, self.keys.events(self.session_id), since, EventEnvelope, 64, 0):
            if self._stopping:
                return
            if item is None:
                continue
            event = item[1]
            if self.format and event.type == "state" and event.connection not in (None, self.id):
                continue  # an earlier connection's stream settled (this one has taken it over)
            await self.send(event)
            if event.type == "error" and _closes(event, self.id):
                raise StreamClosed(CloseCode.UNDECODABLE, event.message)

    async def _keep_claim(self) -> None:
        """Renew the socket's place among the session's sockets and, streaming, its media claim."""
        streamer = self.keys.streamer(self.session_id)
        while not self._stopping:
            await asyncio.sleep(protocol.STREAMER_TTL_S / 3)
            if self.format and not await self._renew(keys=[streamer], args=[self.id, protocol.STREAMER_TTL_S * 1000]):
                raise StreamClosed(CloseCode.CONFLICT, "the session's stream was taken over or the session is gone")
            if not await self.redis.exists(self.keys.session(self.session_id)):
                raise StreamClosed(CloseCode.NOT_FOUND, "the session is gone")
            await self._count_socket()
            await self.store.touch(self.session_id)


def _closes(error: MediaErrorEvent, connection: str) -> bool:
    """Whether an error ends this connection: its stream cannot be decoded, or the session failed."""
    if error.code == "session_error":
        return True
    return error.code in ("decode_failed", "empty_stream") and error.connection == connection


def _ref(message: dict) -> str | None:
    ref = message.get("ref")
    return ref[:200] if isinstance(ref, str) else None

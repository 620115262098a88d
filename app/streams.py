"""Live video over a WebSocket: `WS /sessions/{id}/stream`.

The client authenticates (bearer header or `token` query parameter), sends a `start` message
naming its format, then binary messages: container bytes cut anywhere (`webm`, `mp4`) or one
timed image each (`frames`). The gateway moves them into the session's media stream, telling the
client when the worker falls behind (`backpressure`; app/media_forwarder.py), relays the session's
events (ingest progress, warnings, errors, state changes), answers questions asked on the socket
(`ask`), and closes with a code from `CloseCode` when something is wrong. One socket streams into
a session at a time; a client that reconnects continues the same stream. A `start` without a
format opens a socket that only watches and asks. docs/streaming.md is the protocol, with an example.
"""

import asyncio
import contextlib
import json
import logging
import uuid

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ValidationError

from app import answer_stream
from app.answer_stream import Failed, Finished, TimedOut, Token
from app.deps import Limiter, LimitedCaller, Metrics, Settings, Store, origin_allowed
from app.errors import ApiError
from app.limits import MessageRate
from app.media_forwarder import MediaForwarder, StreamClosed
from app.metrics import GatewayMetrics
from app.sessions import SessionStore
from app.settings import GatewaySettings
from app.tail import last_id, tail
from streamvqa import protocol
from streamvqa.redis_client import FAILURES
from streamvqa.protocol import (
    AnswerDoneEvent, AnswerErrorEvent, AnswerStartedEvent, AnswerTokenEvent, AskMessage, CloseCode, EventEnvelope,
    MediaEntry, MediaErrorEvent, MediaKind, SessionRecord, StartedEvent, StartMessage, scripts,
)

log = logging.getLogger(__name__)
router = APIRouter()

MAX_ASKING = 4  # questions a socket may have unanswered at once
START_TIMEOUT_S = 10  # a socket that sends no `start` within this is closed
CLAIM_WAIT_S = 2.0  # how long a connecting socket waits for the previous one's claim to be released (or lapse)
CLEANUP_WAIT_S = 2.0  # how long a closing socket waits for its tasks to end


@router.websocket("/sessions/{session_id}/stream")
async def stream(
    websocket: WebSocket, session_id: str, store: Store, settings: Settings, metrics: Metrics, limiter: Limiter,
    caller: LimitedCaller, token: str | None = None,
) -> None:
    """Stream live video into a session; events come back on the same socket."""
    await websocket.accept()
    state = websocket.app.state
    connection = StreamConnection(websocket, store, settings, metrics, session_id)
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
        self, websocket: WebSocket, store: SessionStore, settings: GatewaySettings, metrics: GatewayMetrics, session_id: str
    ) -> None:
        self.websocket, self.store, self.settings, self.metrics = websocket, store, settings, metrics
        self.redis, self.keys, self.session_id = store.redis, store.keys, session_id
        self.id = uuid.uuid4().hex[:16]
        self.format: str | None = None  # None: the socket only watches and asks
        self.record: SessionRecord | None = None  # the session, as it was when the socket connected
        self.media: MediaForwarder | None = None  # set by `run` once the socket has started
        self._rate = MessageRate(settings.ws_messages_per_s)
        self._asking: set[asyncio.Task] = set()  # at most MAX_ASKING
        # Set when the socket ends: its loops stop at their next step. Cancelling them is not
        # enough, since redis-py can swallow a cancellation that lands inside a command.
        self._stopping = False
        self._send_lock = asyncio.Lock()
        self._claim = self.redis.register_script(scripts.CLAIM_MEDIA_LUA)
        self._renew = self.redis.register_script(scripts.RENEW_MEDIA_CLAIM_LUA)
        self._release = self.redis.register_script(scripts.RELEASE_LUA)
        self._open_socket = self.redis.register_script(scripts.OPEN_SOCKET_LUA)

    async def run(self, token: str | None) -> None:
        self.record = record = await self._authenticate(token)
        start = await self._start()
        self.format = start.format
        if not await self._count_socket():
            full = f"this session has {self.settings.max_sockets_per_session} sockets open already"
            raise StreamClosed(CloseCode.TOO_MANY, full)
        try:
            claimed, last_frame_s = await self._claim_media(record, start.resume) if self.format else (0, None)
            self.media = media = MediaForwarder(
                self.redis, self.keys, record, self.id, self.format, claimed, self.settings.upload_stall_s
            )
            try:
                since = await last_id(self.redis, self.keys.events(self.session_id))
                if self.format:
                    await media.add(MediaEntry(MediaKind.CONNECT, format=self.format, connection=self.id))
                started = StartedEvent(
                    format=self.format, connection=self.id, bytes_received=claimed, last_frame_s=last_frame_s,
                    frames=record.frames_ingested, video_time_s=record.video_time_s,
                )
                await self.send(started)
                await self._serve(since)
            finally:
                for task in self._asking:
                    task.cancel()
                if self.format:
                    await media.add(MediaEntry(MediaKind.DISCONNECT, connection=self.id), closing=True)
                    await self._release(keys=[self.keys.streamer(self.session_id)], args=[self.id])
        finally:
            await self.redis.zrem(self.keys.sockets(self.session_id), self.id)

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
            usage = 'first send {"type": "start", "format": "webm" | "mp4" | "frames" | null}'
            raise StreamClosed(CloseCode.BAD_REQUEST, usage) from err

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

    # -- serving -------------------------------------------------------------------------------

    async def _serve(self, since: str) -> None:
        """Run the socket's tasks until the client has left and what it sent is forwarded, or
        until one of them finds a reason to close."""
        receive, forward = asyncio.create_task(self._receive()), asyncio.create_task(self._forward())
        main = forward if self.format else receive  # what ends the socket
        tasks = {receive, forward, asyncio.create_task(self._relay(since)), asyncio.create_task(self._keep_claim())}
        try:
            while main in tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raises StreamClosed or the failure
        finally:
            self._stopping = True
            self.media.stop()
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
                self.media.leave()
                return
            if not self._rate.take():
                self.metrics.rate_limited.inc()
                raise StreamClosed(CloseCode.TOO_MANY, f"more than {self.settings.ws_messages_per_s:g} messages per second")
            data = message.get("bytes")
            if data is not None:
                if not self.format:
                    raise StreamClosed(CloseCode.BAD_REQUEST, "this socket's start named no format: it sends no media")
                await self.media.take(data)
                self.metrics.stream_bytes.inc(len(data))
            else:
                await self._control(message.get("text") or "")

    async def _control(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            message = None
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "end" and message == {"type": "end"} and self.format:
            self.media.end()
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
            task = asyncio.create_task(self._answer(question, self.media.after()))
            self._asking.add(task)
            task.add_done_callback(self._asking.discard)
        else:
            usage = '{"type": "ask", "question": "..."}' + (' or {"type": "end"}' if self.format else "")
            await self.send(MediaErrorEvent(code="bad_message", message=f"text messages: {usage}"))

    async def _answer(self, question: AskMessage, media_before: asyncio.Future) -> None:
        """Ask, once the media the client sent before the question is in the media stream
        (`media_before`: its last entry; the worker starts the answer once that is in the cache),
        then send the answer's events as they come. A socket that closes before the final event
        cancels the answer."""
        ref, answer_id = question.ref, None
        try:
            after_media = await media_before
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

    async def _forward(self) -> None:
        async for event in self.media.forward():
            await self.send(event)

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
    return error.code == "session_error" or error.code in ("decode_failed", "empty_stream") and error.connection == connection


def _ref(message: dict) -> str | None:
    ref = message.get("ref")
    return ref[:200] if isinstance(ref, str) else None

"""The asyncio client: the same surface as `streamvqa.client.sync`, every call awaited."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any, Unpack

import httpx
from websockets.asyncio.client import ClientConnection, connect

from streamvqa.client import frames as media
from streamvqa.client import wire
from streamvqa.client.live import AnswerHandler, EventHandler, LiveStream, Pacer
from streamvqa.client.models import Answer, StreamResult, StreamvqaError, Watch, WatchFiredEvent
from streamvqa.client.sse import SessionEvents, SseDecoder, answer_event
from streamvqa.protocol import frame_message

POLL_S = 0.001  # asyncio has no non-blocking receive: a look for events already here waits this long
Frames = Iterable[tuple[float, bytes]] | AsyncIterable[tuple[float, bytes]]


class AsyncClient:
    """A gateway at `base_url`; see `streamvqa.client.Client`."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout_s: float = wire.DEFAULT_TIMEOUT_S
    ) -> None:
        self.base_url, self.timeout_s = wire.gateway_url(base_url), timeout_s
        self.http = httpx.AsyncClient(**wire.http_options(self.base_url, api_key, timeout_s))

    async def create_session(self, **options: Any) -> AsyncSession:
        body = (await self.request("POST", "/sessions", 201, json=wire.session_options(options))).json()
        return AsyncSession(self, body["id"], body["token"])

    def session(self, session_id: str, token: str) -> AsyncSession:
        return AsyncSession(self, session_id, token)

    async def sessions(self) -> list[dict]:
        return (await self.request("GET", "/sessions")).json()["sessions"]

    async def end_session(self, session_id: str) -> None:
        with wire.unless_gone():
            await self.request("DELETE", f"/sessions/{session_id}", 204)

    async def request(self, method: str, path: str, *expected: int, **kwargs: Any) -> httpx.Response:
        with wire.transport_errors(self.base_url):
            response = await self.http.request(method, path, **kwargs)
        return wire.checked(response, *expected)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


class AsyncSession:
    """One session; see `streamvqa.client.Session`. `async with` deletes it on exit."""

    def __init__(self, client: AsyncClient, session_id: str, token: str) -> None:
        self.client, self.id, self.token = client, session_id, token
        self._path = f"/sessions/{session_id}"

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def info(self) -> dict:
        return (await self._call("GET", "")).json()

    async def upload(self, source: wire.UploadSource, progress: wire.UploadProgress | None = None) -> int:
        with wire.upload_source(source) as (file, size):
            headers = wire.upload_headers(self.token, size)
            reply = await self._call("POST", "/upload", 202, content=_chunks(file, size, progress), headers=headers)
            return reply.json()["bytes"]

    async def wait_until_ingested(
        self, progress: wire.RecordProgress | None = None, timeout_s: float | None = None
    ) -> dict:
        waiting = wire.IngestWait(progress, timeout_s)
        while not waiting.over(record := await self.info()):
            await asyncio.sleep(wire.POLL_INTERVAL_S)
        return record

    async def ask(self, question: str, max_new_tokens: int = 64, **sampling: Unpack[wire.SamplingOptions]) -> Answer:
        reply = await self._call("POST", "/ask", json=wire.ask_body(question, max_new_tokens, **sampling))
        return Answer.from_json(reply.json(), question)

    def ask_stream(
        self, question: str, max_new_tokens: int = 64, **sampling: Unpack[wire.SamplingOptions]
    ) -> AsyncAnswerStream:
        """`async for piece in session.ask_stream(q)`, then `.answer`."""
        return AsyncAnswerStream(self, question, wire.ask_body(question, max_new_tokens, stream=True, **sampling))

    async def memory(self) -> dict:
        return (await self._call("GET", "/memory")).json()

    async def watch(self, condition: str, every_s: float | None = None, threshold: float | None = None) -> Watch:
        reply = await self._call("POST", "/watches", 201, json=wire.watch_body(condition, every_s, threshold))
        return Watch.model_validate(reply.json())

    async def watches(self) -> list[Watch]:
        return [Watch.model_validate(watch) for watch in (await self._call("GET", "/watches")).json()["watches"]]

    async def unwatch(self, watch_id: str) -> None:
        with wire.unless_gone("watch_not_found"):
            await self._call("DELETE", f"/watches/{watch_id}", 204)

    async def events(self, since: str | None = "0") -> AsyncIterator[dict]:
        """See `Session.events`."""
        async with self._stream("GET", "/events", params=wire.events_params(since)) as response:
            wire.checked(response)
            events = SessionEvents()
            async for line in response.aiter_lines():
                if (body := events.body(line)) is not None:
                    yield body
                elif events.gone:
                    return

    async def firings(self, watch_id: str | None = None) -> AsyncIterator[WatchFiredEvent]:
        """See `Session.firings`: `async for fired in session.firings()`."""
        async for event in self.events():
            if wire.ends_media(event):
                wire.ingest_finished(await self.info())  # raises for media that failed
                return
            if fired := wire.firing(event, watch_id):
                yield fired

    async def delete(self) -> None:
        with wire.unless_gone():
            await self._call("DELETE", "", 204)

    async def stream_frames(
        self,
        frames: Frames,
        *,
        question: str | None = None,
        every_s: float | None = None,
        max_new_tokens: int = 64,
        speed: float | None = None,
        on_event: EventHandler | None = None,
        on_answer: AnswerHandler | None = None,
        sampling: wire.SamplingOptions | None = None,
    ) -> StreamResult:
        """See `Session.stream_frames`; `frames` may be an iterable or an async iterable."""
        live = LiveStream(question, every_s, max_new_tokens, on_event, on_answer, sampling)
        pacer = Pacer(speed)
        async with await self._connect() as socket:
            with wire.socket_errors(live):
                channel = _Channel(socket, live, self.client.timeout_s)
                await channel.send(live.start_message())
                live.started(await channel.receive())
                async for time_s, jpeg in _aiter(frames):
                    await channel.pump(until=pacer.due(time_s))
                    while live.paused:
                        await channel.pump_one()
                    await socket.send(frame_message(time_s, jpeg))
                    live.frame_sent()
                await channel.send(live.end())
                while not live.finished:
                    await channel.pump_one()
        return live.summary()

    async def stream_file(
        self, path: str | Path, fps: float | None = None, speed: float | None = 1.0, **options: Any
    ) -> StreamResult:
        """See `Session.stream_file`; decoding runs in a thread."""
        frames = media.file_frames(path, fps or (await self.info())["fps"])
        return await self.stream_frames(_in_thread(frames), speed=speed, **options)

    async def stream_camera(
        self, device: str, fps: float | None = None, input_format: str | None = None, **options: Any
    ) -> StreamResult:
        frames = media.camera_frames(device, fps or (await self.info())["fps"], input_format)
        return await self.stream_frames(_in_thread(frames), **options)

    async def _call(self, method: str, path: str, *expected: int, **kwargs: Any) -> httpx.Response:
        kwargs["headers"] = {**wire.bearer(self.token), **kwargs.get("headers", {})}
        return await self.client.request(method, self._path + path, *expected, **kwargs)

    @asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        """See `Session._stream`."""
        headers = {**wire.bearer(self.token), **wire.SSE_HEADERS}
        with wire.transport_errors(self.client.base_url):
            async with self.client.http.stream(method, self._path + path, headers=headers, **kwargs) as response:
                if not wire.is_event_stream(response):
                    await response.aread()
                yield response

    async def _connect(self) -> ClientConnection:
        url = wire.stream_url(self.client.base_url, self.id)
        with wire.transport_errors(self.client.base_url):
            return await connect(url, additional_headers=wire.bearer(self.token), open_timeout=wire.CONNECT_TIMEOUT_S)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, error: type[BaseException] | None, *_: object) -> None:
        try:
            await self.delete()
        except StreamvqaError:
            if error is None:  # else the error that ended the block matters more
                raise


class AsyncAnswerStream:
    """See `streamvqa.client.AnswerStream`."""

    def __init__(self, session: AsyncSession, question: str, body: dict[str, Any]) -> None:
        self.session, self.question, self.body = session, question, body
        self.answer: Answer | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        async with self.session._stream("POST", "/ask", json=self.body) as response:
            if not wire.is_event_stream(response):
                self.answer = Answer.from_json(wire.checked(response).json(), self.question)
                yield self.answer.answer
                return
            decoder = SseDecoder()
            async for line in response.aiter_lines():
                if (event := decoder.feed(line)) is None:
                    continue
                piece = answer_event(event, self.question)
                if isinstance(piece, Answer):
                    self.answer = piece
                    return
                if piece:
                    yield piece
        raise StreamvqaError(None, "answer_incomplete", "the answer stream ended before its final event")


class _Channel:
    """See `streamvqa.client.sync._Channel`."""

    def __init__(self, socket: ClientConnection, live: LiveStream, timeout_s: float) -> None:
        self.socket, self.live, self.timeout_s = socket, live, timeout_s

    async def send(self, message: dict) -> None:
        await self.socket.send(json.dumps(message))

    async def receive(self, timeout_s: float | None = None) -> dict:
        async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
            return json.loads(await self.socket.recv())

    async def pump_one(self) -> None:
        try:
            event = await self.receive()
        except TimeoutError as err:
            raise StreamvqaError(None, "timeout", f"no event from the gateway in {self.timeout_s} s") from err
        await self._handle(event)

    async def pump(self, until: float | None) -> None:
        """Handle events until the monotonic time `until`; when None, only those already here."""
        while True:
            remaining_s = 0.0 if until is None else until - time.monotonic()
            try:
                event = await self.receive(max(remaining_s, POLL_S))
            except TimeoutError:
                if remaining_s <= POLL_S:
                    return
                continue
            await self._handle(event)

    async def _handle(self, event: dict) -> None:
        for message in self.live.handle(event):
            await self.send(message)


async def _aiter(frames: Frames) -> AsyncIterator[tuple[float, bytes]]:
    if isinstance(frames, AsyncIterable):
        async for frame in frames:
            yield frame
    else:
        for frame in frames:
            yield frame


async def _in_thread(frames: Iterator[tuple[float, bytes]]) -> AsyncIterator[tuple[float, bytes]]:
    """A blocking iterator (decoding) run in a worker thread, one item at a time."""
    done = object()
    try:
        while (frame := await asyncio.to_thread(next, frames, done)) is not done:
            yield frame
    finally:
        close = getattr(frames, "close", None)
        if close:
            close()


async def _chunks(
    file: IO[bytes], size: int | None, progress: wire.UploadProgress | None
) -> AsyncIterator[bytes]:
    sent = 0
    while chunk := await asyncio.to_thread(file.read, wire.UPLOAD_CHUNK_BYTES):
        yield chunk
        sent += len(chunk)
        if progress:
            progress(sent, size)

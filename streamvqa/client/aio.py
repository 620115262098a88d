"""The asyncio client: the same surface as `streamvqa.client.sync`, every call awaited; the
endpoints (`streamvqa.client.endpoints`) over httpx's async client, and stream sockets over
websockets' asyncio client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from streamvqa.client import frames as media
from streamvqa.client import wire
from streamvqa.client.endpoints import AnswerStream, ClientEndpoints, SessionEndpoints
from streamvqa.client.live import AnswerHandler, EventHandler, LiveStream, Pacer
from streamvqa.client.models import StreamResult, StreamvqaError, WatchFiredEvent
from streamvqa.client.sse import AnswerEvents, SessionEvents
from streamvqa.client.wire import Call, T
from streamvqa.protocol import frame_message

POLL_S = 0.001  # asyncio has no non-blocking receive: a look for events already here waits this long
Frames = Iterable[tuple[float, bytes]] | AsyncIterable[tuple[float, bytes]]

AsyncAnswerStream = AnswerStream  # one class for both clients: `async for` over the async client's


class AsyncSession(SessionEndpoints):
    """One session; see `streamvqa.client.Session`. `async with` deletes it on exit."""

    async def wait_until_ingested(
        self, progress: wire.RecordProgress | None = None, timeout_s: float | None = None
    ) -> dict:
        waiting = wire.IngestWait(progress, timeout_s)
        while not waiting.over(record := await self.info()):
            await asyncio.sleep(wire.POLL_INTERVAL_S)
        return record

    async def firings(self, watch_id: str | None = None) -> AsyncIterator[WatchFiredEvent]:
        """See `Session.firings`: `async for fired in session.firings()`."""
        async for event in self.events():
            if wire.ends_media(event):
                wire.ingest_finished(await self.info())  # raises for media that failed
                return
            if fired := wire.firing(event, watch_id):
                yield fired

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


class AsyncClient(ClientEndpoints):
    """A gateway at `base_url`; see `streamvqa.client.Client`."""

    http_type = httpx.AsyncClient
    session_type = AsyncSession

    async def send(self, call: Call[T]) -> T:
        """See `Client.send`."""
        with wire.opened(call, _chunks) as request, wire.transport_errors(self.base_url):
            response = await self.http.request(**request)
        return call.reply(response)

    async def read(self, call: Call, reader: SessionEvents | AnswerEvents) -> AsyncIterator[Any]:
        """See `Client.read`."""
        with wire.transport_errors(self.base_url):
            async with self.http.stream(**call.request(wire.SSE_HEADERS)) as response:
                if not wire.is_event_stream(response):
                    await response.aread()
                    for value in reader.whole(response):
                        yield value
                    return
                async for line in response.aiter_lines():
                    if (value := reader.take(line)) is not None:
                        yield value
                    elif reader.done:
                        return
        reader.ended()

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


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

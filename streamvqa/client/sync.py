"""The blocking client: the endpoints (`streamvqa.client.endpoints`) over httpx, and stream
sockets over websockets' sync client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
from websockets.sync.client import ClientConnection, connect

from streamvqa.client import frames as media
from streamvqa.client import wire
from streamvqa.client.endpoints import ClientEndpoints, SessionEndpoints
from streamvqa.client.live import AnswerHandler, EventHandler, LiveStream, Pacer
from streamvqa.client.models import StreamResult, StreamvqaError, WatchFiredEvent
from streamvqa.client.sse import AnswerEvents, SessionEvents
from streamvqa.client.wire import Call, T
from streamvqa.protocol import frame_message


class Session(SessionEndpoints):
    """One session: its id and token, and every call on it. As a context manager it deletes
    the session on exit."""

    def wait_until_ingested(self, progress: wire.RecordProgress | None = None, timeout_s: float | None = None) -> dict:
        """Poll until all media is in the cache; the final record. StreamvqaError when the media
        failed (`session_error`) or after `timeout_s` (`timeout`)."""
        waiting = wire.IngestWait(progress, timeout_s)
        while not waiting.over(record := self.info()):
            time.sleep(wire.POLL_INTERVAL_S)
        return record

    def firings(self, watch_id: str | None = None) -> Iterator[WatchFiredEvent]:
        """The firings of the session's watches (of `watch_id` alone, if given) as they come, from
        the first, until the session's media is all in the cache: an upload's end, a live stream's
        end. StreamvqaError (`session_error`) when its media failed."""
        for event in self.events():
            if wire.ends_media(event):
                wire.ingest_finished(self.info())  # raises for media that failed
                return
            if fired := wire.firing(event, watch_id):
                yield fired

    def stream_frames(
        self,
        frames: Iterable[tuple[float, bytes]],
        *,
        question: str | None = None,
        every_s: float | None = None,
        max_new_tokens: int = 64,
        speed: float | None = None,
        on_event: EventHandler | None = None,
        on_answer: AnswerHandler | None = None,
        sampling: wire.SamplingOptions | None = None,
    ) -> StreamResult:
        """Stream (capture time in s, JPEG) frames over the session's socket, pausing while the
        gateway says so, then end the stream and wait until every frame is in the cache.

        `speed`: None sends as fast as the gateway takes them; 1.0 paces them at their own times
        (real time), 4.0 four times faster. With a `question`, asks it on the socket every
        `every_s` seconds of video and once at the end (see `LiveStream`); `on_answer` gets each
        answer as it comes, `on_event` every event; `sampling` (as for `ask`) applies to each
        question. Returns counts and the answers.
        """
        live = LiveStream(question, every_s, max_new_tokens, on_event, on_answer, sampling)
        pacer = Pacer(speed)
        with self._connect() as socket, wire.socket_errors(live):
            channel = _Channel(socket, live, self.client.timeout_s)
            channel.send(live.start_message())
            live.started(channel.receive())
            for time_s, jpeg in frames:
                channel.pump(until=pacer.due(time_s))
                while live.paused:
                    channel.pump_one()
                socket.send(frame_message(time_s, jpeg))
                live.frame_sent()
            channel.send(live.end())
            while not live.finished:
                channel.pump_one()
        return live.summary()

    def stream_file(
        self, path: str | Path, fps: float | None = None, speed: float | None = 1.0, **options: Any
    ) -> StreamResult:
        """A video file as `frames`, sampled at `fps` (the session's when None), in real time
        unless `speed` says otherwise; options as for `stream_frames`. Needs PyAV and Pillow."""
        return self.stream_frames(media.file_frames(path, fps or self.info()["fps"]), speed=speed, **options)

    def stream_camera(
        self, device: str, fps: float | None = None, input_format: str | None = None, **options: Any
    ) -> StreamResult:
        """A camera as `frames` (see `frames.camera_frames`) until interrupted."""
        return self.stream_frames(media.camera_frames(device, fps or self.info()["fps"], input_format), **options)

    def _connect(self) -> ClientConnection:
        url = wire.stream_url(self.client.base_url, self.id)
        with wire.transport_errors(self.client.base_url):
            return connect(url, additional_headers=wire.bearer(self.token), open_timeout=wire.CONNECT_TIMEOUT_S)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        try:
            self.delete()
        except StreamvqaError:
            if error is None:  # else the error that ended the block matters more
                raise


class Client(ClientEndpoints):
    """A gateway at `base_url` (None: $STREAMVQA_URL, else http://127.0.0.1:8000). `api_key` (None:
    $STREAMVQA_API_KEY, else none) goes with every request (the gateway wants it on `POST /sessions`
    and `GET /sessions` when it has one configured); `timeout_s` bounds each wait for the gateway:
    a reply, an event, an answer."""

    http_type = httpx.Client
    session_type = Session

    def send(self, call: Call[T]) -> T:
        """The value of the reply to `call`; StreamvqaError when the gateway refuses it or cannot be reached."""
        with wire.opened(call, _chunks) as request, wire.transport_errors(self.base_url):
            response = self.http.request(**request)
        return call.reply(response)

    def read(self, call: Call, reader: SessionEvents | AnswerEvents) -> Iterator[Any]:
        """What `reader` takes from the reply to `call` as it comes: an event stream, else (its
        body read) an error or a whole answer."""
        with wire.transport_errors(self.base_url), self.http.stream(**call.request(wire.SSE_HEADERS)) as response:
            if not wire.is_event_stream(response):
                response.read()
                yield from reader.whole(response)
                return
            for line in response.iter_lines():
                if (value := reader.take(line)) is not None:
                    yield value
                elif reader.done:
                    return
        reader.ended()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _Channel:
    """A stream socket driven by a LiveStream: every event received goes through it, and what
    it says to send is sent."""

    def __init__(self, socket: ClientConnection, live: LiveStream, timeout_s: float) -> None:
        self.socket, self.live, self.timeout_s = socket, live, timeout_s

    def send(self, message: dict) -> None:
        self.socket.send(json.dumps(message))

    def receive(self, timeout_s: float | None = None) -> dict:
        """The next event; TimeoutError when none comes within `timeout_s` (the client's when None)."""
        return json.loads(self.socket.recv(timeout=self.timeout_s if timeout_s is None else timeout_s))

    def pump_one(self) -> None:
        """Wait for the next event and handle it."""
        try:
            event = self.receive()
        except TimeoutError as err:
            raise StreamvqaError(None, "timeout", f"no event from the gateway in {self.timeout_s} s") from err
        self._handle(event)

    def pump(self, until: float | None) -> None:
        """Handle events until the monotonic time `until`; when None, only those already here."""
        while True:
            remaining_s = 0.0 if until is None else until - time.monotonic()
            try:
                event = self.receive(max(remaining_s, 0.0))
            except TimeoutError:
                if remaining_s <= 0:
                    return
                continue
            self._handle(event)

    def _handle(self, event: dict) -> None:
        for message in self.live.handle(event):
            self.send(message)


def _chunks(file: IO[bytes], size: int | None, progress: wire.UploadProgress | None) -> Iterator[bytes]:
    sent = 0
    while chunk := file.read(wire.UPLOAD_CHUNK_BYTES):
        yield chunk
        sent += len(chunk)
        if progress:
            progress(sent, size)

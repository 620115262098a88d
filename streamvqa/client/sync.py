"""The blocking client: httpx for the REST API, websockets' sync client for stream sockets."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Unpack

import httpx
from websockets.sync.client import ClientConnection, connect

from streamvqa.client import frames as media
from streamvqa.client import wire
from streamvqa.client.live import AnswerHandler, EventHandler, LiveStream, Pacer
from streamvqa.client.models import Answer, StreamResult, StreamvqaError, Watch, WatchFiredEvent
from streamvqa.client.sse import SessionEvents, SseDecoder, answer_event
from streamvqa.protocol import frame_message


class Client:
    """A gateway at `base_url` (None: $STREAMVQA_URL, else http://127.0.0.1:8000). `api_key` (None:
    $STREAMVQA_API_KEY, else none) goes with every request (the gateway wants it on `POST /sessions`
    and `GET /sessions` when it has one configured); `timeout_s` bounds each wait for the gateway:
    a reply, an event, an answer."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout_s: float = wire.DEFAULT_TIMEOUT_S
    ) -> None:
        self.base_url, self.timeout_s = wire.gateway_url(base_url), timeout_s
        self.http = httpx.Client(**wire.http_options(self.base_url, api_key, timeout_s))

    def create_session(self, **options: Any) -> Session:
        """A new session. Options (all optional): fps, model, policy, budget_tokens,
        system_prompt, policy_options, recall, host_budget_tokens, retrieval_tokens; see
        `POST /sessions` in docs/api.md."""
        body = self.request("POST", "/sessions", 201, json=wire.session_options(options)).json()
        return Session(self, body["id"], body["token"])

    def session(self, session_id: str, token: str) -> Session:
        """An existing session, from its id and token."""
        return Session(self, session_id, token)

    def sessions(self) -> list[dict]:
        """Your sessions' records, failed ones among them, newest first (`GET /sessions`): those of
        your API key; without keys, those of your address where the gateway sets
        ADDRESS_OWNS_SESSIONS, else none (a token opens its own session only: `Session.info()`)."""
        return self.request("GET", "/sessions").json()["sessions"]

    def end_session(self, session_id: str) -> None:
        """End one of your sessions without its token (`DELETE /sessions/{id}` as its owner: your
        API key; without keys, your address where the gateway sets ADDRESS_OWNS_SESSIONS, else
        `401 unauthorized`: end it with its token, `Session.delete()`); a gone one is no error."""
        with wire.unless_gone():
            self.request("DELETE", f"/sessions/{session_id}", 204)

    def request(self, method: str, path: str, *expected: int, **kwargs: Any) -> httpx.Response:
        with wire.transport_errors(self.base_url):
            response = self.http.request(method, path, **kwargs)
        return wire.checked(response, *expected)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Session:
    """One session: its id and token, and every call on it. As a context manager it deletes
    the session on exit."""

    def __init__(self, client: Client, session_id: str, token: str) -> None:
        self.client, self.id, self.token = client, session_id, token
        self._path = f"/sessions/{session_id}"

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def info(self) -> dict:
        """The session record: state, error, frames_ingested, video_time_s, cache_tokens, ..."""
        return self._call("GET", "").json()

    def upload(self, source: wire.UploadSource, progress: wire.UploadProgress | None = None) -> int:
        """Send a video file (a path or a binary file object) in chunks; the bytes the gateway took."""
        with wire.upload_source(source) as (file, size):
            headers = wire.upload_headers(self.token, size)
            reply = self._call("POST", "/upload", 202, content=_chunks(file, size, progress), headers=headers)
            return reply.json()["bytes"]

    def wait_until_ingested(self, progress: wire.RecordProgress | None = None, timeout_s: float | None = None) -> dict:
        """Poll until all media is in the cache; the final record. StreamvqaError when the media
        failed (`session_error`) or after `timeout_s` (`timeout`)."""
        waiting = wire.IngestWait(progress, timeout_s)
        while not waiting.over(record := self.info()):
            time.sleep(wire.POLL_INTERVAL_S)
        return record

    def ask(self, question: str, max_new_tokens: int = 64, **sampling: Unpack[wire.SamplingOptions]) -> Answer:
        """Ask about what the session has seen so far; waits for the whole answer. Greedy unless
        `sampling` says otherwise: `temperature`, `top_p`, `top_k`, `seed`, `stop`."""
        reply = self._call("POST", "/ask", json=wire.ask_body(question, max_new_tokens, **sampling))
        return Answer.from_json(reply.json(), question)

    def ask_stream(
        self, question: str, max_new_tokens: int = 64, **sampling: Unpack[wire.SamplingOptions]
    ) -> AnswerStream:
        """Ask, and iterate over the answer's text as it is generated; then `.answer` is the
        Answer. `sampling` as for `ask`."""
        return AnswerStream(self, question, wire.ask_body(question, max_new_tokens, stream=True, **sampling))

    def memory(self) -> dict:
        """The cache: policy, budget_tokens, cache_tokens, evictions, the host tier (recall), and
        spans of video time with the tokens seen, held and in the host tier for each
        (`GET /sessions/{id}/memory`)."""
        return self._call("GET", "/memory").json()

    def watch(self, condition: str, every_s: float | None = None, threshold: float | None = None) -> Watch:
        """Watch the video for a yes/no condition: from the session's video time now on, every
        `every_s` seconds of video (default 2) its worker scores p(yes), and the watch fires when
        it reaches `threshold` (default 0.5), once per episode (docs/api.md, "Watches"). Its
        firings come from `firings()`, and stay in the watch's `fired`."""
        reply = self._call("POST", "/watches", 201, json=wire.watch_body(condition, every_s, threshold))
        return Watch.model_validate(reply.json())

    def watches(self) -> list[Watch]:
        """The session's watches, oldest first, each with its firings and its last check."""
        return [Watch.model_validate(watch) for watch in self._call("GET", "/watches").json()["watches"]]

    def unwatch(self, watch_id: str) -> None:
        """Stop a watch and forget its firings (their events stay); a gone watch is no error."""
        with wire.unless_gone("watch_not_found"):
            self._call("DELETE", f"/watches/{watch_id}", 204)

    def events(self, since: str | None = "0") -> Iterator[dict]:
        """The session's events as they come (`GET /sessions/{id}/events`: `ingest`, `state`,
        `warning`, `error`, `watch_fired`), each a dict with its `type`: from the first it keeps
        (`since="0"`, the last 1000) or only new ones (None). Ends when the session is deleted or
        expires; leave the loop to stop sooner."""
        with self._stream("GET", "/events", params=wire.events_params(since)) as response:
            wire.checked(response)
            events = SessionEvents()
            for line in response.iter_lines():
                if (body := events.body(line)) is not None:
                    yield body
                elif events.gone:
                    return

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

    def delete(self) -> None:
        """Forget the session (its worker frees its memory); deleting a gone session is no error."""
        with wire.unless_gone():
            self._call("DELETE", "", 204)

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

    def _call(self, method: str, path: str, *expected: int, **kwargs: Any) -> httpx.Response:
        kwargs["headers"] = {**wire.bearer(self.token), **kwargs.get("headers", {})}
        return self.client.request(method, self._path + path, *expected, **kwargs)

    @contextmanager
    def _stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A reply read as it comes: a stream of events, else (its body read) an error or a whole answer."""
        headers = {**wire.bearer(self.token), **wire.SSE_HEADERS}
        with (
            wire.transport_errors(self.client.base_url),
            self.client.http.stream(method, self._path + path, headers=headers, **kwargs) as response,
        ):
            if not wire.is_event_stream(response):
                response.read()
            yield response

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


class AnswerStream:
    """An answer as it is generated: iterate for its text, piece by piece; once the iteration
    is over, `answer` holds the whole Answer. A gateway that does not stream answers gives the
    whole text as one piece."""

    def __init__(self, session: Session, question: str, body: dict[str, Any]) -> None:
        self.session, self.question, self.body = session, question, body
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        with self.session._stream("POST", "/ask", json=self.body) as response:
            if not wire.is_event_stream(response):
                self.answer = Answer.from_json(wire.checked(response).json(), self.question)
                yield self.answer.answer
                return
            decoder = SseDecoder()
            for line in response.iter_lines():
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


def _chunks(file: Any, size: int | None, progress: wire.UploadProgress | None) -> Iterator[bytes]:
    sent = 0
    while chunk := file.read(wire.UPLOAD_CHUNK_BYTES):
        yield chunk
        sent += len(chunk)
        if progress:
            progress(sent, size)

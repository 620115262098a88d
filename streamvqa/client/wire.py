"""What the sync and async clients do alike: URLs, headers, bodies, each request as a `Call`
(what to send and how its reply reads), upload sources, the wait for an ingest, and the
translation of transport failures and closed sockets into StreamvqaError."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypedDict, TypeVar

import httpx
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from streamvqa.client.live import LiveStream
from streamvqa.client.models import StreamvqaError, WatchFiredEvent

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 300.0  # the gateway's own ASK_TIMEOUT_S: an answer may take this long
CONNECT_TIMEOUT_S = 10.0
UPLOAD_CHUNK_BYTES = 1024 * 1024
POLL_INTERVAL_S = 0.5  # between looks at a session while waiting for its ingest
SSE_HEADERS = {"Accept": "text/event-stream"}

UploadSource = str | os.PathLike | IO[bytes]
UploadProgress = Callable[[int, int | None], None]  # (bytes sent, total bytes or None when unknown)
RecordProgress = Callable[[dict], None]  # the session record, at each look
Chunks = Callable[[IO[bytes], int | None, UploadProgress | None], Any]  # a client's upload body: (async) chunks of the file
ANY_CODE = "*"
T = TypeVar("T")


def gateway_url(base_url: str | None) -> str:
    """`base_url`, else $STREAMVQA_URL, else DEFAULT_URL (the command's `--url` alike)."""
    return (base_url or os.environ.get("STREAMVQA_URL") or DEFAULT_URL).rstrip("/")


def gateway_api_key(api_key: str | None) -> str | None:
    """`api_key`, else $STREAMVQA_API_KEY, else none (the command's `--api-key` alike)."""
    return api_key or os.environ.get("STREAMVQA_API_KEY") or None


def http_options(base_url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """Either client's httpx options: the gateway, the API key (see `gateway_api_key`), the timeouts."""
    api_key = gateway_api_key(api_key)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
    return {"base_url": base_url, "headers": {"X-API-Key": api_key} if api_key else {}, "timeout": timeout}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def stream_url(base_url: str, session_id: str) -> str:
    url = httpx.URL(base_url)
    scheme = "wss" if url.scheme == "https" else "ws"
    return str(url.copy_with(scheme=scheme, path=f"{url.path.rstrip('/')}/sessions/{session_id}/stream"))


class SamplingOptions(TypedDict, total=False):
    """How an answer's tokens are chosen (docs/api.md, "Sampling"); each one left out keeps the
    gateway's default: greedy."""

    temperature: float  # 0 (greedy) to 2
    top_p: float  # above 0, at most 1
    top_k: int  # 0 (no limit) to 1000
    seed: int  # the same seed, question and cache give the same answer
    stop: list[str] | str  # up to 4 strings of 1 to 64 characters: the answer ends before the first


def firing(event: dict, watch_id: str | None) -> WatchFiredEvent | None:
    """A session event as a firing of the watch `watch_id` (of any watch when None); None for
    any other event."""
    if event.get("type") != "watch_fired" or watch_id not in (None, event.get("watch_id")):
        return None
    return WatchFiredEvent.model_validate(event)


def ends_media(event: dict) -> bool:
    """Whether a session event says its media is all in the cache (`state` ingested) or failed
    (`error` session_error): the end of an upload's or a live stream's firings."""
    kind = event.get("type")
    return (kind == "state" and event.get("state") == "ingested") or (kind == "error" and event.get("code") == "session_error")


def checked(response: httpx.Response) -> httpx.Response:
    """The response when its status is 200; StreamvqaError otherwise."""
    if response.status_code != 200:
        raise StreamvqaError.from_response(response)
    return response


def is_event_stream(response: httpx.Response) -> bool:
    """Whether a reply is a stream of events (else its body is an error, or a whole answer)."""
    return response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream")


def ingest_finished(record: dict) -> bool:
    """Whether a session has all its media in the cache; StreamvqaError when its media failed."""
    if record["state"] == "error":
        raise StreamvqaError(None, "session_error", f"the session failed: {record.get('error')}")
    return record["state"] == "ingested"


class IngestWait:
    """`wait_until_ingested` on either client: each look at the session's record goes to `over`."""

    def __init__(self, progress: RecordProgress | None, timeout_s: float | None) -> None:
        self.progress, self.timeout_s = progress, timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def over(self, record: dict) -> bool:
        """Whether all the media is in; StreamvqaError when it failed or the time is up."""
        if self.progress:
            self.progress(record)
        if ingest_finished(record):
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            message = f"session {record['id']} not ingested after {self.timeout_s} s (state {record['state']})"
            raise StreamvqaError(None, "timeout", message)
        return False


@contextmanager
def socket_errors(live: LiveStream) -> Iterator[None]:
    """A stream socket the gateway closed, as the error its close code (or last event) names."""
    try:
        yield
    except ConnectionClosed as closed:
        code, reason = (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else (None, "")
        raise live.closed(code, reason) from closed


@contextmanager
def upload_source(source: UploadSource) -> Iterator[tuple[IO[bytes], int | None]]:
    """A binary file to read the upload from, and its size from the current position (None when
    unknown); a path is opened here and closed after."""
    if isinstance(source, str | os.PathLike):
        with Path(source).open("rb") as file:
            yield file, os.fstat(file.fileno()).st_size
        return
    size = None
    if source.seekable():
        position = source.tell()
        size = source.seek(0, os.SEEK_END) - position
        source.seek(position)
    yield source, size


@contextmanager
def transport_errors(url: str) -> Iterator[None]:
    """HTTP and WebSocket failures below the API (refused, timed out, dropped) as StreamvqaError."""
    try:
        yield
    except (httpx.TransportError, OSError, InvalidHandshake, InvalidURI, TimeoutError) as err:
        raise StreamvqaError.from_transport(err, url) from err


def nothing(_: httpx.Response) -> None:
    return None


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to the gateway and what its reply gives, without any I/O: both clients send
    it, each over its own transport (`Client.send`, `AsyncClient.send`)."""

    method: str
    path: str
    result: Callable[[httpx.Response], T] = httpx.Response.json  # the value of a reply with an expected status
    expected: tuple[int, ...] = (200,)
    token: str | None = None  # the session's, sent as a bearer token
    json: Any = None
    params: dict[str, str] | None = None
    upload: tuple[UploadSource, UploadProgress | None] | None = None  # a body read from a file
    gone: str | None = None  # a 404 with this code (any code: ANY_CODE) is no error: the value is None

    def request(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        """httpx's arguments for the call, with `headers` beside the token."""
        token = bearer(self.token) if self.token else {}
        return {
            "method": self.method, "url": self.path, "headers": {**token, **(headers or {})}, "json": self.json,
            "params": self.params,
        }

    def reply(self, response: httpx.Response) -> T:
        """The reply's value; StreamvqaError for a status not expected, save a 404 the call lets pass (None)."""
        if response.status_code in self.expected:
            return self.result(response)
        error = StreamvqaError.from_response(response)
        if error.status == 404 and self.gone in (ANY_CODE, error.code):
            return None  # deleting what is gone already is no error
        raise error


@contextmanager
def opened(call: Call, chunks: Chunks) -> Iterator[dict[str, Any]]:
    """httpx's arguments for `call`. An upload's body is `chunks` of its file, which stays open (a
    path is opened here) until the request is over; with its size known the gateway can refuse an
    upload over its limit before any byte is sent."""
    if call.upload is None:
        yield call.request()
        return
    source, progress = call.upload
    with upload_source(source) as (file, size):
        length = {"Content-Length": str(size)} if size is not None else {}
        headers = {"Content-Type": "application/octet-stream", **length}
        yield {**call.request(headers), "content": chunks(file, size, progress)}

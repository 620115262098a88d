"""What the sync and async clients do alike: URLs, headers, bodies, upload sources, the wait for
an ingest, and the translation of transport failures and closed sockets into StreamvqaError."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypedDict

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


def session_options(options: dict[str, Any]) -> dict[str, Any]:
    """The body of `POST /sessions`: the options given, without the ones left at None."""
    return {name: value for name, value in options.items() if value is not None}


class SamplingOptions(TypedDict, total=False):
    """How an answer's tokens are chosen (docs/api.md, "Sampling"); each one left out keeps the
    gateway's default: greedy."""

    temperature: float  # 0 (greedy) to 2
    top_p: float  # above 0, at most 1
    top_k: int  # 0 (no limit) to 1000
    seed: int  # the same seed, question and cache give the same answer
    stop: list[str] | str  # up to 4 strings of 1 to 64 characters: the answer ends before the first


def ask_body(question: str, max_new_tokens: int, stream: bool = False, **sampling: Any) -> dict[str, Any]:
    chosen = {name: value for name, value in sampling.items() if value is not None}
    return {"question": question, "max_new_tokens": max_new_tokens, **chosen, **({"stream": True} if stream else {})}


def watch_body(condition: str, every_s: float | None, threshold: float | None) -> dict[str, Any]:
    """The body of `POST /sessions/{id}/watches`; each option left at None keeps the gateway's
    default (every_s 2, threshold 0.5)."""
    options = {"every_s": every_s, "threshold": threshold}
    return {"condition": condition, **{name: value for name, value in options.items() if value is not None}}


def events_params(since: str | None) -> dict[str, str]:
    return {"since": since} if since else {}


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


def checked(response: httpx.Response, *expected: int) -> httpx.Response:
    """The response when its status is one of `expected` (200 when none); StreamvqaError otherwise."""
    if response.status_code not in (expected or (200,)):
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


def upload_headers(token: str, size: int | None) -> dict[str, str]:
    """With a known size the gateway can refuse an upload over its limit before any byte is sent."""
    length = {"Content-Length": str(size)} if size is not None else {}
    return {**bearer(token), "Content-Type": "application/octet-stream", **length}


@contextmanager
def transport_errors(url: str) -> Iterator[None]:
    """HTTP and WebSocket failures below the API (refused, timed out, dropped) as StreamvqaError."""
    try:
        yield
    except (httpx.TransportError, OSError, InvalidHandshake, InvalidURI, TimeoutError) as err:
        raise StreamvqaError.from_transport(err, url) from err


@contextmanager
def unless_gone(code: str | None = None) -> Iterator[None]:
    """Deleting what is gone already is no error: a 404 (with `code`, only that one) passes."""
    try:
        yield
    except StreamvqaError as err:
        if err.status != 404 or code not in (None, err.code):
            raise

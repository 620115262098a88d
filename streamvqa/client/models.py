"""What the client returns and raises: answers, watches and their firings, live-stream results,
and the one error type."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
from pydantic import ConfigDict

from streamvqa import protocol
# an answer's evidence, a watch (with its `fired` list) and one firing, as the client exports them
from streamvqa.protocol import Evidence, Watch, WatchFiredEvent

# Why a stream socket was closed, as an error `code` (docs/streaming.md, "Close codes").
CLOSE_CODES = {
    1007: "undecodable",
    1009: "message_too_big",
    1011: "internal_error",
    1013: "try_again_later",
    4400: "bad_request",
    4401: "unauthorized",
    4403: "forbidden_origin",
    4404: "session_not_found",
    4409: "conflict",
    4429: "backpressure_ignored",
}


class StreamvqaError(Exception):
    """An error from the gateway, or on the way to it.

    `status` is the HTTP status, or the close code of a stream socket, or None for an error that
    came as an event inside a stream (an answer's `error`, a socket's `error` event) or that
    came with no reply at all (`unreachable`, `timeout`, `connection_lost`). `code` is the
    gateway's stable error code (see the README); `retry_after_s` its Retry-After, if any.
    """

    def __init__(self, status: int | None, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s

    def __str__(self) -> str:
        return f"{self.message} ({self.code})"

    @classmethod
    def from_response(cls, response: httpx.Response) -> StreamvqaError:
        """The gateway's `{"code", "message"}` body, or what can be said of a reply without one."""
        try:
            body = json.loads(response.content)
            code, message = str(body["code"]), str(body["message"])
        except (ValueError, KeyError, TypeError):
            code, message = f"http_{response.status_code}", response.text[:200] or response.reason_phrase
        retry_after = response.headers.get("retry-after", "")
        return cls(response.status_code, code, message, float(retry_after) if retry_after.isdigit() else None)

    @classmethod
    def from_transport(cls, err: Exception, url: str) -> StreamvqaError:
        if isinstance(err, httpx.TimeoutException | TimeoutError):
            return cls(None, "timeout", f"no reply from {url} in time ({type(err).__name__})")
        return cls(None, "unreachable", f"cannot reach the gateway at {url}: {err or type(err).__name__}")


class Answer(protocol.Answer):
    """An answer as the gateway gives it on every API (`streamvqa.protocol.Answer`: `answer`,
    `tokens`, `evidence` strongest first, `video_time_s`, `ttft_ms`, ...), and its question."""

    model_config = ConfigDict(frozen=True)

    ttft_ms: float | None = None  # None where the gateway does not report it
    total_ms: float | None = None
    question: str = ""

    @classmethod
    def from_json(cls, body: dict, question: str = "") -> Answer:
        """The answer in a reply, an SSE `done` event or a socket's `answer_done` event."""
        return cls.model_validate({**body, "question": question})


@dataclass
class StreamResult:
    """What a live stream did: frames sent, the session's frames once ingested, the answers."""

    frames_sent: int = 0
    frames_ingested: int = 0  # frames in the session (its last `ingest` event)
    video_time_s: float = 0.0  # time of the session's last frame in the cache
    frames_dropped: int = 0  # frames the worker dropped for falling behind real time
    answers: list[Answer] = field(default_factory=list)  # in order (the last 1000 of a longer stream)

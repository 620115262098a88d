"""What the client returns and raises: answers, live-stream results, and the one error type."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

# Why a stream socket was closed, as an error `code` (docs/streaming.md, "Close codes").
CLOSE_CODES = {
    1007: "undecodable",
    1009: "message_too_big",
    1011: "internal_error",
    1013: "try_again_later",
    4400: "bad_request",
    4401: "unauthorized",
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


@dataclass(frozen=True)
class Evidence:
    time_s: float  # video time of a frame the answer attended to
    weight: float  # that frame's share of the answer's attention to frames (0 to 1)


@dataclass(frozen=True)
class Answer:
    answer_id: str
    answer: str
    tokens: int  # generated tokens
    evidence: list[Evidence]  # strongest first
    video_time_s: float  # video time of the last frame the answer could see
    cache_tokens: int  # KV cache tokens when the answer finished
    ttft_ms: float | None = None  # question at the gateway to the first token (None where not reported)
    total_ms: float | None = None
    question: str = ""
    recalled_s: list[int] = field(default_factory=list)  # seconds of video brought back from the host tier (recall)
    finish_reason: str = "stop"  # "stop": the answer ended (or a stop string came); "length": max_new_tokens reached

    @classmethod
    def from_json(cls, body: dict, question: str = "") -> Answer:
        return cls(
            answer_id=body.get("answer_id") or "",
            answer=body["answer"],
            tokens=body["tokens"],
            evidence=[Evidence(e["time_s"], e["weight"]) for e in body.get("evidence", [])],
            video_time_s=body["video_time_s"],
            cache_tokens=body["cache_tokens"],
            ttft_ms=body.get("ttft_ms"),
            total_ms=body.get("total_ms"),
            question=question,
            recalled_s=list(body.get("recalled_s", [])),
            finish_reason=body.get("finish_reason", "stop"),
        )


@dataclass
class StreamResult:
    """What a live stream did: frames sent, the session's frames once ingested, the answers."""

    frames_sent: int = 0
    frames_ingested: int = 0  # frames in the session (its last `ingest` event)
    video_time_s: float = 0.0  # time of the session's last frame in the cache
    frames_dropped: int = 0  # frames the worker dropped for falling behind real time
    answers: list[Answer] = field(default_factory=list)  # in order (the last 1000 of a longer stream)

"""The Redis protocol between gateways and workers: keys, bounds and message schemas.

Both sides import this module; it imports neither torch nor fastapi. `docs/architecture.md`
lists every key with its owner and bound.

Streams carry one JSON document per entry in the field `m`, except media entries, whose
payload is raw bytes in the field `data` beside a `type` field.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

GROUP = "workers"  # the consumer group on every stream that workers read

# Bounds. Entries are deleted once processed, so these are backlogs, not histories.
MEDIA_CHUNK_BYTES = 256 * 1024
MEDIA_BACKLOG_ENTRIES = 64  # writers wait while a media stream holds this many entries
MEDIA_MAXLEN = 4 * MEDIA_BACKLOG_ENTRIES  # hard cap; never reached while writers wait
QUESTIONS_BACKLOG = 16  # unanswered questions per session before asks are refused
ANSWER_MAXLEN = 4096  # answer stream entries (tokens plus the final record)
ANSWER_TTL_S = 3600
PENDING_MAXLEN = 10_000  # sessions waiting for a worker, per model


class Keys:
    """Every Redis key streamvqa uses, under one prefix (tests use a prefix each)."""

    def __init__(self, prefix: str = "svqa:") -> None:
        self.prefix = prefix

    def session(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def lease(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:lease"

    def media(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:media"

    def questions(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}:questions"

    def session_data(self, session_id: str) -> tuple[str, str, str]:
        """The keys that live and expire with a session."""
        return self.session(session_id), self.media(session_id), self.questions(session_id)

    def answer(self, answer_id: str) -> str:
        return f"{self.prefix}answer:{answer_id}"

    def pending(self, model: str) -> str:
        return f"{self.prefix}pending:{model}"

    def workers(self) -> str:
        return f"{self.prefix}workers"


class SessionState(StrEnum):
    PENDING = "pending"  # created, no worker holds it yet
    READY = "ready"  # a worker holds it; no media yet
    INGESTING = "ingesting"  # media is arriving or being decoded
    INGESTED = "ingested"  # all media so far is in the cache
    ERROR = "error"  # media failed; `error` says why


Policy = Literal["full", "sliding", "h2o", "snapkv", "infmllm"]
POLICIES: tuple[str, ...] = get_args(Policy)  # the engine's registry holds the same names (tested)


class SessionOptions(BaseModel):
    """What a client may choose when it creates a session."""

    model_config = ConfigDict(extra="forbid")

    fps: float = Field(1.0, ge=0.1, le=4.0, description="Frames sampled per second of video.")
    model: str | None = Field(
        None, min_length=1, max_length=200, description="Model name; the gateway's default when absent."
    )
    policy: Policy = Field(
        "infmllm",
        description="KV cache policy: infmllm (bounded, attention-scored with a recency bias), "
        "snapkv, h2o, sliding (sinks and recent tokens), or full (no eviction: memory grows).",
    )
    budget_tokens: int = Field(
        8192, ge=256, le=1_000_000, description="Tokens each cache layer keeps after an eviction."
    )


class SessionRecord(BaseModel):
    """A session as stored in its Redis hash and returned by `GET /sessions/{id}`."""

    id: str
    model: str
    policy: Policy
    budget_tokens: int
    fps: float
    state: SessionState = SessionState.PENDING
    error: str | None = None
    worker: str | None = None
    media: Literal["upload"] | None = None
    upload_bytes: int = 0
    frames_ingested: int = 0
    video_time_s: float = 0.0
    cache_tokens: int = 0
    created_at: float = Field(default_factory=time.time)

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> SessionRecord:
        return cls.model_validate({k.decode(): v.decode() for k, v in fields.items()})


def to_hash(**fields: object) -> dict[str, str]:
    """Redis hash fields for a partial record update; None values are left out."""
    return {k: (v.value if isinstance(v, StrEnum) else str(v)) for k, v in fields.items() if v is not None}


class Question(BaseModel):
    answer_id: str
    question: str
    max_new_tokens: int


class TokenEvent(BaseModel):
    type: Literal["token"] = "token"
    text: str


class Evidence(BaseModel):
    time_s: float = Field(description="Video time of a frame the answer attended to.")
    weight: float = Field(description="That frame's share of the answer's attention to frames (0 to 1).")


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    answer: str
    tokens: int  # generated tokens
    evidence: list[Evidence] = []
    video_time_s: float
    cache_tokens: int
    worker_ms: float  # from the worker reading the question to the last token


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    code: str
    message: str


AnswerEvent = Annotated[TokenEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]


class AnswerEnvelope(BaseModel):
    event: AnswerEvent


class WorkerInfo(BaseModel):
    id: str
    model: str
    sessions: int
    max_sessions: int
    expires_at: float  # unix time after which the worker counts as gone

    @property
    def alive(self) -> bool:
        return self.expires_at > time.time()

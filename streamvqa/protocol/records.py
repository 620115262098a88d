"""What Redis stores about sessions and workers: the session record and its states, the
memory report a worker writes for each session, and each worker's entry in the registry."""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import asdict
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from streamvqa.protocol.keys import reserved_device_bytes
from streamvqa.protocol.options import Policy


class SessionState(StrEnum):
    PENDING = "pending"  # created, no worker holds it yet
    READY = "ready"  # a worker holds it; no media yet
    INGESTING = "ingesting"  # media is arriving or being decoded
    INGESTED = "ingested"  # all media so far is in the cache
    ERROR = "error"  # media failed; `error` says why

# The legal changes of a session's state: from each state, those it may become (writing the
# state it holds is no change). A session is created pending; error is final. The writers: the
# worker's record writer (`worker.records.RecordWriter.set`, which checks the changes it asks for), the
# gateway's upload scripts (scripts.START_UPLOAD_LUA, scripts.ABORT_UPLOAD_LUA) and the worker's
# scripts.ABANDON_UPLOAD_LUA.
TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    # a worker takes it; an upload starts before any does; the worker cannot open it
    SessionState.PENDING: frozenset({SessionState.READY, SessionState.INGESTING, SessionState.ERROR}),
    # media comes
    SessionState.READY: frozenset({SessionState.INGESTING, SessionState.ERROR}),
    # all of it is in the cache; an upload aborted or abandoned, or a stream ended with no frame
    # (back to pending when no worker ever held the session); media failed
    SessionState.INGESTING: frozenset(
        {SessionState.INGESTED, SessionState.READY, SessionState.PENDING, SessionState.ERROR}
    ),
    # a stream socket connects again, or more media comes
    SessionState.INGESTED: frozenset({SessionState.INGESTING, SessionState.ERROR}),
    SessionState.ERROR: frozenset(),
}


def check_transition(old: SessionState, new: SessionState) -> None:
    """ValueError when a session in state `old` may not become `new`."""
    if new != old and new not in TRANSITIONS[old]:
        raise ValueError(f"a session's state may not go from {old} to {new}")


MAX_SESSION_WARNINGS = 8  # a session keeps its latest warnings, no more


class SessionWarning(BaseModel):
    """What the user should know of a session's media that did not fail it; also sent as a
    `warning` event."""

    code: str = Field(description="`truncated_media` (the file was cut short), `context_full`.")
    message: str


class SessionRecord(BaseModel):
    """A session as stored in its Redis hash and returned by `GET /sessions/{id}`."""

    id: str
    model: str
    policy: Policy
    budget_tokens: int
    fps: float
    policy_options: dict[str, bool | int | float | str] = Field(default_factory=dict)
    system_prompt: str | None = None
    recall: bool = False
    host_budget_tokens: int = Field(0, description="With recall, the host tier's bound per layer; 0 without.")
    retrieval_tokens: int = Field(0, description="With recall, what one question may bring back per layer; 0 without.")
    pin_turns: int = 0
    state: SessionState = SessionState.PENDING
    error: str | None = None
    worker: str | None = None
    media: Literal["upload", "webm", "mp4", "frames"] | None = None
    upload_bytes: int = 0
    upload_ended: bool = Field(False, description="Every byte of the upload reached the worker.")
    media_duration_s: float | None = Field(None, description="An upload's video duration, once known.")
    stream_bytes: int = Field(0, description="Media bytes received into the session's stream (a stream socket's or an upload's).")
    last_frame_s: float | None = Field(None, description="Video time of the last `frames` message received.")
    frames_dropped: int = Field(0, description="Live frames dropped because the worker fell behind.")
    ingest_lag_s: float = Field(0.0, description="How far behind real time the last live frame was ingested.")
    frames_ingested: int = 0
    video_time_s: float = 0.0
    cache_tokens: int = 0
    tokens_seen: int = Field(
        0, description="Tokens run through the model so far (frames and text), written with `cache_tokens`: what the "
        "cache holds and what it evicted.",
    )
    ingest_progress: float | None = Field(
        None, description="An upload's share in the cache, 0 to 1: the video time its frames cover over its duration."
    )
    ingest_eta_s: float | None = Field(
        None, description="An upload's seconds left to ingest: its steps still to come, each at what a step costs at the "
        "tokens its cache will hold then, and at a full cache (None: not known yet)."
    )
    context_tokens: int = Field(0, description="The most tokens the cache may hold: the model's context (0: not known).")
    context_full: bool = Field(
        False, description="The cache reached the context: later frames are not taken, and only questions that fit are."
    )
    warnings: list[SessionWarning] = Field(
        [], description=f"What the user should know of the session's media, oldest first (the latest {MAX_SESSION_WARNINGS})."
    )
    created_at: float = Field(default_factory=time.time)

    @field_validator("policy_options", "warnings", mode="before")
    @classmethod
    def _from_json(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value

    def warn(self, code: str, message: str) -> bool:
        """Add a warning, keeping the latest MAX_SESSION_WARNINGS; False when it is there already."""
        warning = SessionWarning(code=code, message=message)
        if warning in self.warnings:
            return False
        self.warnings = [*self.warnings, warning][-MAX_SESSION_WARNINGS:]
        return True

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> SessionRecord:
        return cls.model_validate({k.decode(): v.decode() for k, v in fields.items()})


def to_hash(**fields: object) -> dict[str, str]:
    """Redis hash fields for a partial record update; None values are left out, dicts and lists
    are JSON."""
    def text(value: object) -> str:
        if isinstance(value, StrEnum):
            return value.value
        return json.dumps(value) if isinstance(value, dict | list) else str(value)

    return {k: text(v) for k, v in fields.items() if v is not None}


class MemorySpan(BaseModel):
    start_s: int = Field(description="The span is [start_s, end_s) of video time.")
    end_s: int
    frame_seen: int = Field(description="Frame tokens appended from it.")
    frame_held: float = Field(description="Of those, held now (mean over layers and KV heads).")
    text_seen: int = Field(description="Text tokens (questions, answers) appended while it was the latest video time.")
    text_held: float
    frame_host: float = Field(0.0, description="Of the frame tokens, in the host tier now (recall), and so recallable.")
    text_host: float = 0.0


class MemoryReport(BaseModel):
    """What a session's bounded cache holds now, written by its worker after it changes."""

    policy: str
    budget_tokens: int | None = Field(description="Tokens each layer keeps after an eviction; null: never evicts.")
    cache_tokens: int
    frame_tokens: float = Field(description="Frame tokens held (mean over layers and KV heads).")
    text_tokens: float
    evictions: int
    evicted_tokens: int = Field(description="Tokens evicted so far, per layer.")
    frames: int = Field(description="Frames appended so far.")
    video_time_s: float
    spans: list[MemorySpan] = Field(
        description="The stream so far in at most 600 equal spans of whole seconds. What was seen and is neither "
        "held nor in the host tier was dropped."
    )
    recall: bool = False
    host_budget_tokens: int = Field(0, description="The host tier's bound, per layer; 0 without recall.")
    host_tokens: int = Field(0, description="Tokens in the host tier now, per layer.")
    host_bytes: int = Field(0, description="Host memory the tier takes.")
    retrievals: int = Field(0, description="Questions that brought tokens back from the host tier.")
    updated_at: float = Field(description="Unix time the worker wrote this report.")

    @classmethod
    def of(cls, memory: object, stats: object, recall: bool) -> MemoryReport:
        """The report of an engine session's `memory()` and `stats()` (the dataclasses
        engine.memory_map.Memory and SessionStats, read field by name; where both have a field,
        the memory's), as of now."""
        held, counted = asdict(memory), asdict(stats)
        return cls.model_validate({
            **counted, **held, "recall": recall, "updated_at": time.time(),
            "frame_tokens": round(held["frame_tokens"], 2), "text_tokens": round(held["text_tokens"], 2),
            "video_time_s": round(counted["video_time_s"], 3),
        })


QUEUE_TIME_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_SESSIONS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram(BaseModel):
    """Observations counted by bucket, as a worker advertises them for GET /metrics: `counts[i]`
    are those at most `bounds[i]` and over the bound before (not cumulative); the last count is
    those over every bound. Its size is fixed by its bounds."""

    bounds: tuple[float, ...]
    counts: list[int]  # len(bounds) + 1
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds=bounds, counts=[0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class WorkerInfo(BaseModel):
    id: str
    model: str
    sessions: int
    max_sessions: int
    expires_at: float  # unix time after which the worker counts as gone
    session_ids: list[str] = []  # the sessions it holds (at most max_sessions)
    kv_bytes_per_token: int = 0  # its model's cache bytes per token (0: unknown)
    kv_free_bytes: int = 0  # cache memory not reserved by its sessions (each reserves its peak)
    context_tokens: int = 0  # the most tokens a session's cache may hold: its model's context (0: unknown)
    dtype: str = ""  # what its model computes and caches in: float32 or bfloat16 (DTYPE; empty: unknown)
    host_bytes_per_token: int = 0  # a host tier token's bytes, over all layers (0: unknown)
    index_bytes_per_host_token: float = 0.0  # cache memory a host tier token's share of its index takes
    host_free_bytes: int = 0  # host memory for host tiers not reserved by its sessions (each reserves its bound)
    # its memory: the settings (KV_MEMORY, HOST_MEMORY), what it offers now (what they state, or less while memory
    # is short: it reads what is free as sessions come and go), what was free to anyone when it last read
    kv_memory: str = ""
    kv_memory_bytes: int = 0
    device_free_bytes: int = 0
    host_memory: str = ""
    host_memory_bytes: int = 0
    ram_free_bytes: int = 0
    default_sessions: int = 0  # sessions with the default options its cache memory holds
    memory_warning: str | None = None  # set while that is under 2
    # its KV pool (engine/kv_pool.py): pages of `pool_page_tokens` cache tokens each, allocated once at start
    # (0 pages: it has none); each session it holds leases a run of them (`pool_session_pages`, by session)
    pool_pages: int = 0
    pool_free_pages: int = 0
    pool_page_tokens: int = 0
    pool_bytes: int = 0
    pool_session_pages: dict[str, int] = {}
    # its host pool (engine/host_pool.py): pages of `host_pool_page_tokens` stream places each, for its sessions'
    # host tiers (recall), allocated once at start; each such session leases a run of them
    host_pool_pages: int = 0
    host_pool_free_pages: int = 0
    host_pool_page_tokens: int = 0
    host_pool_bytes: int = 0
    host_pool_session_pages: dict[str, int] = {}
    # what `pin_turns` pins on its model (SessionOptions.check_pins; 0: unknown)
    opening_tokens: int = 0  # the opening, with the model's default system prompt
    turn_marker_tokens: int = 0  # the markers closing one question and its answer
    # counters since the worker started, and its live sessions' ingest lag, for GET /metrics
    frames_ingested: int = 0
    evictions: int = 0
    answers: int = 0
    ingest_lag_s: float = 0.0
    host_bytes: int = 0  # its sessions' host tiers now
    retrieved_tokens: int = 0  # host tokens brought back per layer for questions, since it started
    retrieved_pages: int = 0  # host pages questions borrowed from (in the first layer), since it started
    retrieval_ms: float = 0.0  # time spent choosing and bringing them back
    steps: int = 0  # engine steps since it started (of questions starting, of answers, of frames)
    step_sessions: int = 0  # sessions those steps ran together: over `steps`, the mean batch
    prompt_tokens: int = 0  # questions' tokens (with their turns' markers) prefilled since it started
    generation_tokens: int = 0  # answer tokens generated since it started
    queue_time_s: Histogram | None = None  # from a question reaching the gateway to the worker starting it
    time_per_output_token_s: Histogram | None = None  # per answer of 2 tokens or more: after its first, the mean gap
    step_batch_sessions: Histogram | None = None  # sessions each engine step ran in one forward

    def fits(self, peak_tokens: int, host_tokens: int = 0) -> bool:
        """Whether a session whose cache peaks at `peak_tokens` (and its host tier) fits now: by
        count, by cache memory and by host memory."""
        if self.sessions >= self.max_sessions:
            return False
        cache = reserved_device_bytes(peak_tokens, host_tokens, self.kv_bytes_per_token, self.index_bytes_per_host_token)
        host = host_tokens * self.host_bytes_per_token
        return (self.kv_bytes_per_token == 0 or cache <= self.kv_free_bytes) and (
            self.host_bytes_per_token == 0 or host <= self.host_free_bytes
        )

    @property
    def alive(self) -> bool:
        return self.expires_at > time.time()

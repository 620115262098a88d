"""The Redis protocol between gateways and workers: keys, bounds and message schemas.

Both sides import this module; it imports neither torch nor fastapi. `docs/architecture.md`
lists every key with its owner and bound.

Streams carry one JSON document per entry in the field `m`, except media entries, whose
payload is raw bytes in the field `data` beside a `type` field.
"""

from __future__ import annotations

import json
import math
import struct
import time
from enum import IntEnum, StrEnum
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

GROUP = "workers"  # the consumer group on every stream that workers read

# Bounds. Entries are deleted once processed, so these are backlogs, not histories.
MEDIA_CHUNK_BYTES = 256 * 1024
MEDIA_BACKLOG_ENTRIES = 64  # writers wait while a media stream holds this many entries
MEDIA_MAXLEN = 4 * MEDIA_BACKLOG_ENTRIES  # hard cap; never reached while writers wait
QUESTIONS_BACKLOG = 16  # unanswered questions per session before asks are refused
ASKED_MAXLEN = 1024  # questions per session whose answers can be looked up by id (the latest)
MAX_QUESTION_CHARS = 4000
MAX_QUESTION_TOKENS = 1024  # a longer question (as the model tokenises it) is refused: `question_too_long`
MAX_SYSTEM_PROMPT_CHARS = 4000
ANSWER_MAXLEN = 4096  # answer stream entries (tokens plus the final record)
ANSWER_TTL_S = 3600
PENDING_MAXLEN = 10_000  # sessions waiting for a worker, per model
MAX_ANSWER_TOKENS = 1024  # the most tokens one answer may have
PROMPT_RESERVE_TOKENS = 2048  # the longest prompt (a question with its turn markers, or a group of frames) a cache takes at once


HOST_BUDGET_MULTIPLE = 16  # with recall, the host tier holds this many times the budget unless told
MAX_HOST_BUDGET_TOKENS = 4_000_000
# Host bytes per token beside its keys and values, per layer and KV head: kind (1), time (4), held (1)
HOST_TOKEN_OVERHEAD_BYTES = 6


DEFAULT_BUDGET_TOKENS = 8192  # a bounded session's budget when none is given, unless its model's context leaves less


def peak_cache_tokens(budget_tokens: int, retrieval_tokens: int = 0) -> int:
    """The most tokens a bounded session's cache ever holds: its budget, one prompt and one
    answer (it evicts down to the budget after each), and what a question borrows from the host tier."""
    return budget_tokens + retrieval_tokens + PROMPT_RESERVE_TOKENS + MAX_ANSWER_TOKENS


def session_peak_tokens(policy: str, budget_tokens: int, retrieval_tokens: int, context_tokens: int) -> int:
    """The most tokens a session's cache holds: a bounded one's peak, a `full` one's whole
    context (where it stops; 0: the context is not known, and the bounded peak is counted)."""
    if policy == "full" and context_tokens:
        return context_tokens
    return peak_cache_tokens(budget_tokens, retrieval_tokens)


def reserved_device_bytes(
    peak_tokens: int, host_tokens: int, kv_bytes_per_token: int, index_bytes_per_host_token: float
) -> int:
    """The cache memory a session reserves on its worker: its peak cache, and with recall its
    host tier's index."""
    return peak_tokens * kv_bytes_per_token + math.ceil(host_tokens * index_bytes_per_host_token)
EVENTS_MAXLEN = 1000  # a session's recent events (ingest progress, errors, state changes)
STREAMER_TTL_S = 10  # a connection's claim on its session's media (a stream socket, an upload), renewed every third of it

# Deletes a key (a worker's lease, a socket's claim) only while it holds ARGV[1], its holder.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Renews a claim (`session:{id}:streamer`) for ARGV[2] ms while ARGV[1] holds it; 0 when it does not.
RENEW_CLAIM_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# `frames` messages: an 8-byte header, the capture time in seconds as a little-endian IEEE 754
# double, then one JPEG, PNG or WebP image.
FRAME_HEADER_BYTES = 8
MAX_VIDEO_TIME_S = 7 * 24 * 3600.0
IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF")  # JPEG, PNG, WebP (RIFF....WEBP)


def frame_message(time_s: float, image: bytes) -> bytes:
    """A `frames` message: the header, then the image."""
    return struct.pack("<d", time_s) + image


def parse_frame_header(message: bytes) -> float:
    """The capture time of a `frames` message; ValueError, for the client, when it is not one."""
    if len(message) <= FRAME_HEADER_BYTES:
        raise ValueError(f"a frame message is an {FRAME_HEADER_BYTES}-byte time and an image; got {len(message)} bytes")
    (time_s,) = struct.unpack_from("<d", message)
    if not (math.isfinite(time_s) and 0 <= time_s <= MAX_VIDEO_TIME_S):
        raise ValueError(f"a frame's time must be seconds from 0 to {MAX_VIDEO_TIME_S:.0f}; got {time_s}")
    image = message[FRAME_HEADER_BYTES:]
    if not (image.startswith(IMAGE_SIGNATURES[:2]) or (image.startswith(b"RIFF") and image[8:12] == b"WEBP")):
        raise ValueError("a frame's image must be JPEG, PNG or WebP")
    return time_s


class CloseCode(IntEnum):
    """Why the gateway closes a streaming WebSocket (besides the standard 1000, 1009, 1011)."""

    UNDECODABLE = 1007  # the media cannot be decoded (an `error` event says why)
    TRY_AGAIN_LATER = 1013  # the session's worker stopped reading the stream
    BAD_REQUEST = 4400  # no valid `start` message, or a message that breaks the protocol
    UNAUTHORIZED = 4401  # no token, or not this session's token
    NOT_FOUND = 4404  # no such session (or it expired)
    CONFLICT = 4409  # the session already has other media, or another socket streams into it
    TOO_MANY = 4429  # messages after a `backpressure` event, over the message rate, or sockets on the session


class Keys:
    """Every Redis key streamvqa uses, under one prefix (tests use a prefix each).

    A session's keys all carry its id as a hash tag (`session:{<id>}...`): on a Redis Cluster
    they live in one slot, so that a script may touch any of them together. The global keys
    (`owner:`, `rate:`, `pending:`, `admitted:`, `workers`) are one key each, in slots of their
    own; no script touches one of them beside another key (docs/protocol.md says what that costs).
    """

    def __init__(self, prefix: str = "svqa:") -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a key prefix may not hold {{ or }} (they would make it every key's hash tag): {prefix!r}")
        self.prefix = prefix

    def session(self, session_id: str) -> str:
        return f"{self.prefix}session:{{{session_id}}}"

    def _of(self, session_id: str, name: str) -> str:
        return f"{self.session(session_id)}:{name}"

    def lease(self, session_id: str) -> str:
        return self._of(session_id, "lease")

    def media(self, session_id: str) -> str:
        return self._of(session_id, "media")

    def questions(self, session_id: str) -> str:
        return self._of(session_id, "questions")

    def events(self, session_id: str) -> str:
        return self._of(session_id, "events")

    def streamer(self, session_id: str) -> str:
        return self._of(session_id, "streamer")

    def snapshot(self, session_id: str) -> str:
        return self._of(session_id, "snapshot")

    def memory(self, session_id: str) -> str:
        return self._of(session_id, "memory")

    def asked(self, session_id: str) -> str:
        return self._of(session_id, "asked")

    def asked_questions(self, session_id: str) -> str:
        return self._of(session_id, "asked_questions")

    def sockets(self, session_id: str) -> str:
        return self._of(session_id, "sockets")

    def session_data(self, session_id: str) -> tuple[str, ...]:
        """The keys that live and expire with a session: hash, media, questions, events, snapshot,
        memory report, asked ids, open sockets, asked questions' text."""
        return (
            self.session(session_id),
            self.media(session_id),
            self.questions(session_id),
            self.events(session_id),
            self.snapshot(session_id),
            self.memory(session_id),
            self.asked(session_id),
            self.sockets(session_id),
            self.asked_questions(session_id),
        )

    def answer(self, session_id: str, answer_id: str) -> str:
        return self._of(session_id, f"answer:{answer_id}")

    def owner(self, owner: str) -> str:
        """The sessions created with one API key (or from one address, without keys)."""
        return f"{self.prefix}owner:{owner}"

    def rate(self, caller: str) -> str:
        return f"{self.prefix}rate:{caller}"

    def pending(self, model: str) -> str:
        return f"{self.prefix}pending:{model}"

    def admitted(self, model: str) -> str:
        """The sessions of `model` that hold or wait for a place on a worker (not parked, not failed)."""
        return f"{self.prefix}admitted:{model}"

    def workers(self) -> str:
        return f"{self.prefix}workers"


class SessionState(StrEnum):
    PENDING = "pending"  # created, no worker holds it yet
    READY = "ready"  # a worker holds it; no media yet
    INGESTING = "ingesting"  # media is arriving or being decoded
    INGESTED = "ingested"  # all media so far is in the cache
    ERROR = "error"  # media failed; `error` says why


Policy = Literal["full", "sliding", "h2o", "snapkv", "tova", "knorm", "infmllm"]
POLICIES: tuple[str, ...] = get_args(Policy)  # the engine's registry holds the same names (tested)


class PolicyOptions(BaseModel):
    """A policy's knobs; each unset one keeps the engine's default (docs/engine.md)."""

    model_config = ConfigDict(extra="forbid")

    sinks: int | None = Field(None, ge=0, le=1024, description="S: first tokens always kept (default 4).")
    recent: int | None = Field(None, ge=0, le=65_536, description="R: latest tokens always kept (default 128; h2o: half the budget).")
    per_layer: bool | None = Field(
        None, description="One selection per layer instead of one per KV head (default false; tova: true)."
    )
    evict_on_question: bool | None = Field(None, description="Also evict right after a question, before answering.")
    window: int | None = Field(None, ge=1, le=1024, description="infmllm, snapkv: the prompt's last queries that score the cache (default 32).")
    beta: float | None = Field(None, ge=0, le=1000, description="infmllm: weight of the recency bias (default 0.5).")
    bias_shape: Literal["linear", "square"] | None = Field(None, description="infmllm: how the bias grows with recency.")
    local_sum: int | None = Field(None, ge=1, le=63, description="infmllm: keys summed around each one, odd (default 5).")
    kernel: int | None = Field(None, ge=1, le=63, description="snapkv: pooling width, odd (default 7).")

    @field_validator("local_sum", "kernel")
    @classmethod
    def _odd(cls, value: int | None) -> int | None:
        if value is not None and value % 2 == 0:
            raise ValueError("must be odd")
        return value

    def chosen(self) -> dict[str, object]:
        """The knobs set, by name."""
        return self.model_dump(exclude_none=True)


# The knobs each policy takes (the engine's policy dataclasses; a test checks they agree).
_COMMON_KNOBS = ("sinks", "recent", "per_layer", "evict_on_question")
POLICY_KNOBS: dict[str, tuple[str, ...]] = {
    "full": (),
    "sliding": _COMMON_KNOBS,
    "h2o": _COMMON_KNOBS,
    "snapkv": (*_COMMON_KNOBS, "window", "kernel"),
    "tova": _COMMON_KNOBS,
    "knorm": _COMMON_KNOBS,
    "infmllm": (*_COMMON_KNOBS, "window", "beta", "bias_shape", "local_sum"),
}
DEFAULT_SINKS, DEFAULT_RECENT = 4, 128


class SessionOptions(BaseModel):
    """What a client may choose when it creates a session."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"fps": 1.0, "policy": "infmllm", "budget_tokens": 4096, "policy_options": {"beta": 0.5, "recent": 256}},
                {"policy": "sliding", "budget_tokens": 2048, "system_prompt": "Describe what you see in one sentence."},
            ]
        },
    )

    fps: float = Field(1.0, ge=0.1, le=4.0, description="Frames sampled per second of video.")
    model: str | None = Field(
        None, min_length=1, max_length=200, description="Model name; the gateway's default when absent."
    )
    policy: Policy = Field(
        "infmllm",
        description="KV cache policy: infmllm (bounded, attention-scored with a recency bias), "
        "snapkv, tova, knorm, h2o, sliding (sinks and recent tokens), or full (no eviction: memory grows).",
    )
    budget_tokens: int | None = Field(
        None, ge=256, le=1_000_000,
        description=f"Tokens each cache layer keeps after an eviction; when absent {DEFAULT_BUDGET_TOKENS}, or the "
        "most the model's context leaves room for beside a prompt, an answer and the retrieval.",
    )
    policy_options: PolicyOptions = Field(
        default_factory=PolicyOptions, description="The policy's knobs; only those the policy has are accepted."
    )
    system_prompt: str | None = Field(
        None, min_length=1, max_length=MAX_SYSTEM_PROMPT_CHARS, description="Replaces the model's default system prompt."
    )
    recall: bool = Field(
        False,
        description="Keep what the cache evicts in a bounded host tier (CPU memory), and let each question "
        "bring back the parts of the past it needs for its answer. Needs a policy that evicts.",
    )
    host_budget_tokens: int | None = Field(
        None, ge=32, le=MAX_HOST_BUDGET_TOKENS,
        description=f"With recall: evicted tokens the host tier keeps, per layer (oldest and least recalled "
        f"pages go first); {HOST_BUDGET_MULTIPLE}x budget_tokens when absent.",
    )
    retrieval_tokens: int | None = Field(
        None, ge=0, le=1_000_000,
        description="With recall: host tokens one question brings back, per layer; half of budget_tokens when absent.",
    )

    pin_turns: int = Field(
        0, ge=0, le=64,
        description="Never evict the opening (system prompt) nor the markers that close the last this many "
        "questions and answers; 0: only the first and the latest tokens are kept for sure.",
    )

    @model_validator(mode="after")
    def _recall_options(self) -> SessionOptions:
        if not self.recall:
            given = [name for name in ("host_budget_tokens", "retrieval_tokens") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} need recall: true")
        elif self.policy == "full":
            raise ValueError("recall needs a policy that evicts; 'full' keeps everything")
        return self

    def within(self, context_tokens: int) -> SessionOptions:
        """These options for a model whose cache may hold `context_tokens` (0: not known): the
        budget chosen when absent, and checked so that the cache's peak stays within the context.
        A ValueError says why they cannot be."""
        budget = self.budget_tokens
        if self.policy != "full" and context_tokens:
            largest = self._largest_budget(context_tokens - PROMPT_RESERVE_TOKENS - MAX_ANSWER_TOKENS)
            beside = f"beside a {PROMPT_RESERVE_TOKENS}-token prompt and a {MAX_ANSWER_TOKENS}-token answer"
            if self.recall:
                beside += " and what a question retrieves"
            if budget is None and largest < 256:
                raise ValueError(
                    f"the model's {context_tokens}-token context leaves no room for a bounded cache {beside}; "
                    "use policy 'full'"
                )
            if budget is not None and budget > largest:
                raise ValueError(
                    f"budget_tokens {budget} does not fit the model's {context_tokens}-token context {beside}: "
                    f"at most {max(largest, 0)}"
                )
            budget = min(budget or DEFAULT_BUDGET_TOKENS, largest)
        chosen = self.model_dump(exclude_unset=True, exclude_none=True)
        return SessionOptions.model_validate({**chosen, "budget_tokens": budget or DEFAULT_BUDGET_TOKENS})

    def _largest_budget(self, room_tokens: int) -> int:
        """The largest budget whose peak, with the retrieval, leaves `room_tokens` for itself."""
        if not self.recall or self.retrieval_tokens is not None:
            return room_tokens - (self.retrieval_tokens or 0)
        largest = (2 * room_tokens + 1) // 3  # half the budget is borrowed
        return largest - (largest + largest // 2 > room_tokens)

    @property
    def budget(self) -> int:
        return self.budget_tokens if self.budget_tokens is not None else DEFAULT_BUDGET_TOKENS

    def peak_tokens(self, context_tokens: int) -> int:
        """The most tokens the session's cache holds, on a model of `context_tokens` (0: not known)."""
        return session_peak_tokens(self.policy, self.budget, self.borrowed_tokens, context_tokens)

    @property
    def host_tokens(self) -> int:
        """The host tier's bound, per layer (0 without recall)."""
        if not self.recall:
            return 0
        return self.host_budget_tokens if self.host_budget_tokens is not None else HOST_BUDGET_MULTIPLE * self.budget

    @property
    def borrowed_tokens(self) -> int:
        """The most one question borrows from the host tier, per layer (0 without recall)."""
        if not self.recall:
            return 0
        return self.retrieval_tokens if self.retrieval_tokens is not None else self.budget // 2

    @field_validator("policy_options")
    @classmethod
    def _knobs_of_the_policy(cls, options: PolicyOptions, info: ValidationInfo) -> PolicyOptions:
        policy, budget = info.data.get("policy"), info.data.get("budget_tokens")
        if policy is None:
            return options
        foreign = sorted(set(options.chosen()) - set(POLICY_KNOBS[policy]))
        if foreign:
            takes = ", ".join(POLICY_KNOBS[policy]) or "none"
            raise ValueError(f"policy {policy!r} has no option {', '.join(foreign)} (it takes: {takes})")
        if budget is not None and policy != "full":
            default_recent = budget // 2 if policy == "h2o" else DEFAULT_RECENT  # h2o: half the budget
            kept = (options.sinks if options.sinks is not None else DEFAULT_SINKS) + (
                options.recent if options.recent is not None else default_recent
            )
            if budget <= kept:
                raise ValueError(f"budget_tokens ({budget}) must exceed sinks + recent ({kept})")
        return options


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
    stream_bytes: int = Field(0, description="Bytes received on the session's stream sockets.")
    last_frame_s: float | None = Field(None, description="Video time of the last `frames` message received.")
    frames_dropped: int = Field(0, description="Live frames dropped because the worker fell behind.")
    ingest_lag_s: float = Field(0.0, description="How far behind real time the last live frame was ingested.")
    frames_ingested: int = 0
    video_time_s: float = 0.0
    cache_tokens: int = 0
    context_tokens: int = Field(0, description="The most tokens the cache may hold: the model's context (0: not known).")
    context_full: bool = Field(
        False, description="The cache reached the context: later frames are not taken, and only questions that fit are."
    )
    created_at: float = Field(default_factory=time.time)

    @field_validator("policy_options", mode="before")
    @classmethod
    def _from_json(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> SessionRecord:
        return cls.model_validate({k.decode(): v.decode() for k, v in fields.items()})


def to_hash(**fields: object) -> dict[str, str]:
    """Redis hash fields for a partial record update; None values are left out, dicts are JSON."""
    def text(value: object) -> str:
        if isinstance(value, StrEnum):
            return value.value
        return json.dumps(value) if isinstance(value, dict) else str(value)

    return {k: text(v) for k, v in fields.items() if v is not None}


MAX_STOP_STRINGS = 4  # the engine's bounds (engine/sampling.py; a test checks they agree)
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000
MAX_SEED = 2**63 - 1


class Sampling(BaseModel):
    """How an answer's tokens are chosen: greedy by default, else drawn at `temperature`."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        0.0, ge=0, le=MAX_TEMPERATURE,
        description="0: greedy, the most likely token each time (top_p, top_k and seed are then unused); "
        "higher draws more freely.",
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Draw among the fewest most likely tokens whose probabilities reach top_p."
    )
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Draw among the k most likely tokens; 0: no such limit.")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED,
        description="The same seed, question and cache give the same answer; without one each draw is fresh.",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        [], max_length=MAX_STOP_STRINGS,
        description=f"Up to {MAX_STOP_STRINGS} strings (or one string): the answer ends before the first of them.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    def sampling(self) -> Sampling:
        """Only the sampling options (of a request that has others too)."""
        return Sampling.model_validate(self.model_dump(include=set(Sampling.model_fields)))


class AskOptions(Sampling):
    """What every way of asking takes besides the question: the answer's length and sampling."""

    max_new_tokens: int = Field(64, ge=1, le=MAX_ANSWER_TOKENS, description="The most tokens the answer may have.")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_ANSWER_TOKENS, description="The same as max_new_tokens (the name OpenAI's API uses)."
    )

    @model_validator(mode="after")
    def _one_length(self) -> AskOptions:
        if self.max_tokens is not None and "max_new_tokens" in self.model_fields_set:
            raise ValueError("give max_tokens or max_new_tokens, not both")
        return self

    @property
    def answer_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.max_new_tokens


class Question(BaseModel):
    answer_id: str
    question: str
    max_new_tokens: int
    asked_at: float | None = None  # unix time the gateway received it; answer times count from it
    sampling: Sampling = Field(default_factory=Sampling)  # absent (older gateways): greedy


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
    recalled_s: list[int] = []
    finish_reason: Literal["stop", "length"] = "stop"
    prompt_tokens: int = 0  # tokens the question added to the cache, with its turn's markers
    video_time_s: float
    cache_tokens: int
    worker_ms: float  # from the worker reading the question to the last token
    ttft_ms: float | None = None  # from `asked_at` to the first token (None: no asked_at)
    total_ms: float | None = None  # from `asked_at` to the last token


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    code: str
    message: str


AnswerEvent = Annotated[TokenEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]


class AnswerEnvelope(BaseModel):
    event: AnswerEvent


class IngestEvent(BaseModel):
    type: Literal["ingest"] = "ingest"
    frames: int = Field(description="Frames in the session so far.")
    times: list[float] = Field(description="Video times of the frames this step appended.")
    video_time_s: float
    lag_s: float = Field(description="How far behind real time the last frame was appended (live only).")
    dropped: int = Field(description="Live frames dropped so far because the worker fell behind.")
    cache_tokens: int


class StateEvent(BaseModel):
    type: Literal["state"] = "state"
    state: SessionState
    connection: str | None = Field(
        None,
        description="For a live stream, the connection it concerns: the one that connected (`ingesting`), "
        "or the last one that sent (`ingested`).",
    )


class WarningEvent(BaseModel):
    type: Literal["warning"] = "warning"
    code: str
    message: str


class MediaErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    code: str
    message: str
    connection: str | None = Field(None, description="The stream connection it concerns (closed with 1007).")


class StartedEvent(BaseModel):
    """The gateway's reply to a stream's `start`."""

    type: Literal["started"] = "started"
    format: str | None = Field(description="The media format, or null for a socket that only watches and asks.")
    connection: str
    bytes_received: int = Field(description="Stream bytes received before this connection (send on from here).")
    last_frame_s: float | None = Field(
        None, description="`frames`: the video time of the last frame received before this connection (send on after it)."
    )
    frames: int
    video_time_s: float


class BackpressureEvent(BaseModel):
    """From the gateway: the worker is behind; stop sending until `paused` is false."""

    type: Literal["backpressure"] = "backpressure"
    paused: bool
    backlog: int = Field(description="Media entries waiting for the worker.")


SessionEvent = Annotated[
    IngestEvent | StateEvent | WarningEvent | MediaErrorEvent | StartedEvent | BackpressureEvent,
    Field(discriminator="type"),
]


class EventEnvelope(BaseModel):
    event: SessionEvent


class StartMessage(BaseModel):
    """A stream socket's first message. Without a format the socket only watches and asks: it
    sends no media, so any number of them (up to the per-session socket limit) may be open."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["start"]
    format: Literal["webm", "mp4", "frames"] | None = None
    resume: str | None = Field(
        None, max_length=64,
        description="The `connection` of this client's previous socket: if it still holds the stream (its gateway "
        "or Redis went away before it could let go), this socket takes the stream over at once.",
    )


class AskMessage(AskOptions):
    """A question asked on a stream socket; its answer comes back as `answer_*` events."""

    type: Literal["ask"]
    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    ref: str | None = Field(None, max_length=200, description="The client's own name for the question, echoed back.")


class AnswerStartedEvent(BaseModel):
    type: Literal["answer_started"] = "answer_started"
    answer_id: str
    ref: str | None = None


class AnswerTokenEvent(BaseModel):
    type: Literal["answer_token"] = "answer_token"
    answer_id: str
    ref: str | None = None
    text: str


class AnswerDoneEvent(BaseModel):
    type: Literal["answer_done"] = "answer_done"
    answer_id: str
    ref: str | None = None
    answer: str
    tokens: int
    evidence: list[Evidence]
    recalled_s: list[int] = []
    finish_reason: Literal["stop", "length"] = "stop"
    video_time_s: float
    cache_tokens: int
    ttft_ms: float | None
    total_ms: float | None


class AnswerErrorEvent(BaseModel):
    type: Literal["answer_error"] = "answer_error"
    answer_id: str | None = None  # None: the question was refused before it was queued
    ref: str | None = None
    code: str
    message: str


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
    host_bytes_per_token: int = 0  # a host tier token's bytes, over all layers (0: unknown)
    index_bytes_per_host_token: float = 0.0  # cache memory a host tier token's share of its index takes
    host_free_bytes: int = 0  # host memory for host tiers not reserved by its sessions (each reserves its bound)
    # counters since the worker started, and its live sessions' ingest lag, for GET /metrics
    frames_ingested: int = 0
    evictions: int = 0
    answers: int = 0
    ingest_lag_s: float = 0.0
    host_bytes: int = 0  # its sessions' host tiers now
    retrieved_tokens: int = 0  # host tokens brought back per layer for questions, since it started
    retrieved_pages: int = 0  # host pages questions borrowed from (in the first layer), since it started
    retrieval_ms: float = 0.0  # time spent choosing and bringing them back

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

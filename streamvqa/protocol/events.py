"""The messages of the streams and sockets: questions and answer events (worker to gateway),
session events, and what a stream socket sends and receives (docs/streaming.md).

Streams carry one JSON document per entry in the field `m` (media entries are media.py's).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from streamvqa.protocol.options import AskOptions, QuestionText, Sampling
from streamvqa.protocol.records import SessionState


class CloseCode(IntEnum):
    """Why the gateway closes a streaming WebSocket (besides the standard 1000, 1009, 1011)."""

    UNDECODABLE = 1007  # the media cannot be decoded (an `error` event says why)
    TRY_AGAIN_LATER = 1013  # the session's worker stopped reading the stream
    BAD_REQUEST = 4400  # no valid `start` message, or a message that breaks the protocol
    UNAUTHORIZED = 4401  # no token, or not this session's token
    FORBIDDEN_ORIGIN = 4403  # a browser's page from an origin neither the gateway's own nor in CORS_ORIGINS
    NOT_FOUND = 4404  # no such session (or it expired)
    CONFLICT = 4409  # the session already has other media, or another socket streams into it
    TOO_MANY = 4429  # messages after a `backpressure` event, over the message rate, or sockets on the session


class Question(BaseModel):
    answer_id: str
    question: str
    max_new_tokens: int
    asked_at: float | None = None  # unix time the gateway received it; answer times count from it
    sampling: Sampling = Field(default_factory=Sampling)  # absent (older gateways): greedy
    # asked on a stream socket after media: the id of the last media entry that socket added
    # before it; the worker starts the question once that media is in the cache
    after_media: str | None = Field(None, pattern=r"^\d{1,20}-\d{1,20}$")


class TokenEvent(BaseModel):
    type: Literal["token"] = "token"
    text: str


class Evidence(BaseModel):
    time_s: float = Field(description="Video time of a frame the answer attended to.")
    weight: float = Field(description="That frame's share of the answer's attention to frames (0 to 1).")


# A finished answer, the one shape every API gives it: the body of `POST /sessions/{id}/ask`, the
# data of a Server-Sent `done` event, a looked-up answer's `result`, the fields of a stream socket's
# `answer_done` after its `type` and `ref`; the OpenAI route's `streamvqa` object is a part of it,
# and the Python client parses it. The worker's `DoneEvent` carries it. (No docstring: it would be
# the OpenAPI schema's description.)
class Answer(BaseModel):
    answer_id: str
    answer: str
    tokens: int  # generated
    evidence: list[Evidence] = Field(description="The frames the answer attended to most, strongest first.")
    recalled_s: list[int] = Field(
        [], description="With recall: whole seconds of video whose tokens the answer brought back from the host tier."
    )
    finish_reason: Literal["stop", "length", "cancelled"] = Field(
        "stop", description="stop: the model ended its answer, or a stop string came; length: it reached max_new_tokens; "
        "cancelled: the client that asked left before the answer was done (its text is what came until then).",
    )
    video_time_s: float = Field(description="Video time of the last frame the answer could see.")
    cache_tokens: int = Field(description="KV cache tokens when the answer finished.")
    ttft_ms: float | None = Field(description="From the question reaching the gateway to the first answer token.")
    total_ms: float | None = Field(description="From the question reaching the gateway to the last answer token.")


class DoneEvent(Answer):
    """An answer's last event, from its worker: the answer, and what only the gateway reads. Its
    id is left out (the key of the answer's stream names it); a worker may leave out the evidence
    and the times (None: the question came without `asked_at`)."""

    type: Literal["done"] = "done"
    answer_id: str = Field("", exclude=True)
    evidence: list[Evidence] = []
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int = 0  # tokens the question added to the cache, with its turn's markers
    worker_ms: float  # from the worker reading the question to the last token

    def answered(self, answer_id: str) -> Answer:
        """The answer as the APIs give it."""
        return Answer(**self.model_dump(include=set(Answer.model_fields) - {"answer_id"}), answer_id=answer_id)


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
    tokens_seen: int = Field(description="Tokens run through the model so far, as the record's `tokens_seen`.")
    progress: float | None = Field(None, description="An upload's share in the cache, 0 to 1 (as `ingest_progress`).")
    eta_s: float | None = Field(None, description="An upload's seconds left to ingest (as `ingest_eta_s`).")


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


class WatchFiredEvent(BaseModel):
    """A watch's condition became true (`streamvqa.protocol.watches`); sent once per firing."""

    type: Literal["watch_fired"] = "watch_fired"
    watch_id: str
    time_s: float = Field(description="Video time of the check that fired: the time of the last frame it saw.")
    probability: float = Field(description="p(yes) at that check, 0 to 1.")
    evidence: list[Evidence] = Field([], description="The frames the check attended to beyond a question about nothing.")


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
    IngestEvent | StateEvent | WarningEvent | MediaErrorEvent | WatchFiredEvent | StartedEvent | BackpressureEvent,
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
    question: QuestionText
    ref: str | None = Field(None, max_length=200, description="The client's own name for the question, echoed back.")


class _AnswerEventHead(BaseModel):
    """The first fields of each `answer_*` event of a stream socket."""

    type: str
    answer_id: str
    ref: str | None = None  # the `ref` of the `ask`, echoed


class AnswerStartedEvent(_AnswerEventHead):
    type: Literal["answer_started"] = "answer_started"


class AnswerTokenEvent(_AnswerEventHead):
    type: Literal["answer_token"] = "answer_token"
    text: str


class AnswerDoneEvent(Answer, _AnswerEventHead):
    """The answer, after `type`, `answer_id` and `ref` (the order of the bases puts them first)."""

    type: Literal["answer_done"] = "answer_done"

    @classmethod
    def of(cls, answer: Answer, ref: str | None) -> AnswerDoneEvent:
        return cls(**answer.model_dump(), ref=ref)


class AnswerErrorEvent(_AnswerEventHead):
    type: Literal["answer_error"] = "answer_error"
    answer_id: str | None = None  # None: the question was refused before it was queued
    code: str
    message: str

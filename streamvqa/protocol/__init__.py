"""The Redis protocol between gateways and workers: keys, bounds, messages and scripts.

Both sides import this package; it imports neither torch nor fastapi. One module per job:

- `keys`: every Redis key, the bounds on what each holds, the cache arithmetic both sides share;
- `media`: a session's media stream entries (`MediaKind`, `MediaEntry`) and the `frames` message;
- `options`: what a client chooses for a session and for each answer;
- `records`: the session record, its states and their legal changes, memory reports, workers;
- `events`: questions, answer and session events, stream socket messages;
- `watches`: a session's watches, and the rule that decides when one fires;
- `scripts`: every Lua script, each named for what it guards.

`docs/protocol.md` lists every key with its owner and bound.
"""

from streamvqa.protocol import scripts
from streamvqa.protocol.events import (
    Answer,
    AnswerDoneEvent,
    AnswerEnvelope,
    AnswerErrorEvent,
    AnswerStartedEvent,
    AnswerTokenEvent,
    AskMessage,
    BackpressureEvent,
    CloseCode,
    DoneEvent,
    ErrorEvent,
    EventEnvelope,
    Evidence,
    IngestEvent,
    MediaErrorEvent,
    Question,
    StartedEvent,
    StartMessage,
    StateEvent,
    TokenEvent,
    WarningEvent,
    WatchFiredEvent,
)
from streamvqa.protocol.keys import (
    ANSWER_MAXLEN,
    ANSWER_TTL_S,
    ASKED_MAXLEN,
    DEFAULT_BUDGET_TOKENS,
    EVENTS_MAXLEN,
    GROUP,
    MAX_QUESTION_TOKENS,
    MEDIA_BACKLOG_ENTRIES,
    MEDIA_CHUNK_BYTES,
    MEDIA_MAXLEN,
    PENDING_MAXLEN,
    POOL_PAGE_TOKENS,
    QUESTIONS_BACKLOG,
    REQUEUE_AFTER_S,
    STREAMER_TTL_S,
    Keys,
    peak_cache_tokens,
    reserved_device_bytes,
    session_peak_tokens,
)
from streamvqa.protocol.media import (
    FRAME_HEADER_BYTES,
    MediaEntry,
    MediaKind,
    frame_message,
    parse_frame_header,
)
from streamvqa.protocol.options import (
    POLICIES,
    POLICY_KNOBS,
    AskOptions,
    QuestionText,
    Sampling,
    SessionOptions,
)
from streamvqa.protocol.records import (
    QUEUE_TIME_BUCKETS_S,
    STEP_SESSIONS_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS_S,
    TRANSITIONS,
    Histogram,
    MemoryReport,
    MemorySpan,
    SessionRecord,
    SessionState,
    SessionWarning,
    WorkerInfo,
    check_transition,
    to_hash,
)
from streamvqa.protocol.watches import Firing, Watch

__all__ = [
    "ANSWER_MAXLEN", "ANSWER_TTL_S", "ASKED_MAXLEN", "DEFAULT_BUDGET_TOKENS", "EVENTS_MAXLEN", "FRAME_HEADER_BYTES",
    "GROUP", "MAX_QUESTION_TOKENS", "MEDIA_BACKLOG_ENTRIES", "MEDIA_CHUNK_BYTES", "MEDIA_MAXLEN", "PENDING_MAXLEN",
    "POLICIES", "POLICY_KNOBS", "POOL_PAGE_TOKENS", "QUEUE_TIME_BUCKETS_S", "QUESTIONS_BACKLOG",
    "STEP_SESSIONS_BUCKETS", "TIME_PER_OUTPUT_TOKEN_BUCKETS_S", "REQUEUE_AFTER_S", "STREAMER_TTL_S", "TRANSITIONS",
    "Answer", "AnswerDoneEvent", "AnswerEnvelope", "AnswerErrorEvent", "AnswerStartedEvent", "AnswerTokenEvent",
    "AskMessage", "AskOptions", "BackpressureEvent", "CloseCode", "DoneEvent", "ErrorEvent", "EventEnvelope",
    "Evidence", "Firing", "Histogram", "IngestEvent", "Keys", "MediaEntry", "MediaErrorEvent", "MediaKind",
    "MemoryReport", "MemorySpan", "Question", "QuestionText", "Sampling", "SessionOptions", "SessionRecord",
    "SessionState", "SessionWarning", "StartMessage", "StartedEvent", "StateEvent", "TokenEvent", "WarningEvent",
    "Watch", "WatchFiredEvent", "WorkerInfo", "check_transition", "frame_message", "parse_frame_header",
    "peak_cache_tokens", "reserved_device_bytes", "scripts", "session_peak_tokens", "to_hash",
]

"""Redis keys, the bounds on what they hold, and the cache arithmetic both sides share
(`docs/protocol.md` lists every key with its owner and bound)."""

from __future__ import annotations

import math

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
EVENTS_MAXLEN = 1000  # a session's recent events (ingest progress, errors, state changes)
STREAMER_TTL_S = 10  # a connection's claim on its session's media (a stream socket, an upload), renewed every third of it
REQUEUE_AFTER_S = 30  # a session queued this long ago without a worker is queued again at its next work

HOST_BUDGET_MULTIPLE = 8  # with recall, the host tier holds this many times the budget unless told
MAX_HOST_BUDGET_TOKENS = 4_000_000

# A cache's memory per token over its keys and values: it also
# holds its keys rotated at their positions (engine/kv_cache.py)
WITH_ROTATED_KEYS = 1.5
# A worker's KV pool is in pages of this many tokens (engine/kv_pool.py): a session reserves whole pages
POOL_PAGE_TOKENS = 64
DEFAULT_BUDGET_TOKENS = 8192  # a bounded session's budget when none is given, unless its model's context leaves less (the engine's: tests/worker/test_session_options.py)


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
    """The cache memory a session reserves on its worker: the whole pages of its worker's KV
    pool that its peak cache takes (keys and values, and a copy of its keys rotated at their
    positions, half as much again; engine/kv_cache.py), and with recall its host tier's index."""
    pages = math.ceil(peak_tokens / POOL_PAGE_TOKENS)
    cache = math.ceil(pages * POOL_PAGE_TOKENS * kv_bytes_per_token * WITH_ROTATED_KEYS)
    return cache + math.ceil(host_tokens * index_bytes_per_host_token)


class Keys:
    """Every Redis key streamvqa uses, under one prefix (tests use a prefix each).

    A session's keys all carry its id as a hash tag (`session:{<id>}...`): on a Redis Cluster
    they live in one slot, so that a script may touch any of them together. The global keys
    (`owner:`, `rate:`, `pending:`, `places:`, `workers`) are one key each, in slots of their
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

    def watches(self, session_id: str) -> str:
        """The session's watches: a hash, watch id -> the watch (`protocol.watches.Watch`) as JSON."""
        return self._of(session_id, "watches")

    def session_data(self, session_id: str) -> tuple[str, ...]:
        """The keys that live and expire with a session: its hash, then media, questions, events,
        snapshot, memory report, asked ids, open sockets, asked questions' text, watches."""
        names = ("media", "questions", "events", "snapshot", "memory", "asked", "sockets", "asked_questions", "watches")
        return (self.session(session_id), *(self._of(session_id, name) for name in names))

    def answer(self, session_id: str, answer_id: str) -> str:
        return self._of(session_id, f"answer:{answer_id}")

    def cancel(self, session_id: str, answer_id: str) -> str:
        """Set when the client that asked left: the answer stops at its next token."""
        return self._of(session_id, f"cancel:{answer_id}")

    def owner(self, owner: str) -> str:
        """The sessions created with one API key (or from one address, without keys)."""
        return f"{self.prefix}owner:{owner}"

    def chat_media(self, owner: str, content_sha256: str) -> str:
        """The id of the session `/v1/chat/completions` made for `owner` and this content (the
        SHA-256 of model, system message and media)."""
        return f"{self.prefix}chat-media:{owner}:{content_sha256}"

    def chat_media_making(self, owner: str, content_sha256: str) -> str:
        """Held (SET NX, a short TTL) by the one request that makes that session."""
        return f"{self.prefix}chat-media:{owner}:{content_sha256}:making"

    def chat_refused(self, session_id: str) -> str:
        """Why the worker refused the media of a session `/v1/chat/completions` made, kept for a
        short while after the session is deleted for it: requests that waited for that media read it."""
        return self._of(session_id, "chat-refused")

    def rate(self, caller: str) -> str:
        return f"{self.prefix}rate:{caller}"

    def pending(self, model: str) -> str:
        return f"{self.prefix}pending:{model}"

    def places(self, model: str) -> str:
        """The sessions of `model` that hold or wait for a place on a worker (not parked, not failed),
        each with when it was admitted and the memory it reserves (`scripts.TAKE_PLACE_LUA`)."""
        return f"{self.prefix}places:{model}"

    def workers(self) -> str:
        return f"{self.prefix}workers"

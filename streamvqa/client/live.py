"""The `frames` stream socket's protocol without its I/O: what to do with each event that comes
back (pause, count, ask, collect answers, fail) and when the stream is over. The sync and async
sessions drive it over their own sockets (docs/streaming.md has the protocol)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from streamvqa.client.models import CLOSE_CODES, Answer, StreamResult, StreamvqaError

MAX_KEPT_ANSWERS = 1000  # the answers a StreamResult keeps (a camera may stream for days)
TIME_TOLERANCE_S = 1e-3  # video times this close to an asking point count as on it
FATAL_ERRORS = ("decode_failed", "empty_stream", "session_error", "bad_message")

EventHandler = Callable[[dict], None]
AnswerHandler = Callable[[Answer], None]


class Pacer:
    """When each frame is due: the first one now, frame t at (t - t0) / speed seconds after it.
    A speed of None sends every frame at once (the gateway's backpressure sets the pace)."""

    def __init__(self, speed: float | None) -> None:
        if speed is not None and not speed > 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self._origin: tuple[float, float] | None = None  # (monotonic time, video time) of the first frame

    def due(self, time_s: float) -> float | None:
        """The monotonic time at which to send the frame at video time `time_s`; None: now."""
        if self.speed is None:
            return None
        if self._origin is None:
            self._origin = (time.monotonic(), time_s)
        wall_s, first_s = self._origin
        return wall_s + (time_s - first_s) / self.speed


class LiveStream:
    """One `frames` stream: sends nothing itself, but says which messages to send.

    With a `question`, asks it on the socket once the cache holds video up to a multiple of
    `every_s` that no answer has seen yet (one question at a time: a point passed while an answer
    is pending is asked when it comes), and once more when the stream has ended and is ingested,
    unless an answer already saw the whole video.
    """

    def __init__(
        self,
        question: str | None = None,
        every_s: float | None = None,
        max_new_tokens: int = 64,
        on_event: EventHandler | None = None,
        on_answer: AnswerHandler | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> None:
        if every_s is not None and not every_s > 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        self.result = StreamResult()
        self.paused = False  # the gateway said to stop sending (`backpressure`)
        self.connection: str | None = None
        self._question = question
        self._every_s = every_s
        self._max_new_tokens = max_new_tokens
        self._sampling = {name: value for name, value in (sampling or {}).items() if value is not None}
        self._on_event = on_event
        self._on_answer = on_answer
        self._answers: deque[Answer] = deque(maxlen=MAX_KEPT_ANSWERS)
        self._next_ask_s = every_s if every_s else math.inf
        self._covered_s: float | None = None  # the video time questions so far have seen (or will)
        self._asked = 0
        self._pending: dict[str, str] = {}  # ref -> question; at most one
        self._ended = False
        self._ingested = False  # ended, and every frame is in the cache
        self._last_error: dict | None = None

    @staticmethod
    def start_message() -> dict:
        return {"type": "start", "format": "frames"}

    def started(self, event: dict) -> None:
        if event.get("type") != "started":
            raise StreamvqaError(None, "bad_reply", f"the gateway answered start with {event}")
        self.connection = event.get("connection")

    def frame_sent(self) -> None:
        self.result.frames_sent += 1

    def end(self) -> dict:
        self._ended = True
        return {"type": "end"}

    @property
    def finished(self) -> bool:
        """The stream ended, every frame is in the cache and every question has its answer."""
        return self._ingested and not self._pending and not self._ask_due()

    def handle(self, event: dict) -> list[dict]:
        """Take one event from the gateway; the messages to send in reply (questions)."""
        if self._on_event:
            self._on_event(event)
        kind = event.get("type")
        if kind == "backpressure":
            self.paused = bool(event["paused"])
        elif kind == "ingest":
            self.result.frames_ingested = event["frames"]
            self.result.video_time_s = event["video_time_s"]
            self.result.frames_dropped = event["dropped"]
        elif kind == "state" and event["state"] == "ingested" and self._ended:
            self._ingested = True
        elif kind == "answer_done":
            answer = Answer.from_json(event, self._pending.pop(event.get("ref", ""), ""))
            self._cover(answer.video_time_s)
            self._answers.append(answer)
            if self._on_answer:
                self._on_answer(answer)
        elif kind == "answer_error":
            raise StreamvqaError(None, event["code"], event["message"])
        elif kind == "error":
            self._last_error = event
            if event["code"] in FATAL_ERRORS and event.get("connection") in (None, self.connection):
                hint = " (this gateway takes no questions on the socket)" if event["code"] == "bad_message" else ""
                raise StreamvqaError(None, event["code"], event["message"] + hint)
        return [self._ask()] if self._ask_due() else []

    def closed(self, code: int | None, reason: str) -> StreamvqaError:
        """The error for a socket the gateway closed before the stream was over."""
        if code == 1007 and self._last_error:
            return StreamvqaError(code, self._last_error["code"], self._last_error["message"])
        name = CLOSE_CODES.get(code or 0, "connection_lost")
        return StreamvqaError(code, name, reason or f"the gateway closed the stream socket ({code})")

    def summary(self) -> StreamResult:
        self.result.answers = list(self._answers)
        return self.result

    def _ask_due(self) -> bool:
        if self._question is None or self._pending:
            return False
        seen_s = self.result.video_time_s
        if self._ingested:
            return self._covered_s is None or seen_s > self._covered_s
        return self.result.frames_ingested > 0 and seen_s + TIME_TOLERANCE_S >= self._next_ask_s

    def _ask(self) -> dict:
        assert self._question is not None
        self._asked += 1
        ref = f"q{self._asked}"
        self._pending[ref] = self._question
        self._cover(self.result.video_time_s)  # the answer sees at least what the cache holds now
        return {
            "type": "ask", "question": self._question, "max_new_tokens": self._max_new_tokens, **self._sampling, "ref": ref,
        }

    def _cover(self, time_s: float) -> None:
        """Answers see the video up to `time_s`: the next question is due at the next multiple of every_s."""
        self._covered_s = time_s if self._covered_s is None else max(self._covered_s, time_s)
        if self._every_s:
            self._next_ask_s = (math.floor((self._covered_s + TIME_TOLERANCE_S) / self._every_s) + 1) * self._every_s

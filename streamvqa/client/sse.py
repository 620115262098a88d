"""Server-Sent Events, decoded line by line (the `text/event-stream` format of the WHATWG spec),
and the two streams the clients read, without their I/O: a session's events and an answer's.

Each reader takes the stream's lines one by one (`take`: a value, or None), says when it is
`done`, reads a reply that came as no event stream (`whole`) and says what a stream that ended
before it was done means (`ended`); each client drives them over its own transport (`read`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

from streamvqa.client.models import Answer, StreamvqaError
from streamvqa.client.wire import checked


@dataclass(frozen=True)
class ServerSentEvent:
    event: str  # "message" when the server named none
    data: str
    id: str | None

    def json(self) -> dict:
        return json.loads(self.data)


class SseDecoder:
    """Feed it the stream's lines without their line endings; it returns each event as it completes."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self.last_event_id: str | None = None

    def feed(self, line: str) -> ServerSentEvent | None:
        if not line:  # a blank line ends the event
            event, data, self._event, self._data = self._event, self._data, "", []
            if not data:
                return None
            return ServerSentEvent(event or "message", "\n".join(data), self.last_event_id)
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        return None


class SessionEvents(SseDecoder):
    """A session's event stream (`GET /sessions/{id}/events`): each event's body as it completes,
    until the event saying the session is gone, which ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.done = False  # the session is gone

    def take(self, line: str) -> dict | None:
        """The body of the event that `line` completes; None when it completes none, or the last."""
        if (event := self.feed(line)) is None:
            return None
        body = event.json()
        self.done = body.get("type") == "gone"
        return None if self.done else body

    @staticmethod
    def whole(response: httpx.Response) -> list[dict]:
        """A refusal as StreamvqaError; a reply that is no event stream has no events."""
        checked(response)
        return []

    def ended(self) -> None:
        """The gateway ended the stream: the events are over."""


class AnswerEvents(SseDecoder):
    """An answer stream (`POST /sessions/{id}/ask` with `stream`): the text of each token as it
    comes, until `answer` holds the whole Answer."""

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question
        self.answer: Answer | None = None

    @property
    def done(self) -> bool:
        return self.answer is not None

    def take(self, line: str) -> str | None:
        """The text that `line` completes, if any; raises on an `error` event."""
        if (event := self.feed(line)) is None:
            return None
        if event.event == "token":
            return event.json()["text"] or None
        if event.event == "done":
            self.answer = Answer.from_json(event.json(), self.question)
        elif event.event == "error":
            body = event.json()
            raise StreamvqaError(None, body.get("code", "answer_failed"), body.get("message", event.data))
        return None  # the final answer, or an event a newer gateway added: nothing for this client

    def whole(self, response: httpx.Response) -> list[str]:
        """A gateway that does not stream answers: the whole text as one piece (a refusal raises)."""
        self.answer = Answer.from_json(checked(response).json(), self.question)
        return [self.answer.answer]

    @staticmethod
    def ended() -> None:
        raise StreamvqaError(None, "answer_incomplete", "the answer stream ended before its final event")

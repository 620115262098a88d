"""Server-Sent Events, decoded line by line (the `text/event-stream` format of the WHATWG spec)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from streamvqa.client.models import Answer, StreamvqaError


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
        self.gone = False

    def body(self, line: str) -> dict | None:
        """The body of the event that `line` completes; None when it completes none, or the last."""
        if (event := self.feed(line)) is None:
            return None
        body = event.json()
        self.gone = body.get("type") == "gone"
        return None if self.gone else body


def answer_event(event: ServerSentEvent, question: str) -> str | Answer:
    """One event of an answer stream: a token's text, or the final answer; raises on `error`."""
    if event.event == "token":
        return event.json()["text"]
    if event.event == "done":
        return Answer.from_json(event.json(), question)
    if event.event == "error":
        body = event.json()
        raise StreamvqaError(None, body.get("code", "answer_failed"), body.get("message", event.data))
    return ""  # an event a newer gateway added: nothing for this client

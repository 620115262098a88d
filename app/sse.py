"""Server-Sent Events: the framing, and a streaming response that keeps idle connections alive."""

import json
import re
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from app.errors import ApiError

EVENT_STREAM = "text/event-stream"
KEEPALIVE = object()  # yielded by a source that waited a while with nothing to send
KEEPALIVE_S = 15  # how long a source waits with nothing to send before it yields KEEPALIVE
_EVENT_ID = re.compile(r"\d{1,20}-\d{1,20}")


def wants_events(request: Request) -> bool:
    return EVENT_STREAM in request.headers.get("accept", "")


def last_event_id(request: Request, default: str) -> str:
    """Where a stream resumes: the `Last-Event-ID` header (browsers send it when they reconnect),
    else `default`; 400 for an id that is not one of ours."""
    given = request.headers.get("last-event-id")
    if given is None:
        return default
    if not _EVENT_ID.fullmatch(given):
        raise ApiError(400, "bad_event_id", "Last-Event-ID must be an event id this API sent (like 1700000000000-0)")
    return given


def frame(event: str, data: object, event_id: str | None = None) -> str:
    """One event: an optional id, its name and one line of JSON."""
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _framed(source: AsyncIterator) -> AsyncIterator[str]:
    yield "retry: 2000\n\n"  # how long a browser waits before it reconnects
    async for item in source:
        yield ": keepalive\n\n" if item is KEEPALIVE else item


def response(source: AsyncIterator, headers: dict[str, str] | None = None) -> StreamingResponse:
    """Stream the frames `source` yields; KEEPALIVE items become comments."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    return StreamingResponse(_framed(source), media_type=EVENT_STREAM, headers=headers)

"""A stream socket's media, from the client's binary messages into the session's media stream.

The socket's reader hands each message to `take` (the client's `end` to `end`); `forward` adds
them in order as `MediaEntry`s (app/media_stream.py), waiting while the worker's backlog is full,
and yields the events the client is to be sent meanwhile (`backpressure`, a bad or skipped frame).
It raises StreamClosed when the socket must close; app/streams.py runs it and sends its events.
"""

import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel
from redis.asyncio import Redis

from app import backlog, media_stream
from streamvqa import protocol
from streamvqa.protocol import (
    BackpressureEvent, CloseCode, Keys, MediaEntry, MediaErrorEvent, MediaKind, SessionRecord, WarningEvent,
    parse_frame_header,
)

INBOX_BYTES = 8 * 1024 * 1024  # bytes read ahead of Redis per socket; the socket is not read while over
PAUSED_MESSAGES = 32  # messages a client may still send after `backpressure`; one more closes it (4429)
ROOM_POLL_S = 0.05  # between looks at a full media backlog (the client is paused meanwhile)

_END = object()  # the client's `end` message, in the inbox
_LEFT = object()  # the client closed the socket: what it sent before is forwarded, then `forward` ends


class StreamClosed(Exception):
    """Close the socket with `code`; `reason` is sent with it (at most 123 bytes)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class MediaForwarder:
    def __init__(
        self, redis: Redis, keys: Keys, record: SessionRecord, connection: str, format: str | None, stream_bytes: int,
        stall_s: float,
    ) -> None:
        self.redis, self.keys, self.record = redis, keys, record
        self.connection, self.format, self.stall_s = connection, format, stall_s
        self._ended = False
        self._stopping = False  # set by `stop`: `forward` ends at its next step even if a cancellation was swallowed
        self._stream_bytes = stream_bytes  # the session's stream bytes in Redis, as far as this socket knows
        self._inbox: asyncio.Queue = asyncio.Queue()  # bounded by INBOX_BYTES, counted in _inbox_bytes
        self._inbox_bytes = 0
        self._inbox_drained = asyncio.Event()
        self._paused = False  # a `backpressure` event told the client to stop
        self._sent_while_paused = 0
        self._last_entry: str | None = None  # the id of the last media entry this socket added

    async def take(self, data: bytes) -> None:
        """A binary message into the inbox, once the inbox is under INBOX_BYTES (meanwhile the
        socket is not read: TCP slows the client)."""
        if self._ended:
            raise StreamClosed(CloseCode.BAD_REQUEST, "media after the end of the stream")
        if self._paused:
            self._sent_while_paused += 1
            if self._sent_while_paused > PAUSED_MESSAGES:
                raise StreamClosed(CloseCode.TOO_MANY, "the client kept sending while paused")
        while self._inbox_bytes > INBOX_BYTES and not self._stopping:
            self._inbox_drained.clear()
            await self._inbox_drained.wait()
        self._inbox_bytes += len(data)
        self._inbox.put_nowait(data)

    def end(self) -> None:
        self._ended = True
        self._inbox.put_nowait(_END)

    def leave(self) -> None:
        self._inbox.put_nowait(_LEFT)

    def stop(self) -> None:
        self._stopping = True
        self.leave()  # a forwarder that outlived its cancellation ends here
        self._inbox_drained.set()

    def after(self) -> asyncio.Future:
        """The id of the last media entry the socket added (None: none), once the messages taken
        so far are in the session's media stream: a question waits in the inbox behind them."""
        waiting = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(waiting)
        return waiting

    async def forward(self) -> AsyncIterator[BaseModel]:
        """Inbox to the media stream, yielding the events for the client; ends once the client
        has left and everything it sent is in the stream."""
        while (item := await self._inbox.get()) is not _LEFT and not self._stopping:
            if isinstance(item, asyncio.Future):
                if not item.done():  # its question's task may have been cancelled
                    item.set_result(self._last_entry)
            elif item is _END:
                await self.add(MediaEntry(MediaKind.END))
            else:
                async for event in self._forward_media(item):
                    yield event
                self._inbox_bytes -= len(item)
                self._inbox_drained.set()

    async def _forward_media(self, message: bytes) -> AsyncIterator[BaseModel]:
        """A `frames` message as one entry, container bytes cut into MEDIA_CHUNK_BYTES; before
        each, while the backlog is full, the client is paused (from full until half full)."""
        try:
            frame_s = parse_frame_header(message) if self.format == "frames" else None
        except ValueError as err:
            yield MediaErrorEvent(code="bad_frame", message=str(err), connection=self.connection)
            return
        kind, size = (MediaKind.DATA, protocol.MEDIA_CHUNK_BYTES) if frame_s is None else (MediaKind.FRAME, len(message))
        for start in range(0, len(message), size):
            data = message[start : start + size]
            if (waiting := await backlog.entries(self.redis, self.keys, self.record.id)) >= backlog.FULL:
                self._paused, self._sent_while_paused = True, 0
                yield BackpressureEvent(paused=True, backlog=waiting)
                yield BackpressureEvent(paused=False, backlog=await self._room())
            if not await self.add(MediaEntry(kind, data=data), len(data), frame_s=frame_s):
                skipped = f"frame at {frame_s:.3f} s skipped: not after the previous frame the session received"
                yield WarningEvent(code="frame_skipped", message=skipped)

    async def _room(self) -> int:
        """The backlog, once it is under half full (or the socket stops)."""
        try:
            waiting = await backlog.wait_for_room(
                self.redis, self.keys, self.record.id, self.stall_s, below=backlog.FULL // 2,
                poll_s=(ROOM_POLL_S, ROOM_POLL_S), stopping=lambda: self._stopping,
            )
        except backlog.SessionGone as err:
            raise StreamClosed(CloseCode.NOT_FOUND, "the session is gone") from err
        except backlog.SessionFailed as err:
            raise StreamClosed(CloseCode.UNDECODABLE, "the session failed") from err
        except backlog.WorkerStalled as err:
            raise StreamClosed(CloseCode.TRY_AGAIN_LATER, "the session's worker stopped reading the stream") from err
        self._paused = False
        return waiting

    async def add(self, entry: MediaEntry, stream_bytes: int = 0, closing: bool = False, frame_s: float | None = None) -> bool:
        """Add a media entry, unless the session is gone or failed or another socket took the
        stream over (then close, unless `closing`); False for a frame not after the last one."""
        offset = self._stream_bytes if entry.kind == MediaKind.DATA else None
        added = await media_stream.add(self.redis, self.keys, self.record, self.connection, entry, stream_bytes, frame_s, offset)
        if isinstance(added, str):  # added: its entry's id
            self._last_entry, added = added, 1
        if added == 1:
            self._stream_bytes += stream_bytes
        if added >= 0 or closing:
            return added == 1
        if added == media_stream.GONE:
            raise StreamClosed(CloseCode.NOT_FOUND, "the session is gone")
        if added == media_stream.NOT_CLAIMED:
            raise StreamClosed(CloseCode.CONFLICT, "another socket took this session's stream over")
        if added == media_stream.BYTES_LOST:
            raise StreamClosed(CloseCode.TRY_AGAIN_LATER, "Redis lost bytes of the stream; connect again and send on from bytes_received")
        raise StreamClosed(CloseCode.UNDECODABLE, "the session failed")

"""A session's media on its way from the media stream to frames with their video times.

The worker's loop knows one interface, `Ingest`; three kinds implement it:

- `worker.upload.UploadIngest`: a file, spooled to disk as its bytes arrive, then sampled;
- `StreamIngest`: a live WebM or fragmented-MP4 byte stream, decoded by a thread of its own
  while the bytes arrive; it survives reconnections;
- `FramesIngest`: live images, one per message, each with its capture time.

Live frames pass through a `FrameQueue` (real time: late frames are dropped, see there). Every
method but an upload's `next_frames` is quick (`frames_block` says which); `worker.threads`
says on which thread the worker runs each. The two live kinds share `_LiveIngest`.
"""

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from streamvqa.protocol import FRAME_HEADER_BYTES, MediaEntry, MediaKind, parse_frame_header
from streamvqa.sampling import FrameSampler
from worker import containers
from worker.buffers import ByteFeed, FeedAborted, FrameQueue
from worker.decode import INTERNAL, DecodeError, Frame, decode_image, decode_stream

log = logging.getLogger(__name__)

MAX_PENDING_STREAMS = 3  # new streams (headers) waiting behind the one being decoded


@dataclass
class LiveLimits:
    feed_bytes: int  # bytes waiting for the decoder
    queue_frames: int  # frames waiting for the engine
    max_lag_s: float  # a frame later than this (behind real time) is dropped
    read_ahead: int  # media entries the worker may read in one turn (frames mode keeps room for them)


@dataclass
class Batch:
    frames: list[Frame]
    lag_s: float = 0.0  # how far behind real time the last frame was appended
    warnings: list[str] = field(default_factory=list)  # things the client should hear about


class Ingest(Protocol):
    """What the worker asks of a session's media, whatever its kind."""

    format: str  # "upload", or the live format: "webm", "mp4", "frames"
    connection: str  # the stream socket whose media arrives (or came last); "" for an upload
    frames_block: bool  # `next_frames` decodes (seconds): the worker runs it ahead, on its decode thread

    @property
    def accepts_media(self) -> bool:
        """Room for the next media entries (the worker reads its media stream only then)."""

    @property
    def expects_media(self) -> bool:
        """More media is to come from a connection: an upload not ended, a live client sending."""

    @property
    def has_work(self) -> bool:
        """Frames (or errors and warnings) to take."""

    @property
    def finished(self) -> bool:
        """Every frame received is taken and no more is expected."""

    @property
    def backlog(self) -> int:
        """Frames received and waiting to be taken (in no snapshot yet)."""

    @property
    def frames_queued(self) -> int:
        """Frames queued for the engine, ever: those taken or dropped are `frames_queued - backlog`."""

    @property
    def dropped(self) -> int:
        """Frames dropped so far because the engine fell behind."""

    def receive(self, entry: MediaEntry) -> None:
        """One media entry; DecodeError when the media cannot go on."""

    def receipt(self, kind: str) -> dict[str, object] | None:
        """Record fields to write as the entry just received is acknowledged, when it is safe
        once received; None: it is acknowledged once a snapshot covers it."""

    def next_frames(self, count: int) -> "Batch":
        """Up to `count` frames, with the warnings since the last call."""

    def take_errors(self) -> list[tuple[str, str, str]]:
        """(code, connection, message) of the errors since the last call."""

    def hold(self, answering: bool) -> None:
        """Its session answers (`answering`), or no longer does: a live stream's frames wait
        meanwhile instead of being dropped as late (`worker.buffers.FrameQueue.hold`)."""

    def state(self) -> dict | None:
        """What a snapshot keeps to go on elsewhere; None when the record has it all."""

    def close(self, delete: bool = True) -> None:
        """Stop, and drop what waits (`delete`: its files too)."""


class _LiveIngest:
    """What both live kinds share: the frame queue, video times that only increase, errors
    raised on the decoder's side and reported by the loop."""

    frames_block = False  # frames are decoded as they arrive; taking them is quick

    def __init__(self, fps: float, max_side: int, limits: LiveLimits) -> None:
        self.fps = fps
        self.max_side = max_side
        self.limits = limits
        self.queue = FrameQueue(limits.queue_frames, limits.max_lag_s)
        self.sampler = FrameSampler(fps)
        self.connection = ""  # the connection whose media is arriving now
        self.ended = False  # the client said the stream is over (until it connects again)
        self.connected = False  # a client is sending (from its `connect` or media to its `disconnect`)
        self._last_time_s = -math.inf  # the last frame kept
        self._errors: deque[tuple[str, str, str]] = deque(maxlen=8)  # (code, connection, message)
        self._warnings: deque[str] = deque(maxlen=8)

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    @property
    def has_work(self) -> bool:
        return len(self.queue) > 0 or bool(self._errors) or bool(self._warnings)

    @property
    def backlog(self) -> int:
        return len(self.queue)

    @property
    def frames_queued(self) -> int:
        return self.queue.queued

    @property
    def settling(self) -> bool:
        """No client is sending: it said `end`, or it went away (it may connect again)."""
        return self.ended or not self.connected

    @property
    def expects_media(self) -> bool:
        return not self.settling

    def receipt(self, kind: str) -> None:
        return None  # its frames are in no file: a snapshot must cover them first

    def hold(self, answering: bool) -> None:
        self.queue.hold(answering)

    def connect(self, connection: str) -> None:
        self.connection = connection
        self.ended = False
        self.connected = True
        self.queue.restart_clock()

    def state(self) -> dict:
        """What a snapshot needs to go on with this stream elsewhere: its sampling clock (and, for
        container streams, the init segment to rejoin at the next fragment)."""
        return {
            "kind": "live", "format": self.format, "next_s": self.sampler.next_s, "last_s": self._last_time_s,
            "connection": self.connection,
        }

    def resume(self, state: dict) -> None:
        self.sampler.next_s = state["next_s"]
        self._last_time_s = state["last_s"]
        self.connection = state.get("connection", "")  # absent from snapshots of older versions

    def take_errors(self) -> list[tuple[str, str, str]]:
        """(code, connection, message) of the errors since the last call: `decode_failed` ends
        the connection's stream, `bad_frame` skips one image."""
        return _take_all(self._errors)

    def next_frames(self, count: int) -> Batch:
        frames, lag_s = self.queue.take(count)
        return Batch(frames, lag_s, _take_all(self._warnings))

    def _fail(self, message: str, code: str = "decode_failed") -> None:
        self._errors.append((code, self.connection, message))


class FramesIngest(_LiveIngest):
    """Images with capture times (the `frames` format). Times must increase: an image at or
    before the last accepted time is skipped with a warning; the rest are sampled at `fps`."""

    format = "frames"

    @property
    def accepts_media(self) -> bool:
        return self.queue.capacity - len(self.queue) >= self.limits.read_ahead

    @property
    def finished(self) -> bool:
        """Every frame received is in the cache (or dropped) and no client is sending."""
        return self.settling and len(self.queue) == 0

    def receive(self, entry: MediaEntry) -> None:
        if entry.kind == MediaKind.CONNECT:
            self.connect(entry.connection)
        elif entry.kind == MediaKind.END:
            self.ended = True
        elif entry.kind == MediaKind.DISCONNECT:
            self.connected = False
        elif entry.kind == MediaKind.FRAME:
            self.connected = True
            self._receive_frame(entry.data)
        else:
            self._fail(f"unexpected media entry {entry.kind!r} in a frames stream", "bad_frame")

    def _receive_frame(self, message: bytes) -> None:
        try:
            time_s = parse_frame_header(message)
        except ValueError as err:
            self._fail(str(err), "bad_frame")
            return
        if time_s <= self._last_time_s:
            self._warnings.append(
                f"frame at {time_s:.3f} s skipped: not after the previous frame ({self._last_time_s:.3f} s)"
            )
            return
        if not self.sampler.keep(time_s):
            self._last_time_s = time_s
            return
        try:
            image = decode_image(message[FRAME_HEADER_BYTES:], self.max_side)
        except DecodeError as err:
            self._fail(f"frame at {time_s:.3f} s: {err}", "bad_frame")
            return
        self._last_time_s = time_s
        if not self.queue.put(Frame(image, time_s), block=False):  # the loop reads only while there is room
            self.queue.dropped += 1

    def close(self, delete: bool = True) -> None:
        self.queue.close()


@dataclass(eq=False)
class _Stream:
    """One container byte stream on its way to the decoder thread."""

    feed: ByteFeed
    connection: str  # the connection that wrote to it last (its errors are reported to it)
    failed: bool = False  # decoding failed: its remaining bytes are dropped


class StreamIngest(_LiveIngest):
    """A WebM or fragmented-MP4 byte stream, decoded while it arrives, across reconnections.

    A connection's bytes continue the stream being decoded, unless they start with a header
    (a new stream: its frames follow the earlier ones in time) or no stream is being decoded
    (after an `end` or a decoding error): then the saved init segment is put before them,
    from their first Cluster (WebM) or `moof` (MP4) on, and decoding resumes there.
    """

    def __init__(self, container_format: str, fps: float, max_side: int, limits: LiveLimits) -> None:
        super().__init__(fps, max_side, limits)
        self.format = container_format
        self.init_segment: bytes | None = None  # the latest stream's bytes before its first fragment
        self._header: bytearray | None = None  # the start of the latest stream, until its first fragment
        self._current: _Stream | None = None  # the stream receiving bytes
        self._pending: deque[_Stream] = deque()  # streams the decoder thread has not started
        self._decoding: _Stream | None = None  # the stream the decoder thread is on
        self._joining = False  # the next data starts a connection
        self._seeking = False  # dropping bytes until a fragment starts
        self._time_base: float | None = None  # added to stream times so that the first frame is at 0
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._decode_streams, name="stream-decoder", daemon=True)
        self._thread.start()

    @property
    def accepts_media(self) -> bool:
        return self._current is None or self._current.feed.room_bytes > 0

    @property
    def finished(self) -> bool:
        """Every byte received is decoded, its frames are in the cache (or dropped), and no
        client is sending. A stream left open by a client that went away counts as decoded once
        its decoder waits for bytes that are not there."""
        with self._wake:
            idle = not self._pending and (self._decoding is None or self._decoding.feed.starved)
        return self.settling and idle and len(self.queue) == 0

    def receive(self, entry: MediaEntry) -> None:
        if entry.kind == MediaKind.CONNECT:
            self.connect(entry.connection)
            self._joining = True
            self._seeking = False
            if self._current is not None and self._current.failed:
                self._end_stream()
        elif entry.kind == MediaKind.DATA:
            self.connected = True
            self._receive_bytes(entry.data)
        elif entry.kind == MediaKind.END:
            self.ended = True
            self._end_stream()
        elif entry.kind == MediaKind.DISCONNECT:  # the client may come back and go on with the same stream
            self.connected = False
        else:
            self._fail(f"unexpected media entry {entry.kind!r} in a {self.format} stream")

    def state(self) -> dict:
        init = self.init_segment.hex() if self.init_segment is not None else None
        return {**super().state(), "time_base": self._time_base, "init": init}

    def resume(self, state: dict) -> None:
        """Go on after a snapshot: the next bytes rejoin the stream at its next fragment."""
        super().resume(state)
        self._time_base = state["time_base"]
        self.init_segment = bytes.fromhex(state["init"]) if state["init"] is not None else None

    def _receive_bytes(self, data: bytes) -> None:
        if self._joining:
            self._joining = False
            if containers.starts_stream(self.format, data):
                self._start_stream()
                self._header = bytearray()
            elif self._current is None:
                self._seeking = True
        elif self._current is None and not self._seeking:
            self._seeking = True  # bytes after an `end` (without a new connection)
        if self._seeking:
            data = self._seek_fragment(data)
        if not data or self._current is None or self._current.failed:
            return  # waiting for a fragment, or dropping the rest of a failed stream
        if self._header is not None:
            self._keep_header(data)
        self._current.connection = self.connection
        self._current.feed.write(data)

    def _seek_fragment(self, data: bytes) -> bytes:
        """The part of `data` from its first fragment on, behind a new stream that starts with the
        init segment; b'' while no fragment has come."""
        if self.init_segment is None:
            self._seeking = False
            self._fail("the stream does not start with a header, and none was seen before")
            self._start_stream(failed=True)  # drop the rest of this connection
            return b""
        at = containers.first_fragment(self.format, data)
        if at is None:
            return b""
        self._seeking = False
        if self._start_stream():
            self._current.feed.write(self.init_segment)
        return data[at:]

    def _keep_header(self, data: bytes) -> None:
        self._header += data
        at = containers.first_fragment(self.format, bytes(self._header))
        if at is not None:
            self.init_segment = bytes(self._header[:at])
            self._header = None
        elif len(self._header) > containers.MAX_INIT_SEGMENT_BYTES:
            self._header = None  # not an init segment; the previous one (if any) stays

    def _start_stream(self, failed: bool = False) -> bool:
        """End the current stream and open a new one (False when refused: too many wait)."""
        self._end_stream()
        with self._wake:
            if not failed and len(self._pending) >= MAX_PENDING_STREAMS:
                self._fail("too many new streams at once")
                failed = True
            self._current = _Stream(ByteFeed(self.limits.feed_bytes), self.connection, failed)
            if not failed:
                self._pending.append(self._current)
                self._wake.notify_all()
        return not failed

    def _end_stream(self) -> None:
        if self._current is not None:
            self._current.feed.end_input()
            self._current = None

    def _decode_streams(self) -> None:
        """The decoder thread: one stream after another, until closed."""
        while True:
            with self._wake:
                self._decoding = None
                self._wake.wait_for(lambda: self._closed or self._pending)
                if self._closed:
                    return
                stream = self._decoding = self._pending.popleft()
            try:
                self._decode(stream.feed)
            except FeedAborted:
                pass
            except Exception as err:
                if not isinstance(err, DecodeError):
                    log.exception("decoding a live stream failed")
                stream.failed = True
                message = str(err) if isinstance(err, DecodeError) else f"decoding failed {INTERNAL}"
                self._errors.append(("decode_failed", stream.connection, message))
            finally:
                stream.feed.abort()

    def _decode(self, feed: ByteFeed) -> None:
        offset: float | None = None

        def keep(stream_time_s: float) -> bool:
            nonlocal offset
            if offset is None:
                if self._time_base is None:
                    self._time_base = -stream_time_s
                offset = self._time_base
                if stream_time_s + offset <= self._last_time_s:  # a new stream restarts its clock
                    offset = self._last_time_s + 1 / self.fps - stream_time_s
            time_s = stream_time_s + offset
            if time_s <= self._last_time_s or not self.sampler.keep(time_s):
                return False
            self._last_time_s = time_s
            return True

        for frame in decode_stream(feed, self.format, self.max_side, keep):
            if not self.queue.put(Frame(frame.image, round(frame.time_s + offset, 6))):
                return  # closed

    def close(self, delete: bool = True) -> None:
        """Stop decoding and drop what waits; the daemon decoder thread ends on its own."""
        with self._wake:
            self._closed = True
            for stream in [*self._pending, self._current, self._decoding]:
                if stream is not None:
                    stream.feed.abort()
            self._wake.notify_all()
        self.queue.close()


def _take_all(items: deque) -> list:
    """Empty a deque that another thread appends to, losing nothing."""
    taken = []
    while items:
        taken.append(items.popleft())
    return taken


def open_live(container_format: str, fps: float, max_side: int, limits: LiveLimits) -> FramesIngest | StreamIngest:
    if container_format == "frames":
        return FramesIngest(fps, max_side, limits)
    return StreamIngest(container_format, fps, max_side, limits)

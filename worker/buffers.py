"""The two bounded buffers of a live stream: bytes on their way into a decoder thread, and
sampled frames on their way from it to the engine."""

import io
import threading
import time
from collections import deque
from collections.abc import Callable

from worker.decode import Frame


class FeedAborted(Exception):
    """The stream was abandoned; the decoder reading it stops."""


class ByteFeed(io.RawIOBase):
    """A pipe of bytes: the worker's loop writes, a decoder thread reads, blocking until bytes
    come or the input ends. The loop writes only while `room_bytes` > 0, so the feed holds at
    most `max_bytes` plus one write."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self._chunks: deque[memoryview] = deque()
        self._held = 0
        self._ended = False
        self._aborted = False
        self._reading = False  # the reader waits for bytes
        self._changed = threading.Condition()

    @property
    def room_bytes(self) -> int:
        return self.max_bytes - self._held

    @property
    def starved(self) -> bool:
        """The reader has taken every byte written and waits for more (which may never come:
        the input has not ended)."""
        with self._changed:
            return self._reading and not self._chunks and not self._ended

    def readable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        with self._changed:
            if self._aborted:
                return 0  # the decoder gave up on this stream
            if self._ended:
                raise ValueError("write after end_input")
            self._chunks.append(memoryview(bytes(data)))
            self._held += len(data)
            self._changed.notify_all()
        return len(data)

    def end_input(self) -> None:
        """No more bytes will come; the reader gets what is left, then b''."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def abort(self) -> None:
        """Drop what is held; the reader raises FeedAborted."""
        with self._changed:
            self._aborted = self._ended = True
            self._chunks.clear()
            self._held = 0
            self._changed.notify_all()

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        with self._changed:
            self._reading = True
            self._changed.wait_for(lambda: self._chunks or self._ended)
            self._reading = False
            if self._aborted:
                raise FeedAborted()
            if not self._chunks:
                return 0
            chunk = self._chunks[0]
            n = min(len(buffer), len(chunk))
            buffer[:n] = chunk[:n]
            if n == len(chunk):
                self._chunks.popleft()
            else:
                self._chunks[0] = chunk[n:]
            self._held -= n
            return n


class FrameQueue:
    """Sampled frames waiting for the engine, at most `capacity`, with the real-time rule.

    The stream's clock starts at its first frame after `restart_clock` (a connection): a frame
    at video time t is due at `start_wall + (t - start_t)`. `take` drops every frame that is
    late by more than `max_lag_s`, except the newest, so an engine slower than the stream sees
    its most recent moments instead of falling further behind. A client that sends faster than
    real time is never dropped: its frames are early, the queue fills and `put` waits, which
    stops the worker reading the stream (backpressure).

    While its session answers a question, its frames cannot enter the cache (a session does one
    thing at a time): `hold` stops the real-time rule meanwhile, and the time held is added to the
    lag allowed afterwards (`grace_s`), shrinking to the lateness of the frames taken as the engine
    catches up. An answer therefore leaves the frames sent meanwhile queued (up to `capacity`), not
    a hole in the cache; only an engine slower than the stream still drops frames.
    """

    def __init__(self, capacity: int, max_lag_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.max_lag_s = max_lag_s
        self.dropped = 0  # frames dropped as late, ever
        self.queued = 0  # frames queued, ever (those taken or dropped: queued - len)
        self._clock = clock
        self._frames: deque[tuple[Frame, float]] = deque()  # (frame, due wall time)
        self._start: tuple[float, float] | None = None  # (wall time, video time) of the clock's start
        self._held_since: float | None = None  # wall time `hold` began; None: not held
        self.grace_s = 0.0  # lag allowed past max_lag_s, for the time the queue was held
        self._closed = False
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def full(self) -> bool:
        return len(self._frames) >= self.capacity

    def restart_clock(self) -> None:
        with self._changed:
            self._start = None

    def put(self, frame: Frame, block: bool = True) -> bool:
        """Queue a frame, waiting while the queue is full of frames on time; False when closed
        (or full and not `block`)."""
        with self._changed:
            self._drop_late()
            while block and self.full and not self._closed:
                self._changed.wait(timeout=0.1)  # queued frames become late as time passes
                self._drop_late()
            if self._closed or self.full:
                return False
            if self._start is None:
                self._start = (self._clock(), frame.time_s)
            start_wall, start_t = self._start
            self._frames.append((frame, start_wall + frame.time_s - start_t))
            self.queued += 1
            return True

    def hold(self, held: bool) -> None:
        """Hold the real-time rule while the session answers (no frame is dropped as late), or
        let it go again, allowing the time held as extra lag."""
        with self._changed:
            now = self._clock()
            if held and self._held_since is None:
                self._held_since = now
            elif not held and self._held_since is not None:
                self.grace_s += now - self._held_since
                self._held_since = None

    def take(self, count: int) -> tuple[list[Frame], float]:
        """Up to `count` frames, oldest first, after dropping late ones; and the lateness (s, >= 0)
        of the last frame taken."""
        with self._changed:
            now = self._clock()
            self._drop_late()
            taken = [self._frames.popleft() for _ in range(min(count, len(self._frames)))]
            lag_s = max(0.0, now - taken[-1][1]) if taken else 0.0
            if taken and self._held_since is None:
                self.grace_s = min(self.grace_s, lag_s)  # caught up by as much as the lag fell
            self._changed.notify_all()
        return [frame for frame, _ in taken], lag_s

    def _drop_late(self) -> None:
        """Drop the frames late by more than `max_lag_s` (and the grace of a hold), except the
        newest; none while held."""
        if self._held_since is not None:
            return
        now = self._clock()
        while len(self._frames) > 1 and now - self._frames[0][1] > self.max_lag_s + self.grace_s:
            self._frames.popleft()
            self.dropped += 1

    def close(self) -> None:
        """Wake a waiting `put` (it returns False) and drop what is queued."""
        with self._changed:
            self._closed = True
            self._frames.clear()
            self._changed.notify_all()

"""A session a worker holds: its engine, its ingest, its media's phase and the work it waits for.

The media's phase is a state machine (`Phase`, its legal moves in `MOVES`); the worker's own
view, finer than the record's `SessionState` that clients read. The lease (`lease_until`,
`lost`) and the bookkeeping marks (`changed`, `memory_stale`, `orphaned`) are not phases: they
hold in any phase. A question asked on a stream socket after media waits for it (`MediaWait`:
docs/protocol.md, "Questions after media").
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from engine import Session
from streamvqa.protocol import SessionRecord
from worker.answer_run import AnswerRun
from worker.ingest import Batch, Ingest
from worker.scheduler import entry_time
from worker.watches import SessionWatches, check_tokens


@dataclass
class MediaWait:
    """What a question asked after media waits for: its media entry, until this worker hands
    it to the session's ingest; then that ingest's frames queued by then (`Ingest.frames_queued`)."""

    entry: tuple[int, int] | None  # the media entry (ms, seq), until taken in
    ingest: Ingest | None = None
    frames: int = 0


class Phase(StrEnum):
    WAITING = "waiting"  # no ingest: no media yet, or an upload given up; the next media opens one
    UPLOADING = "uploading"  # an upload's bytes arrive, into its spool file
    SAMPLING = "sampling"  # the upload is whole; its frames go into the cache
    STREAMING = "streaming"  # a live stream: a client sends, or its frames still wait for the engine
    SETTLED = "settled"  # the live stream's end (or its client's leaving) is reported; it waits for the client
    INGESTED = "ingested"  # the upload's frames are all in the cache; its ingest is closed
    FAILED = "failed"  # the media failed (`Hosted.error` says why); questions are refused


# The legal moves: from each phase, those it may become (staying is no move). A session taken
# over from another worker starts in the phase its record and snapshot say.
MOVES: dict[Phase, frozenset[Phase]] = {
    # bytes come (an upload's, or a live stream's that never said `connect`); a socket connects
    Phase.WAITING: frozenset({Phase.UPLOADING, Phase.STREAMING, Phase.FAILED}),
    # the upload's end came; it was aborted or abandoned (its connection was lost); a socket
    # connects (the bytes were a live stream's that came without their `connect`)
    Phase.UPLOADING: frozenset({Phase.SAMPLING, Phase.WAITING, Phase.STREAMING, Phase.FAILED}),
    # its last frame is in the cache
    Phase.SAMPLING: frozenset({Phase.INGESTED, Phase.FAILED}),
    # the client ended or left, and every frame received is in the cache
    Phase.STREAMING: frozenset({Phase.SETTLED, Phase.FAILED}),
    # a socket connects again, or media comes again
    Phase.SETTLED: frozenset({Phase.STREAMING, Phase.FAILED}),
    # media after the end
    Phase.INGESTED: frozenset({Phase.FAILED}),
    Phase.FAILED: frozenset(),
}

TAKES_MEDIA = frozenset({Phase.WAITING, Phase.UPLOADING, Phase.STREAMING, Phase.SETTLED})  # its media stream is read
INGESTING = frozenset({Phase.UPLOADING, Phase.SAMPLING, Phase.STREAMING})  # its ingest has frames to come
UNREPORTED_STEPS = 64  # ingest steps a session keeps to report while Redis fails (`Hosted.reports`)


@dataclass
class Hosted:
    """A session this worker holds; `worker.scheduler.Work` for the scheduler."""

    record: SessionRecord
    engine: Session
    ingest: Ingest | None = None  # present in the INGESTING phases and SETTLED
    phase: Phase = Phase.WAITING
    error: str | None = None  # why it FAILED
    lost: bool = False  # the lease or the session is gone; dropped at the next turn
    lease_until: float = 0.0  # monotonic time until which the lease surely holds (renewed by the heartbeat)
    unacked: list[bytes] = field(default_factory=list)  # live media entries no snapshot covers yet
    changed: bool = False  # the cache changed since the last snapshot
    lag_s: float = 0.0  # how far behind real time its last live frame was appended
    host_bytes: int = 0  # its host tier's bytes (recall), after its last step
    page_files: dict[int, str] | None = None  # its host pages' files, once its snapshots save them apart
    memory_at: float = 0.0  # monotonic time of its last memory report
    memory_stale: bool = False  # the cache changed after it
    snapshot_at: float = field(default_factory=time.monotonic)
    questions: deque[tuple[bytes, dict[bytes, bytes]]] = field(default_factory=deque)  # read, not started
    waits: dict[bytes, MediaWait] = field(default_factory=dict)  # of those questions, the ones asked after media not yet in
    media_read: tuple[int, int] = (0, 0)  # the last media entry (ms, seq) handed to its ingest
    answer: AnswerRun | None = None  # the answer under way
    batch: asyncio.Future | None = None  # an upload's next frames, being decoded on the decode thread
    active_at: float = field(default_factory=time.monotonic)  # its last question, media or step
    media_at: float = field(default_factory=time.monotonic)  # its last media entry
    orphaned: bool = False  # its media connection is gone while its ingest waits for more (found by the heartbeat)
    # its ingest steps not yet reported (their events, its record): (batch, frames appended); more
    # than one only while Redis fails, and then only the last UNREPORTED_STEPS
    reports: deque[tuple[Batch, int]] = field(default_factory=lambda: deque(maxlen=UNREPORTED_STEPS))
    watches: SessionWatches = field(default_factory=SessionWatches)  # read from Redis between steps

    def move(self, phase: Phase) -> None:
        """ValueError when `MOVES` does not allow it."""
        if phase != self.phase and phase not in MOVES[self.phase]:
            raise ValueError(f"a hosted session may not go from {self.phase} to {phase}")
        self.phase = phase

    def fail(self, message: str) -> None:
        self.move(Phase.FAILED)
        self.error = message

    @property
    def failed(self) -> bool:
        return self.phase is Phase.FAILED

    @property
    def connection(self) -> str | None:
        """The stream socket its media comes (or came last) from; None for an upload or when not
        known (a session resumed without a snapshot)."""
        return (self.ingest.connection or None) if self.ingest is not None else None

    @property
    def held(self) -> bool:
        """Whether the lease surely still holds: a session whose renewal is late (Redis away) is
        left alone, neither read nor snapshotted, until its lease is renewed or lost."""
        return time.monotonic() < self.lease_until and not self.lost

    @property
    def reads_media(self) -> bool:
        return self.phase in TAKES_MEDIA and (self.ingest is None or self.ingest.accepts_media)

    @property
    def next_question_at(self) -> tuple[int, int] | None:
        if self.held and self.answer is None and self.questions and self.media_in(self.questions[0][0]):
            return entry_time(self.questions[0][0])
        return None

    def wait_for_media(self, question_id: bytes, media_id: str) -> None:
        """The question `question_id` starts once media entry `media_id` is in the cache."""
        self.waits[question_id] = MediaWait(entry_time(media_id))
        self._taken_in()

    def took_media(self, entry_id: bytes) -> None:
        """A media entry went to the ingest: the questions that wait for it (or an earlier one)
        now wait for the frames queued so far."""
        self.media_read = max(self.media_read, entry_time(entry_id))
        self._taken_in()

    def _taken_in(self) -> None:
        for wait in self.waits.values():
            if wait.entry is not None and wait.entry <= self.media_read:
                wait.entry, wait.ingest = None, self.ingest
                wait.frames = self.ingest.frames_queued if self.ingest is not None else 0

    def media_in(self, question_id: bytes) -> bool:
        """Whether the media the question waits for (if any) is in the cache, or never will be."""
        wait = self.waits.get(question_id)
        if wait is None or self.failed:
            return True
        if wait.entry is not None:
            return False
        ingest = wait.ingest
        if ingest is None or ingest is not self.ingest:  # closed since: its frames are gone
            return True
        queued = ingest.frames_queued  # before the backlog: a frame queued in between is counted as waiting
        return queued - ingest.backlog >= wait.frames

    @property
    def answering(self) -> bool:
        return self.held and self.answer is not None

    @property
    def frame_tokens(self) -> int:
        return self.engine.frame_tokens

    @property
    def ingest_ready(self) -> bool:
        if not self.held or self.ingest is None or self.failed:
            return False
        if self.ingest.frames_block:
            return self.batch is not None and self.batch.done()
        return self.ingest.has_work

    @property
    def check_due(self) -> bool:
        """A watch is due a check of the video in the cache."""
        if not self.held or self.failed or not self.watches.watches:
            return False
        stats = self.engine.stats()
        return stats.frames > 0 and self.watches.due(stats.video_time_s) is not None

    @property
    def check_tokens(self) -> int:
        return check_tokens(self.watches.due(self.engine.stats().video_time_s))

    @property
    def awaits_media(self) -> bool:
        """Its ingest waits for more from a connection: an upload not ended, a live stream whose
        client has neither ended nor left."""
        return self.ingest is not None and not self.failed and self.ingest.expects_media

    @property
    def busy(self) -> bool:
        """Work is queued or under way: it cannot leave the worker now."""
        return bool(self.answer or self.questions or self.unacked or self.batch) or self.phase in INGESTING or self.check_due

    def holding(self) -> set[bytes]:
        """The entries read and not yet acknowledged that it holds."""
        held = {entry_id for entry_id, _ in self.questions} | set(self.unacked)
        return held | ({self.answer.entry_id} if self.answer is not None else set())

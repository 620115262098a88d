"""A held session's media, from its media stream into its cache: each entry handed to the
session's ingest (`worker.ingest.Ingest`), the frames that are ready appended one step at a time,
the end noticed, a lost connection handled, a failure reported. Each moves the session's phase
(`worker.hosted.Phase`); progress, warnings and errors go to the session's events stream (the
gateway relays them to stream sockets).

An upload's entries are acknowledged once spooled, with its byte count; a live stream's once a
snapshot covers them (`Ingest.receipt` says which).
"""

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from redis.asyncio import Redis

from engine import ContextFull, Frames, Result, SessionStats
from streamvqa import protocol
from streamvqa.protocol import (
    IngestEvent, Keys, MediaEntry, MediaErrorEvent, MediaKind, SessionRecord, SessionState, StateEvent, WarningEvent,
)
from streamvqa.redis_client import FAILURES
from worker import engine_steps
from worker.capacity import Counters
from worker.decode import INTERNAL, DecodeError
from worker.hosted import INGESTING, Hosted, Phase
from worker.ingest import Batch, FramesIngest, LiveLimits, StreamIngest, open_live
from worker.records import RecordWriter, progress
from worker.settings import WorkerSettings
from worker.snapshots import Snapshots
from worker.step_costs import CacheFill, FullStepTimes
from worker.threads import Threads
from worker.upload import UploadIngest

log = logging.getLogger(__name__)


class Appending:
    """Frames a step appends (a session past its context lets its frames go), then reports."""

    def __init__(self, intake: "MediaIntake", taken: list[tuple[str, Hosted, Batch]]) -> None:
        self.intake = intake
        self.taken = taken
        self.appending = [(session_id, hosted, batch) for session_id, hosted, batch in taken
                          if batch.frames and not hosted.record.context_full]
        self.befores = [hosted.engine.stats() for _, hosted, _ in self.appending]

    def work(self) -> list[Frames]:
        return [Frames(hosted.engine, [f.image for f in batch.frames], [f.time_s for f in batch.frames])
                for _, hosted, batch in self.appending]

    async def publish(self, results: list[Result] | Exception) -> None:
        """Each session's frames counted, or its failure; every report sent."""
        intake, counters = self.intake, self.intake.counters
        errors = [results] * len(self.appending) if isinstance(results, Exception) else results
        appended: dict[str, int] = {}
        for (session_id, hosted, batch), before, error in zip(self.appending, self.befores, errors, strict=True):
            if isinstance(error, ContextFull):
                await intake.records.context_full(session_id, hosted, str(error))
            elif error is not None:
                await intake._failed(session_id, hosted, "ingest", error)
                continue
            hosted.changed = True
            stats = hosted.engine.stats()
            appended[session_id] = stats.frames - before.frames
            counters.frames_ingested += appended[session_id]
            counters.evictions += stats.evictions - before.evictions
            hosted.host_bytes = stats.host_bytes
            hosted.lag_s = batch.lag_s
        for session_id, hosted, batch in self.taken:
            if not hosted.failed:
                hosted.reports.append((batch, appended.get(session_id, 0)))
        for session_id, hosted, _ in self.taken:
            await intake._send_reports(session_id, hosted)


class MediaIntake:
    def __init__(
        self, redis: Redis, keys: Keys, settings: WorkerSettings, spool_dir: Path, live_limits: LiveLimits,
        threads: Threads, records: RecordWriter, snapshots: Snapshots, counters: Counters,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.spool_dir = spool_dir
        self.live_limits = live_limits
        self.threads = threads
        self.records = records
        self.snapshots = snapshots
        self.counters = counters
        self.full_steps = FullStepTimes()  # what a step at a full cache took its uploads, for the next

    def spool(self, session_id: str) -> Path:
        return self.spool_dir / f"{session_id}.upload"

    # -- opening -------------------------------------------------------------------------------

    async def reopen(self, session_id: str, hosted: Hosted, live_state: dict | None) -> None:
        """Go on with the media of a session taken over: a live stream from its snapshot's
        `live_state`, an upload not yet in the cache from its spool file."""
        record = hosted.record
        if live_state is not None and live_state.get("kind") == "live":
            hosted.ingest = self._open_live(live_state["format"], record)
            hosted.ingest.resume(live_state)
            hosted.phase = Phase.STREAMING if record.state == SessionState.INGESTING else Phase.SETTLED
        if record.media == "upload" and record.upload_bytes > 0 and record.state == SessionState.INGESTING:
            stats = hosted.engine.stats()
            after_s = stats.video_time_s if stats.frames else None
            try:
                hosted.ingest = await self.threads.decode(
                    UploadIngest.resume, self.spool(session_id), record.upload_bytes, record.upload_ended, record.fps,
                    self.settings.max_frame_side, self.settings.max_upload_bytes, after_s,
                )
                hosted.phase = Phase.SAMPLING if record.upload_ended else Phase.UPLOADING
            except DecodeError as err:
                hosted.fail(str(err))

    def _open_live(self, media_format: str, record: SessionRecord) -> FramesIngest | StreamIngest:
        return open_live(media_format, record.fps, self.settings.max_frame_side, self.live_limits)

    # -- entries -------------------------------------------------------------------------------

    async def receive(self, session_id: str, hosted: Hosted, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Hand a media entry to the session's ingest (opening one for its first media). An entry
        deleted after it was read (no fields), or read before the session failed, is only
        acknowledged."""
        media = self.keys.media(session_id)
        if not fields or hosted.failed:  # nothing takes it now
            await self.records.consume(media, entry_id)
            hosted.took_media(entry_id)  # a question that waits for it waits no more
            return
        hosted.active_at = hosted.media_at = time.monotonic()
        try:
            entry = MediaEntry.read(fields)  # a malformed entry fails its session, not the worker
            if entry.kind == MediaKind.ABORT:  # the gateway gave up on this upload and freed the slot; drop its bytes
                await self.close(hosted)
                hosted.move(Phase.WAITING)
                await self.records.consume(media, entry_id)
                return
            if entry.kind == MediaKind.CONNECT:
                await self._connect(session_id, hosted, entry.format, entry.connection)
            elif hosted.ingest is None:
                hosted.ingest = UploadIngest(
                    self.spool(session_id), hosted.record.fps, self.settings.max_frame_side, self.settings.max_upload_bytes
                )
                hosted.move(Phase.UPLOADING)
            elif hosted.phase is Phase.SETTLED and entry.kind in (MediaKind.DATA, MediaKind.FRAME):
                await self._unsettle(session_id, hosted)  # media again, without a new connection
            await self.threads.media(hosted.ingest.receive, entry)
            receipt = hosted.ingest.receipt(entry.kind)
            if receipt is None:
                hosted.unacked.append(entry_id)
            else:
                if entry.kind == MediaKind.END:
                    hosted.move(Phase.SAMPLING)
                await self.records.consume_upload(session_id, entry_id, receipt)
        except FAILURES:
            raise
        except Exception as err:
            await self.records.consume(media, entry_id)
            await self._failed(session_id, hosted, "receiving media", err)
        finally:
            hosted.took_media(entry_id)  # questions asked after it now wait for its frames

    async def _connect(self, session_id: str, hosted: Hosted, media_format: str, connection: str) -> None:
        """A stream socket connected: keep the session's live ingest (a reconnection) or open one."""
        if hosted.ingest is None or hosted.ingest.format != media_format:
            await self.close(hosted)
            hosted.ingest = self._open_live(media_format, hosted.record)
        await self._unsettle(session_id, hosted, connection)

    async def _unsettle(self, session_id: str, hosted: Hosted, connection: str | None = None) -> None:
        """Ingesting again: the stream socket `connection` connected (by default, media came
        again from the connection that sent last)."""
        hosted.move(Phase.STREAMING)
        await self.records.set(session_id, SessionState.INGESTING)
        await self.records.event(session_id, StateEvent(state=SessionState.INGESTING, connection=connection or hosted.connection))

    # -- frames --------------------------------------------------------------------------------

    def hold_while_answering(self, sessions: Mapping[str, Hosted]) -> None:
        """A session answering (or about to start a question) takes no frames meanwhile: its live
        frames wait for the answer's end instead of being dropped as late (`Ingest.hold`)."""
        for hosted in sessions.values():
            if hosted.ingest is not None:
                hosted.ingest.hold(hosted.answering or hosted.next_question_at is not None)

    def decode_ahead(self, sessions: Mapping[str, Hosted]) -> None:
        """Start decoding the next frames of each ingest that decodes slowly (an upload), on the
        decode thread, while the engine works."""
        for hosted in sessions.values():
            ingest = hosted.ingest
            if hosted.batch is None and ingest is not None and ingest.frames_block and ingest.has_work and hosted.held:
                hosted.batch = self.threads.decode_ahead(ingest.next_frames, self._count(hosted))

    async def frames(self, work: list[tuple[str, Hosted]]) -> Appending | None:
        """The frames ready for each session of a step (decoded ahead, or taken from a live
        queue), appended in the engine step (`engine/step.py`), then reported (`Appending`);
        None when no session's could be taken."""
        taken: list[tuple[str, Hosted, Batch]] = []
        for session_id, hosted in work:
            batch = await self._take(session_id, hosted)
            if batch is not None:
                taken.append((session_id, hosted, batch))
        return Appending(self, taken) if taken else None

    async def step(self, work: list[tuple[str, Hosted]]) -> None:
        """An engine step of these sessions' frames alone (a replay makes room in a live queue)."""
        await engine_steps.run(self.threads, [await self.frames(work)])

    async def _send_reports(self, session_id: str, hosted: Hosted) -> None:
        """The session's step reports not yet sent, oldest first: a Redis failure leaves the rest
        for the next turn (`tend`), so that no ingest event is lost for frames in the cache."""
        if hosted.failed or hosted.ingest is None:  # nothing more to say of its frames
            hosted.reports.clear()
        while hosted.reports:
            await self._report(session_id, hosted, *hosted.reports[0])
            hosted.reports.popleft()

    def _count(self, hosted: Hosted) -> int:
        """Frames for the session's next step: FRAMES_PER_STEP, or fewer to stop at its next
        watch's check (`worker/watches.py`)."""
        most, fps = self.settings.frames_per_step, hosted.record.fps
        if not hosted.watches.watches:
            return most
        stats = hosted.engine.stats()
        return hosted.watches.frames_before_check(stats.video_time_s + 1 / fps if stats.frames else 0.0, fps, most)

    async def _take(self, session_id: str, hosted: Hosted) -> Batch | None:
        """The frames ready for the session's step (None: its ingest failed)."""
        try:
            if hosted.ingest.frames_block:
                batch: Batch = await hosted.batch  # done: the scheduler chose this step for it
                hosted.batch = None
                return batch
            return hosted.ingest.next_frames(self._count(hosted))
        except Exception as err:
            await self._failed(session_id, hosted, "ingest", err)
        return None

    async def _report(self, session_id: str, hosted: Hosted, batch: Batch, appended: int) -> None:
        """After a step: its warnings, the ingest's errors, the frames appended; an upload's end."""
        ingest = hosted.ingest
        for message in batch.warnings:
            await self.records.event(session_id, WarningEvent(code="frame_skipped", message=message))
        for code, connection, message in ingest.take_errors():
            await self.records.event(session_id, MediaErrorEvent(code=code, message=message, connection=connection))
        if appended:
            stats = hosted.engine.stats()
            share, eta_s = self._estimate(hosted, stats)
            lag_s = round(batch.lag_s, 3)
            event = IngestEvent(
                frames=stats.frames, times=[f.time_s for f in batch.frames[:appended]], video_time_s=stats.video_time_s,
                lag_s=lag_s, dropped=ingest.dropped, cache_tokens=stats.cache_tokens, tokens_seen=stats.tokens_seen,
                progress=share, eta_s=eta_s,
            )
            await self.records.event(session_id, event)
            await self.records.set(
                session_id, frames_dropped=ingest.dropped, ingest_lag_s=lag_s, ingest_progress=share, ingest_eta_s=eta_s,
                **progress(hosted.engine),
            )
            await self.records.report_memory(session_id, hosted)
        if hosted.phase is Phase.SAMPLING and ingest.finished:
            await self.finish(session_id, hosted)

    def _estimate(self, hosted: Hosted, stats: SessionStats) -> tuple[float | None, float | None]:
        """An upload's share in the cache and seconds left after a step (`UploadIngest.estimate`);
        what a step at its full cache took is kept for the next upload like it. A live stream has
        no end to estimate."""
        ingest, record, policy = hosted.ingest, hosted.record, hosted.engine.policy
        if not isinstance(ingest, UploadIngest):
            return None, None
        key = (record.model, record.policy, record.budget_tokens, record.recall)
        cache = CacheFill(stats.cache_tokens, stats.tokens_seen, policy.budget_tokens if policy.evicts else None)
        covered_s = stats.video_time_s + 1 / record.fps  # a frame covers 1 / fps
        estimate = ingest.estimate(covered_s, cache, self.full_steps.get(key))
        self.full_steps.learn(key, ingest.full_step_s)
        return estimate

    # -- ends ----------------------------------------------------------------------------------

    async def tend(self, session_id: str, hosted: Hosted) -> None:
        """Between steps: reports a Redis failure held back sent, a connection found gone
        handled, the end of the media noticed."""
        await self._send_reports(session_id, hosted)
        if hosted.orphaned:
            await self._connection_lost(session_id, hosted)
        ingest = hosted.ingest
        if ingest is not None and hosted.phase in INGESTING and hosted.answer is None:
            if ingest.finished and hosted.batch is None and not ingest.has_work:
                await self.finish(session_id, hosted)

    async def finish(self, session_id: str, hosted: Hosted) -> None:
        """All media so far is in the cache: an upload is done (its spool goes once a snapshot
        covers it), a live stream's client ended or left (its ingest stays, for a client that
        connects again)."""
        done = {}  # an upload's progress at its end
        if hosted.phase is Phase.SAMPLING:
            done = {"ingest_progress": 1.0, "ingest_eta_s": 0.0}
            if not await self.snapshots.maybe_take(session_id, hosted, force=True):
                return  # the spool stays until a snapshot covers the whole upload; tried again next turn
            cut = hosted.ingest.cut_short()
            await self.close(hosted)
            stats = hosted.engine.stats()
            if stats.frames == 0:
                ends = ""
                if cut is not None:
                    ends = ": the file was cut short before its first frame" + (f" (it states {cut[1]:.1f} s)" if cut[1] else "")
                await self.fail(session_id, hosted, f"the video has no frames{ends}")
                return
            hosted.move(Phase.INGESTED)
            if cut is not None:
                end_s, duration_s = cut
                where = f"after {end_s:.1f} s of the {duration_s:.1f} s it states" if duration_s else (
                    f"part-way through a packet, after {end_s:.1f} s"  # a container that states no length (MPEG-TS)
                )
                message = (
                    f"the file ends {where} (it was cut short, as by a download or copy that stopped part-way): "
                    f"{stats.frames} frames were ingested, up to {stats.video_time_s:.1f} s; upload the whole file to a "
                    "new session for the rest"
                )
                await self.records.warn(session_id, hosted, "truncated_media", message)
        else:
            hosted.move(Phase.SETTLED)
        if hosted.engine.stats().frames == 0:
            await self.records.set(session_id, SessionState.READY, SessionState.INGESTING)
            message = "the stream ended before any frame could be decoded"
            await self.records.event(session_id, MediaErrorEvent(code="empty_stream", message=message, connection=hosted.ingest.connection))
            return
        await self.records.report_memory(session_id, hosted, force=True)
        await self.records.set(session_id, SessionState.INGESTED, SessionState.INGESTING, **done, **progress(hosted.engine))
        await self.records.event(session_id, StateEvent(state=SessionState.INGESTED, connection=hosted.connection))

    async def find_orphaned(self, sessions: Mapping[str, Hosted]) -> None:
        """Mark the sessions whose ingest waits for media from a connection that no longer holds
        its claim (renewed every STREAMER_TTL_S / 3 while it lives) and sent nothing for as long."""
        now = time.monotonic()
        waiting = [
            (session_id, hosted) for session_id, hosted in sessions.items()
            if hosted.awaits_media and now - hosted.media_at >= protocol.STREAMER_TTL_S
        ]
        if not waiting:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, _ in waiting:
                pipe.exists(self.keys.streamer(session_id))
                pipe.xlen(self.keys.media(session_id))
            found = await pipe.execute()
        for (_, hosted), claimed, backlog in zip(waiting, found[::2], found[1::2], strict=True):
            hosted.orphaned = not claimed and not backlog

    async def _connection_lost(self, session_id: str, hosted: Hosted) -> None:
        """The connection sending the session's media is gone without a word (its gateway died):
        a live stream counts as left (its client may connect again), an upload is given up so
        that it can be sent again."""
        hosted.orphaned = False
        if hosted.phase is Phase.STREAMING:
            await self.threads.media(hosted.ingest.receive, MediaEntry(MediaKind.DISCONNECT))
            log.info("session %s: its stream's connection is gone", session_id)
            return
        if hosted.phase is not Phase.UPLOADING or not await self.records.abandon_upload(session_id):
            return
        await self.close(hosted)
        hosted.move(Phase.WAITING)
        message = "the upload stopped part-way (its connection was lost); upload the file again"
        await self.records.event(session_id, MediaErrorEvent(code="upload_abandoned", message=message))
        log.info("session %s: %s", session_id, message)

    async def fail(self, session_id: str, hosted: Hosted, message: str) -> None:
        """The session's media failed: it takes no more (questions are refused), and it lets its
        place go once the questions it had are answered."""
        hosted.fail(message)
        if hosted.unacked:  # nothing will ever replay them
            await self.records.consume(self.keys.media(session_id), *hosted.unacked)
            hosted.unacked = []
        await self.close(hosted)
        await self.records.set(session_id, SessionState.ERROR, error=message)
        await self.records.event(session_id, MediaErrorEvent(code="session_error", message=message))
        log.info("session %s failed: %s", session_id, message)

    async def _failed(self, session_id: str, hosted: Hosted, doing: str, err: BaseException) -> None:
        """The session fails for `err`, raised while `doing`: a DecodeError says why to the user;
        anything else is the worker's fault, logged, and the user told no more than that."""
        if isinstance(err, DecodeError):
            await self.fail(session_id, hosted, str(err))
            return
        log.error("session %s: %s failed", session_id, doing, exc_info=err)
        await self.fail(session_id, hosted, f"{doing} failed {INTERNAL}")

    async def close(self, hosted: Hosted, delete: bool = True) -> None:
        """Close the session's ingest (one that decodes slowly after the frames being decoded, on
        the same thread)."""
        ingest, batch, hosted.ingest, hosted.batch = hosted.ingest, hosted.batch, None, None
        if batch is not None:
            batch.add_done_callback(lambda done: done.cancelled() or done.exception())  # its result is not wanted
        if ingest is None:
            return
        if ingest.frames_block:
            await self.threads.decode(ingest.close, delete)
        else:
            ingest.close(delete)

"""The worker's loop: take sessions by lease, then run their work one bounded engine step at a time.

One event loop does all Redis I/O (`worker.threads` says what runs beside it). A turn is the
four of docs/architecture.md, "Worker": sessions taken and dropped, one XREADGROUP of every
stream the worker owns, one engine step (`worker.scheduler` fills it, `worker.engine_steps`
runs it), each session tended. The loop only composes; each job is a module of its own.
"""

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
import uuid

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from engine import Model, trim_heap
from streamvqa import protocol
from streamvqa.protocol import ErrorEvent, Keys
from streamvqa.redis_client import FAILURES, xreadgroup
from worker import engine_steps
from worker.answering import Answering
from worker.capacity import Capacity, Counters
from worker.claims import Claims
from worker.hosted import Hosted, Phase
from worker.ingest import LiveLimits
from worker.intake import MediaIntake
from worker.leases import Leases
from worker.pins import PinCosts
from worker.records import RecordWriter
from worker.scheduler import Scheduler, Step
from worker.settings import WorkerSettings
from worker.snapshots import Snapshots, SnapshotStore, sweep
from worker.threads import Threads
from worker.watches import Watching

log = logging.getLogger(__name__)

READ_COUNT = 8  # entries per stream per turn
RECOVER_COUNT = 256  # pending entries per stream read again after a failed read (more than a stream holds unacknowledged)
IDLE_BLOCK_MS = 250  # how long an idle turn waits for new entries (and new sessions wait to be taken)
LIVE_BLOCK_MS = 50  # the same while a live stream is open (its frames come from a decoder thread)
DECODING_BLOCK_MS = 10  # the same while an upload's next frames are being decoded
MAX_BACKOFF_S = 5.0  # longest wait between retries while Redis fails
STOP_GRACE_S = 5.0  # on SIGTERM, answers under way may go on this long before they are cut (session_reset)
SWEEP_INTERVAL_S = 60.0  # how often spool and snapshot files of sessions that are gone are deleted


def prefix_folder(prefix: str) -> str:
    """A folder name for a key prefix, so that deployments sharing SPOOL_DIR or SNAPSHOT_DIR
    never touch each other's files."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", prefix.rstrip(":")) or "_"


class Worker:
    def __init__(self, settings: WorkerSettings, model: Model, threads: Threads, redis: Redis, reader: Redis) -> None:
        """`threads`: those the model was loaded on (worker/threads.py). `reader` reads the
        streams (XREADGROUP): a client that never retries a command by itself (a lost reply's
        entries are read again from the worker's pending entries)."""
        self.settings = settings
        self.model = model
        self.redis = redis
        self.reader = reader
        self._reread = False  # a read failed: entries it delivered may be pending unseen
        # a restarted process never reuses a dead one's id (containers restart with the same pid)
        self.id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.keys = keys = Keys(settings.redis_prefix)
        self.sessions: dict[str, Hosted] = {}  # at most settings.max_sessions
        self._stopping = asyncio.Event()
        self._swept_at = 0.0
        self.scheduler = Scheduler(settings.batch_sessions, settings.step_tokens, settings.frames_per_step)
        self._failing_since: float | None = None  # monotonic time the loop's turns began to fail
        self.threads = threads
        self.capacity = Capacity(settings, model)
        self.capacity.make_pool()
        self.counters = counters = Counters()
        self.spool_dir = settings.spool_dir / prefix_folder(settings.redis_prefix)
        self.store = SnapshotStore(
            redis, keys, settings.snapshot_dir / prefix_folder(settings.redis_prefix),
            settings.snapshot_redis_max_bytes, settings.session_ttl_s, self.id,
        )
        self.leases = Leases(
            redis, keys, self.id, model.name, settings.lease_ttl_s, settings.max_sessions, self.capacity, counters,
            PinCosts.of(model),
        )
        self.records = records = RecordWriter(redis, keys, settings.session_ttl_s, threads)
        self.snapshots = Snapshots(self.store, records, threads, settings.snapshot_interval_s)
        live_limits = LiveLimits(
            settings.live_feed_bytes, settings.live_queue_frames, settings.live_max_lag_s, read_ahead=READ_COUNT
        )
        self.intake = MediaIntake(
            redis, keys, settings, self.spool_dir, live_limits, threads, records, self.snapshots, counters
        )
        self.answering = Answering(redis, keys, model, threads, records, counters)
        self.watching = Watching(redis, keys)
        self.claims = Claims(
            redis, self.reader, keys, model, settings.max_sessions, self.sessions, threads, self.leases,
            self.capacity, self.store, records, self.intake, self.answering,
        )

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        backoff_s = 0.1
        while True:  # Redis may not be up yet; a stop while it is not ends the worker at once
            try:
                await self.claims.ensure_queue()
                await self._advertise()
                break
            except FAILURES as err:
                log.warning("Redis unreachable (%s); retrying in %.1f s", err, backoff_s)
                if await self._stopped_within(backoff_s):
                    self.threads.shutdown()
                    return
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info(
            "worker %s serves %s (at most %d sessions, %d MiB for their caches, %d MiB for host tiers)",
            self.id, self.model.name, self.settings.max_sessions, self.capacity.kv_memory_bytes // 2**20,
            self.capacity.host_memory_bytes // 2**20,
        )
        backoff_s = 0.1
        try:
            while not self._stopping.is_set():
                try:
                    await self._turn()
                    backoff_s, self._failing_since = 0.1, None
                except FAILURES as err:
                    self._failing_since = self._failing_since or time.monotonic()
                    if isinstance(err, ResponseError) and "NOGROUP" in str(err):  # Redis lost its data
                        log.warning("a stream or its group is gone (%s); repairing", err)
                        try:
                            await self._repair()
                        except FAILURES as again:
                            log.warning("Redis failed again (%s)", again)
                    else:
                        log.warning("Redis failed (%s); retrying in %.1f s", err, backoff_s)
                    await self._stopped_within(backoff_s)
                    backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        finally:
            self._stopping.set()
            heartbeat.cancel()
            await self._shutdown()

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait `seconds` between retries, or less when the worker is told to stop: whether it was."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    # -- one turn ------------------------------------------------------------------------------

    async def _turn(self) -> None:
        await self._drop_lost()
        await self.claims.take_new(IDLE_BLOCK_MS)
        if not self.sessions:
            return
        self.intake.decode_ahead(self.sessions)
        streams = self._streams_to_read()
        if not streams:  # every lease is waiting to be renewed
            await asyncio.sleep(IDLE_BLOCK_MS / 1000)
            return
        if self._reread:
            await self._take_entries(await self._read({stream: "0" for stream in streams}, RECOVER_COUNT, None), seen=True)
            self._reread = False
        await self._take_entries(await self._read(streams, READ_COUNT, self._block_ms()))
        await self.watching.refresh(self.sessions)  # after the media read: a watch made before it is known before its frames
        self.intake.hold_while_answering(self.sessions)
        step = self.scheduler.next_step(self.sessions)
        if step is not None:
            await self._run_step(step)
        await self._tend()

    async def _take_entries(self, reply: list, seen: bool = False) -> None:
        """Queue the questions read and hand the media to the ingests. With `seen`, the reply is
        the worker's own pending entries: those it holds already are skipped, the others (a
        failed read delivered them) are taken in order."""
        entries = {key.decode(): rows for key, rows in reply}
        now = time.monotonic()
        for session_id, hosted in list(self.sessions.items()):
            known = hosted.holding() if seen else set()
            for entry_id, fields in entries.get(self.keys.questions(session_id), []):
                if entry_id not in known:
                    await self.answering.queue(session_id, hosted, entry_id, fields)
                    hosted.active_at = now
            for entry_id, fields in entries.get(self.keys.media(session_id), []):
                if entry_id not in known:
                    await self.intake.receive(session_id, hosted, entry_id, fields)

    def _block_ms(self) -> int | None:
        """How long this turn's read may wait for new entries: not at all while a step is ready."""
        hosted = self.sessions.values()
        if self.scheduler.peek(self.sessions) is not None:
            return None
        if any(h.batch is not None for h in hosted):
            return DECODING_BLOCK_MS
        if any(h.phase is Phase.STREAMING for h in hosted):
            return LIVE_BLOCK_MS
        return IDLE_BLOCK_MS

    async def _run_step(self, step: Step) -> None:
        """The step's parts prepared (questions and frames taken), run as one engine step, and
        their results published (`worker/engine_steps.py`)."""
        now = time.monotonic()
        for session_id in step.sessions:
            self.sessions[session_id].active_at = now
        self.counters.steps += 1
        self.counters.step_sessions += len(step.sessions)
        self.counters.step_batch_sessions.observe(len(step.sessions))
        work = lambda ids: [(session_id, self.sessions[session_id]) for session_id in ids]  # noqa: E731
        parts = [
            await self.answering.starts(work(step.starts)),
            await self.answering.tokens(work(step.answers)),
            await self.watching.checks(work(step.checks)),
            await self.intake.frames(work(step.frames)),
        ]
        await engine_steps.run(self.threads, parts)

    async def _tend(self) -> None:
        """What each session needs between steps: its media tended, a snapshot, a memory report;
        an idle or failed session lets its place go."""
        now = time.monotonic()
        release_s = self.settings.idle_release_s
        for session_id, hosted in list(self.sessions.items()):
            if not hosted.held:
                continue
            await self.intake.tend(session_id, hosted)
            await self.snapshots.maybe_take(session_id, hosted)
            if hosted.memory_stale:
                await self.records.report_memory(session_id, hosted)
            idle = release_s > 0 and now - hosted.active_at >= release_s
            if not hosted.busy and (hosted.failed or idle):
                await self._park(session_id, hosted)

    async def _read(self, streams: dict[str, str], count: int, block_ms: int | None) -> list:
        """XREADGROUP; when a stream or its group is gone (a deleted session, a Redis that lost
        its data), repair what can be repaired and read nothing this turn."""
        try:
            return await xreadgroup(self.reader, protocol.GROUP, self.id, streams, count, block_ms)
        except ResponseError as err:
            if "NOGROUP" in str(err) and await self._repair():
                return []
            raise
        except FAILURES:
            self._reread = True  # its reply may have been lost after Redis delivered entries
            raise

    def _streams_to_read(self) -> dict[str, str]:
        """Every held session's questions (while fewer than the backlog wait here), and its
        media unless it is done or its ingest is full."""
        streams = {}
        for session_id, hosted in self.sessions.items():
            if not hosted.held:
                continue
            if len(hosted.questions) < protocol.QUESTIONS_BACKLOG:
                streams[self.keys.questions(session_id)] = ">"
            if hosted.reads_media:
                streams[self.keys.media(session_id)] = ">"
        return streams

    # -- sessions leaving ----------------------------------------------------------------------

    async def _drop_lost(self) -> None:
        """Forget the sessions whose lease or data is gone; a deleted or expired session's files go too."""
        lost = [session_id for session_id, hosted in self.sessions.items() if hosted.lost]
        for session_id in lost:
            await self.leases.release(session_id)
            gone = not await self.redis.exists(self.keys.session(session_id))
            if gone:  # deleted or expired (a lost lease: the next owner's files)
                self.store.delete_file(session_id)
            await self._drop(session_id, delete_spool=gone)
        if lost:
            await self._advertise()

    async def _drop(self, session_id: str, delete_spool: bool = False) -> None:
        """Forget a session this worker no longer holds; its upload spool stays for the next
        holder unless `delete_spool`."""
        hosted = self.sessions.pop(session_id)
        await self.answering.drop(hosted)
        await self.intake.close(hosted, delete=delete_spool)
        await self.threads.engine(hosted.engine.release)  # its pages back to the pools (in RAM, to the operating system)
        await self.threads.engine(trim_heap)  # and what its steps and decoding left free in the C heap
        log.info("dropped session %s", session_id)

    async def _park(self, session_id: str, hosted: Hosted) -> None:
        """Let an idle or failed session go: snapshotted, its lease released, out of the model's
        admitted sessions. Refused while work arrives for it (it stays, and waits another idle period)."""
        if not hosted.failed and not await self.snapshots.maybe_take(session_id, hosted, force=True):
            return
        if not await self.leases.park(session_id, hosted.failed):
            hosted.active_at = time.monotonic()
            return
        await self._drop(session_id)
        await self._advertise()
        log.info("session %s left this worker (%s)", session_id, "failed" if hosted.failed else "idle")

    async def _repair(self) -> bool:
        """Recreate the pending queue's group if it is gone and give up every session whose
        data is gone; True when either was needed."""
        repaired = await self.claims.ensure_queue()
        for session_id, hosted in self.sessions.items():
            if await self.redis.exists(*self.keys.session_data(session_id)[:3]) < 3:
                hosted.lost = repaired = True
        return repaired

    # -- heartbeat and shutdown ----------------------------------------------------------------

    async def _advertise(self) -> None:
        await self.leases.advertise(self.sessions, self.claims.claiming)

    @property
    def _failing(self) -> bool:
        """The loop's turns have failed for longer than a lease: the worker cannot serve."""
        return self._failing_since is not None and time.monotonic() - self._failing_since > self.settings.lease_ttl_s

    async def _heartbeat(self) -> None:
        """Renew leases and the worker's advertisement; mark sessions whose lease was lost; sweep
        files now and then. A worker whose loop keeps failing stops advertising and renewing, so
        that it is not counted as ready and its sessions go to a worker that can serve them. Ends
        once the worker stops (a flag, not only cancellation: redis-py can swallow a cancellation
        that lands inside a command)."""
        while not self._stopping.is_set():
            await asyncio.sleep(self.settings.lease_ttl_s / 3)
            if self._stopping.is_set():
                return
            if self._failing:
                log.warning("the loop has failed for %.0f s; not advertising", time.monotonic() - self._failing_since)
                continue
            try:
                await self._advertise()
                for session_id, hosted in list(self.sessions.items()):
                    await self.leases.renew(session_id, hosted)
                await self.leases.forget_dead_workers()
                await self.intake.find_orphaned(self.sessions)
                if time.monotonic() - self._swept_at >= SWEEP_INTERVAL_S:
                    self._swept_at = time.monotonic()
                    await sweep(self.redis, self.keys, [self.spool_dir, self.store.directory])
            except FAILURES as err:
                log.warning("heartbeat: Redis failed (%s)", err)
            except Exception:
                log.exception("heartbeat failed")

    async def _shutdown(self) -> None:
        """Hand every session over: answers under way finish (for up to STOP_GRACE_S, then end
        with `session_reset`), then each session is snapshotted, its lease released and queued
        for another worker (or this one, restarted); questions not begun wait for that worker.
        Then leave the registry."""
        try:
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and any(h.answering for h in self.sessions.values()):
                await self._run_step(Step(answers=tuple(session_id for session_id, h in self.sessions.items() if h.answering)))
            for session_id, hosted in list(self.sessions.items()):
                if hosted.answer is not None:
                    message = "the worker stopped while answering; ask again"
                    await self.answering.cancel(session_id, hosted, ErrorEvent(code="session_reset", message=message))
                for _ in range(self.settings.live_queue_frames):  # frames already read go into the snapshot
                    if hosted.ingest is None or not hosted.ingest.backlog:
                        break
                    await self._run_step(Step(frames=(session_id,)))
                await self.snapshots.maybe_take(session_id, hosted, force=True)
                await self.leases.release(session_id)
                await self.leases.requeue(session_id)
                await self._drop(session_id)
            await self.leases.withdraw()
        except FAILURES as err:
            log.warning("shutdown: Redis failed (%s)", err)
        finally:
            self.threads.shutdown()

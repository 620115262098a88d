"""The worker's loop: take sessions by lease, then run their work one bounded engine step at a time.

One event loop does all Redis I/O. The engine runs on one thread of its own (one model, one
device); media entries are handled on a media thread, uploads are sampled on a decode thread
(the next frames are decoded while the engine works), and each live container stream has a
decoder thread of its own. Each turn reads every stream the worker owns in one XREADGROUP (on a
Redis Cluster, one per slot, at once), without waiting while there is work, queues the
questions it got, hands the media to each session's ingest, and runs one engine step that
`worker.scheduler` chooses: a question's start first, otherwise the sessions' answers and
frames in turn, one step each. Ingest progress, warnings and errors go to the session's events
stream (the gateway relays them to stream sockets).
A session idle for IDLE_RELEASE_S leaves the worker (snapshotted) and comes back at its next
question or media, so idle sessions do not hold a worker's places.
"""

import asyncio
import logging
import os
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from engine import ContextFull, Model, Session, SessionConfig
from engine.host_tier import index_bytes_per_token
from streamvqa import protocol
from streamvqa.pending import enqueue, leave
from streamvqa.redis_client import FAILURES, xreadgroup
from streamvqa.protocol import (
    AnswerEnvelope,
    DoneEvent,
    ErrorEvent,
    EventEnvelope,
    IngestEvent,
    Keys,
    MediaEntry,
    MediaErrorEvent,
    MediaKind,
    MemoryReport,
    MemorySpan,
    Question,
    SessionRecord,
    SessionState,
    StateEvent,
    TokenEvent,
    WarningEvent,
    WorkerInfo,
    check_transition,
    scripts,
)
from worker.answering import AnswerRun, engine_sampling
from worker.decode import INTERNAL, DecodeError
from worker.ingest import Batch, FramesIngest, LiveLimits, StreamIngest, UploadIngest, open_live
from worker.scheduler import Step, entry_time, next_step
from worker.settings import WorkerSettings
from worker.snapshots import SnapshotStore

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_COUNT = 8  # entries per stream per turn
RECOVER_COUNT = 256  # pending entries per stream read again after a failed read (more than a stream holds unacknowledged)
IDLE_BLOCK_MS = 250  # how long an idle turn waits for new entries (and new sessions wait to be taken)
LIVE_BLOCK_MS = 50  # the same while a live stream is open (its frames come from a decoder thread)
DECODING_BLOCK_MS = 10  # the same while an upload's next frames are being decoded
PENDING_POLL_S = 0.1  # how often a busy worker looks for new sessions
MAX_BACKOFF_S = 5.0  # longest wait between retries while Redis fails
DEAD_WORKER_FORGET_S = 3600  # workers silent this long leave the registry
SNAPSHOT_AFTER_ENTRIES = protocol.MEDIA_BACKLOG_ENTRIES // 2  # unacknowledged live media that forces a snapshot
MEMORY_INTERVAL_S = 1.0  # the shortest time between two memory reports of a session while it ingests
STOP_GRACE_S = 5.0  # on SIGTERM, answers under way may go on this long before they are cut (session_reset)
SWEEP_INTERVAL_S = 60.0  # how often spool and snapshot files of sessions that are gone are deleted
SWEEP_MIN_AGE_S = 60.0  # a file younger than this is never deleted by a sweep


def available_kv_memory(device: torch.device) -> int:
    """Memory the sessions' caches may use: 90% of the GPU's free memory (the model is loaded by
    now), or half the RAM available on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def available_host_memory(device: torch.device) -> int:
    """Host memory the sessions' host tiers may use: half the RAM available beside a GPU, a
    quarter on a CPU (where the caches take half)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2 if device.type == "cuda" else available // 4


def prefix_folder(prefix: str) -> str:
    """A folder name for a key prefix, so that deployments sharing SPOOL_DIR or SNAPSHOT_DIR
    never touch each other's files."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", prefix.rstrip(":")) or "_"


def _live_connection(hosted: "Hosted") -> str | None:
    """The stream connection a live session's media comes (or came last) from; None for an upload
    or when not known (a session resumed without a snapshot)."""
    ingest = hosted.ingest
    return (ingest.connection or None) if ingest is not None and ingest.live else None


@dataclass
class Hosted:
    """A session this worker holds; `worker.scheduler.Work` for the scheduler."""

    record: SessionRecord
    engine: Session
    ingest: UploadIngest | FramesIngest | StreamIngest | None = None
    media_closed: bool = False  # the upload ended, failed or was aborted: no more media is read
    settled: bool = False  # a live stream's end (or its client's leaving) was reported, until media comes again
    error: str | None = None
    lost: bool = False  # the lease or the session is gone; dropped at the next turn
    lease_until: float = 0.0  # monotonic time until which the lease surely holds (renewed by the heartbeat)
    unacked: list[bytes] = field(default_factory=list)  # live media entries no snapshot covers yet
    changed: bool = False  # the cache changed since the last snapshot
    lag_s: float = 0.0  # how far behind real time its last live frame was appended
    host_bytes: int = 0  # its host tier's bytes (recall), after its last step
    memory_at: float = 0.0  # monotonic time of its last memory report
    memory_stale: bool = False  # the cache changed after it
    snapshot_at: float = field(default_factory=time.monotonic)
    questions: deque[tuple[bytes, dict[bytes, bytes]]] = field(default_factory=deque)  # read, not started
    answer: AnswerRun | None = None  # the answer under way
    batch: asyncio.Future | None = None  # an upload's next frames, being decoded on the decode thread
    active_at: float = field(default_factory=time.monotonic)  # its last question, media or step
    media_at: float = field(default_factory=time.monotonic)  # its last media entry
    orphaned: bool = False  # its media connection is gone while its ingest waits for more (found by the heartbeat)

    @property
    def held(self) -> bool:
        """Whether the lease surely still holds: a session whose renewal is late (Redis away) is
        left alone, neither read nor snapshotted, until its lease is renewed or lost."""
        return time.monotonic() < self.lease_until and not self.lost

    @property
    def reads_media(self) -> bool:
        return not self.media_closed and (self.ingest is None or self.ingest.accepts_media)

    @property
    def next_question_at(self) -> tuple[int, int] | None:
        if self.held and self.answer is None and self.questions:
            return entry_time(self.questions[0][0])
        return None

    @property
    def answering(self) -> bool:
        return self.held and self.answer is not None

    @property
    def ingest_ready(self) -> bool:
        if not self.held or self.ingest is None or self.error:
            return False
        if self.ingest.live:
            return self.ingest.has_work
        return self.batch is not None and self.batch.done()

    @property
    def awaits_media(self) -> bool:
        """Its ingest waits for more from a connection: an upload not ended, a live stream whose
        client has neither ended nor left."""
        if self.ingest is None or self.error:
            return False
        return not self.ingest.settling if self.ingest.live else not self.media_closed

    @property
    def busy(self) -> bool:
        """Work is queued or under way: it cannot leave the worker now."""
        live_open = self.ingest is not None and not (self.ingest.live and self.settled)
        return bool(self.answer or self.questions or self.unacked or self.batch) or (live_open and not self.error)


class Worker:
    def __init__(self, settings: WorkerSettings, model: Model, redis: Redis, reader: Redis | None = None) -> None:
        """`reader` reads the streams (XREADGROUP): a client that never retries a command by
        itself (a lost reply's entries are read again from the worker's pending entries)."""
        self.settings = settings
        self.model = model
        self.redis = redis
        self.reader = reader or redis
        self._reread = False  # a read failed: entries it delivered may be pending unseen
        # a restarted process never reuses a dead one's id (containers restart with the same pid)
        self.id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.keys = Keys(settings.redis_prefix)
        self.sessions: dict[str, Hosted] = {}  # at most settings.max_sessions
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._decode_thread = ThreadPoolExecutor(1, thread_name_prefix="decode")  # uploads' frames
        self._media_thread = ThreadPoolExecutor(1, thread_name_prefix="media")  # media entries into ingests
        self._stopping = asyncio.Event()
        self._update = redis.register_script(scripts.UPDATE_RECORD_LUA)
        self._renew = redis.register_script(scripts.RENEW_LEASE_LUA)
        self._release = redis.register_script(scripts.RELEASE_LUA)
        self._requeue_script = redis.register_script(scripts.REQUEUE_LUA)
        self._take_lease = redis.register_script(scripts.TAKE_LEASE_LUA)
        self._upload_ack = redis.register_script(scripts.UPLOAD_ACK_LUA)
        self._set_if_live = redis.register_script(scripts.SET_IF_LIVE_LUA)
        self._publish_script = redis.register_script(scripts.PUBLISH_ANSWER_LUA)
        self._park_script = redis.register_script(scripts.PARK_LUA)
        self._abandon_upload = redis.register_script(scripts.ABANDON_UPLOAD_LUA)
        self._claiming: set[str] = set()  # sessions being opened: advertised, not yet held
        self.frames_ingested = self.evictions = self.answers = 0  # since start, advertised for GET /metrics
        # brought back from host tiers for questions, since start
        self.retrieved_tokens = self.retrieved_pages = 0
        self.retrieval_ms = 0.0
        self.spool_dir = settings.spool_dir / prefix_folder(settings.redis_prefix)
        self.snapshots = SnapshotStore(
            redis, self.keys, settings.snapshot_dir / prefix_folder(settings.redis_prefix),
            settings.snapshot_redis_max_bytes, settings.session_ttl_s,
        )
        self._lease_ms = int(settings.lease_ttl_s * 1000)
        self._lease_margin_s = settings.lease_ttl_s * 0.8  # act on a lease only this long after renewing it
        self.context_tokens = min(model.context_tokens, settings.max_context_tokens or model.context_tokens)
        self.kv_memory_bytes = settings.kv_memory_bytes or available_kv_memory(model.device)
        self.host_memory_bytes = settings.host_memory_bytes or available_host_memory(model.device)
        self.host_bytes_per_token = model.kv_bytes_per_token + model.num_layers * model.kv_heads * protocol.HOST_TOKEN_OVERHEAD_BYTES
        self.index_bytes_per_host_token = index_bytes_per_token(
            model.num_layers, model.kv_heads, model.head_dim, SessionConfig.page_tokens, SessionConfig.page_keys
        )
        self._no_room_until = 0.0  # after a session that did not fit, the pending queue waits
        self._pending_at = 0.0  # monotonic time the pending queue was last read
        self._orphans_at = 0.0  # ... and searched for entries a dead worker read but never took
        self._swept_at = 0.0
        self._last_step: str | None = None  # the session that ran the last step
        self._failing_since: float | None = None  # monotonic time the loop's turns began to fail
        self._live_limits = LiveLimits(
            settings.live_feed_bytes, settings.live_queue_frames, settings.live_max_lag_s, read_ahead=READ_COUNT
        )

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        backoff_s = 0.1
        while True:  # Redis may not be up yet
            try:
                await self._ensure_group(self.keys.pending(self.model.name))
                await self._advertise()
                break
            except FAILURES as err:
                log.warning("Redis unreachable (%s); retrying in %.1f s", err, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info(
            "worker %s serves %s (at most %d sessions, %d MiB for their caches, %d MiB for host tiers)",
            self.id, self.model.name, self.settings.max_sessions, self.kv_memory_bytes // 2**20, self.host_memory_bytes // 2**20,
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
                        await self._try(self._repair)
                    else:
                        log.warning("Redis failed (%s); retrying in %.1f s", err, backoff_s)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        finally:
            self._stopping.set()
            heartbeat.cancel()
            await self._shutdown()

    @staticmethod
    async def _try(action: Callable) -> None:
        try:
            await action()
        except FAILURES as err:
            log.warning("Redis failed again (%s)", err)

    # -- one turn ------------------------------------------------------------------------------

    async def _turn(self) -> None:
        await self._drop_lost()
        await self._take_new_sessions()
        if not self.sessions:
            return
        self._decode_uploads()
        streams = self._streams_to_read()
        if not streams:  # every lease is waiting to be renewed
            await asyncio.sleep(IDLE_BLOCK_MS / 1000)
            return
        if self._reread:
            await self._take_entries(await self._read({stream: "0" for stream in streams}, RECOVER_COUNT, None), seen=True)
            self._reread = False
        await self._take_entries(await self._read(streams, READ_COUNT, self._block_ms()))
        step = next_step(self.sessions, self._last_step)
        if step is not None:
            self._last_step = step.session_id
            await self._run_step(step)
        await self._tend()

    async def _take_entries(self, reply: list, seen: bool = False) -> None:
        """Queue the questions read and hand the media to the ingests. With `seen`, the reply is
        the worker's own pending entries: those it holds already are skipped, the others (a
        failed read delivered them) are taken in order."""
        entries = {key.decode(): rows for key, rows in reply}
        now = time.monotonic()
        for session_id, hosted in list(self.sessions.items()):
            known = self._holding(hosted) if seen else set()
            for entry_id, fields in entries.get(self.keys.questions(session_id), []):
                if entry_id not in known:
                    hosted.questions.append((entry_id, fields))
                    hosted.active_at = now
            for entry_id, fields in entries.get(self.keys.media(session_id), []):
                if entry_id in known:
                    continue
                if not fields:  # deleted after it was read
                    await self._consume(self.keys.media(session_id), entry_id)
                    continue
                await self._receive_media(session_id, entry_id, fields)

    @staticmethod
    def _holding(hosted: Hosted) -> set[bytes]:
        """The entries read and not yet acknowledged that the session holds."""
        held = {entry_id for entry_id, _ in hosted.questions} | set(hosted.unacked)
        return held | ({hosted.answer.entry_id} if hosted.answer is not None else set())

    def _block_ms(self) -> int | None:
        """How long this turn's read may wait for new entries: not at all while a step is ready."""
        hosted = self.sessions.values()
        if next_step(self.sessions, self._last_step) is not None:
            return None
        if any(h.batch is not None for h in hosted):
            return DECODING_BLOCK_MS
        if any(h.ingest is not None and h.ingest.live and not h.settled for h in hosted):
            return LIVE_BLOCK_MS
        return IDLE_BLOCK_MS

    async def _run_step(self, step: Step) -> None:
        hosted = self.sessions[step.session_id]
        hosted.active_at = time.monotonic()
        if step.kind == "start":
            await self._start_answer(step.session_id, hosted)
        elif step.kind == "answer":
            await self._continue_answer(step.session_id, hosted)
        else:
            await self._ingest_step(step.session_id, hosted)

    async def _tend(self) -> None:
        """What each session needs between steps: the end of its ingest noticed, a snapshot, a
        memory report; an idle or failed session lets its place go."""
        now = time.monotonic()
        for session_id, hosted in list(self.sessions.items()):
            if not hosted.held:
                continue
            if hosted.orphaned:
                await self._media_lost(session_id, hosted)
            ingest = hosted.ingest
            if ingest is not None and not hosted.settled and not hosted.error and hosted.answer is None:
                if ingest.finished and hosted.batch is None and not ingest.has_work:
                    await self._finish_ingest(session_id, hosted)
            await self._maybe_snapshot(session_id, hosted)
            if hosted.memory_stale:
                await self._report_memory(session_id, hosted)
            if not hosted.busy and (hosted.error or self._idle(hosted, now)):
                await self._park(session_id, hosted)

    async def _media_lost(self, session_id: str, hosted: Hosted) -> None:
        """The connection sending the session's media is gone without a word (its gateway died):
        a live stream counts as left (its client may connect again), an upload is given up so
        that it can be sent again."""
        hosted.orphaned = False
        if hosted.ingest is None:
            return
        if hosted.ingest.live:
            await self._in_thread(self._media_thread, hosted.ingest.receive, MediaEntry(MediaKind.DISCONNECT))
            log.info("session %s: its stream's connection is gone", session_id)
            return
        keys = [self.keys.session(session_id), self.keys.streamer(session_id), self.keys.media(session_id)]
        if not await self._abandon_upload(keys=keys):
            return
        await self._close_ingest(hosted)
        hosted.media_closed = False
        message = "the upload stopped part-way (its connection was lost); upload the file again"
        await self._event(session_id, MediaErrorEvent(code="upload_abandoned", message=message))
        log.info("session %s: %s", session_id, message)

    async def _find_orphaned_media(self) -> None:
        """Mark the sessions whose ingest waits for media from a connection that no longer holds
        its claim (renewed every STREAMER_TTL_S / 3 while it lives) and sent nothing for as long."""
        now = time.monotonic()
        waiting = [
            (session_id, hosted) for session_id, hosted in self.sessions.items()
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

    def _idle(self, hosted: Hosted, now: float) -> bool:
        release_s = self.settings.idle_release_s
        return release_s > 0 and now - hosted.active_at >= release_s

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

    # -- sessions ------------------------------------------------------------------------------

    def _device_bytes(self, record: SessionRecord) -> int:
        peak = protocol.session_peak_tokens(record.policy, record.budget_tokens, record.retrieval_tokens, self.context_tokens)
        return protocol.reserved_device_bytes(
            peak, record.host_budget_tokens, self.model.kv_bytes_per_token, self.index_bytes_per_host_token
        )

    def _kv_free_bytes(self) -> int:
        return max(0, self.kv_memory_bytes - sum(self._device_bytes(h.record) for h in self.sessions.values()))

    def _host_free_bytes(self) -> int:
        reserved = sum(h.record.host_budget_tokens for h in self.sessions.values()) * self.host_bytes_per_token
        return max(0, self.host_memory_bytes - reserved)

    def _fits(self, record: SessionRecord) -> bool:
        """Whether the session's peak cache and its host tier fit in the memory not reserved yet."""
        return self._device_bytes(record) <= self._kv_free_bytes() and record.host_budget_tokens * self.host_bytes_per_token <= self._host_free_bytes()

    async def _take_new_sessions(self) -> None:
        """Take up to the room left (MAX_SESSIONS, cache memory) from the pending queue of this
        worker's model: waiting for one while the worker holds none, at most every
        PENDING_POLL_S while it is busy."""
        now = time.monotonic()
        block_ms = None if self.sessions else IDLE_BLOCK_MS
        room = self.settings.max_sessions - len(self.sessions)
        if room <= 0 or now < self._no_room_until or (self.sessions and now - self._pending_at < PENDING_POLL_S):
            if block_ms is not None:
                await asyncio.sleep(block_ms / 1000)
            return
        self._pending_at = now
        pending = self.keys.pending(self.model.name)
        orphans = []
        if now - self._orphans_at >= self.settings.lease_ttl_s / 3:  # entries a dead worker read but never took
            self._orphans_at = now
            _, orphans, *_ = await self.redis.xautoclaim(pending, protocol.GROUP, self.id, self._lease_ms, "0-0", count=room)
        reply = [(pending, orphans)] if orphans else await self._read({pending: ">"}, room, block_ms)
        for _, rows in reply:
            for entry_id, fields in rows:
                try:
                    await self._claim(fields[b"session_id"].decode())
                except FAILURES:
                    raise  # the entry stays pending: this or another worker claims it again
                except Exception:
                    log.exception("could not take a session from %r", fields)
                await self._consume(pending, entry_id)
        if reply:
            await self._advertise()

    async def _claim(self, session_id: str) -> None:
        """Take a session: a new one, one that left a worker idle, or one whose worker died (from
        its snapshot, then the media and questions that worker had read but not finished)."""
        lease = self.keys.lease(session_id)
        if await self._take_lease(keys=[lease, self.keys.session(session_id)], args=[self.id, self._lease_ms]) != 1:
            return  # another worker holds it, or it expired while it waited
        self._claiming.add(session_id)
        try:
            await self._advertise()  # named in the registry before opening: if this worker dies now, it is queued again
            stored = await self.redis.hgetall(self.keys.session(session_id))
            if not stored:  # deleted since the lease was taken
                await self._release(keys=[lease], args=[self.id])
                return
            stored.pop(b"token_sha256", None)
            record = SessionRecord.from_hash(stored)
            if not self._fits(record):
                await self._release(keys=[lease], args=[self.id])  # no room for its cache here: back in the queue
                await self._requeue(session_id, self.id)
                self._no_room_until = time.monotonic() + 1.0
                return
            hosted = await self._open(session_id, record)
        except FAILURES:
            raise
        except Exception:
            await self._release(keys=[lease], args=[self.id])
            await self._set(session_id, SessionState.ERROR, error=f"the worker could not open it {INTERNAL}")
            raise
        finally:
            self._claiming.discard(session_id)
        if not await self._renew(keys=[lease, self.keys.session(session_id)], args=[self.id, self._lease_ms]):
            if hosted.ingest is not None:
                hosted.ingest.close(delete=False)
            return  # opening took longer than the lease, and another worker has it now
        hosted.lease_until = time.monotonic() + self._lease_margin_s
        self.sessions[session_id] = hosted
        await self._set(session_id, worker=self.id, **self._progress(hosted.engine))
        await self._set(session_id, SessionState.READY, SessionState.PENDING)
        await self._replay(session_id)
        log.info("took session %s", session_id)

    async def _open(self, session_id: str, record: SessionRecord) -> Hosted:
        """The session's engine and ingest: restored from its snapshot when it has one."""
        snapshot = await self.snapshots.load(session_id)
        if snapshot is None:
            config = SessionConfig(
                policy=record.policy,
                budget_tokens=record.budget_tokens,
                policy_options=record.policy_options,
                recall=record.recall,
                pin_turns=record.pin_turns,
                context_tokens=self.context_tokens,
                **({"host_budget_tokens": record.host_budget_tokens, "retrieval_tokens": record.retrieval_tokens} if record.recall else {}),
                **({"system_prompt": record.system_prompt} if record.system_prompt else {}),
            )
            hosted = Hosted(record, await self._in_engine(Session, self.model, config))
        else:
            log.info("session %s: restoring its snapshot of %d bytes", session_id, len(snapshot.engine))
            hosted = Hosted(record, await self._in_engine(Session.restore, self.model, snapshot.engine))
            if snapshot.ingest is not None and snapshot.ingest.get("kind") == "live":
                hosted.ingest = open_live(
                    snapshot.ingest["format"], record.fps, self.settings.max_frame_side, self._live_limits
                )
                hosted.ingest.resume(snapshot.ingest)
                hosted.settled = record.state != SessionState.INGESTING
        if record.media == "upload" and record.upload_bytes > 0 and record.state == SessionState.INGESTING:
            after_s = hosted.engine.stats().video_time_s if hosted.engine.stats().frames else None
            state = {"spool": str(self._spool(session_id)), "bytes": record.upload_bytes, "ended": record.upload_ended}
            try:
                hosted.ingest = await self._in_thread(
                    self._decode_thread, UploadIngest.resume, state, record.fps, self.settings.max_frame_side,
                    self.settings.max_upload_bytes, after_s,
                )
                hosted.media_closed = record.upload_ended
            except DecodeError as err:
                hosted.error, hosted.media_closed = str(err), True
        return hosted

    async def _replay(self, session_id: str) -> None:
        """Finish what a dead worker had read but not finished: its questions (each answered once,
        or failed with `session_reset` when it had begun answering), then its media, in order."""
        for stream, handle in ((self.keys.questions(session_id), self._reclaim_question), (self.keys.media(session_id), self._receive_media)):
            start = "0-0"
            while True:
                start, entries, *_ = await self.redis.xautoclaim(stream, protocol.GROUP, self.id, 0, start, count=64)
                for entry_id, fields in entries:
                    hosted = self.sessions.get(session_id)
                    if hosted is None or not fields or (hosted.error and handle is self._receive_media):
                        await self._consume(stream, entry_id)  # gone, deleted after it was read, or media of a failed session
                        continue
                    for _ in range(1000):  # the queue has room before the next entry
                        if hosted.ingest is None or not hosted.ingest.live or hosted.ingest.accepts_media:
                            break
                        await self._ingest_step(session_id, hosted)
                    await handle(session_id, entry_id, fields)
                if start in (b"0-0", "0-0"):
                    break
        hosted = self.sessions.get(session_id)
        if hosted is not None and hosted.error:
            await self._fail(session_id, hosted, hosted.error)

    async def _reclaim_question(self, session_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """A question a dead worker had read: answered already (acknowledged), begun (ended with
        `session_reset`), or not begun (queued to be answered)."""
        try:
            question = Question.model_validate_json(fields[b"m"])
        except (KeyError, ValueError):
            await self._consume(self.keys.questions(session_id), entry_id)
            return
        events = await self.redis.xrange(self.keys.answer(session_id, question.answer_id))
        kinds = {AnswerEnvelope.model_validate_json(f[b"m"]).event.type for _, f in events}
        if kinds & {"done", "error"}:
            await self._consume(self.keys.questions(session_id), entry_id)  # answered before the worker died
        elif kinds:
            message = "the worker answering this question stopped part-way; ask again"
            stream = self.keys.answer(session_id, question.answer_id)
            await self._publish(session_id, stream, ErrorEvent(code="session_reset", message=message), len(events))
            await self._consume(self.keys.questions(session_id), entry_id)
        else:
            self.sessions[session_id].questions.append((entry_id, fields))

    def _spool(self, session_id: str) -> Path:
        return self.spool_dir / f"{session_id}.upload"

    async def _drop_lost(self) -> None:
        """Forget the sessions whose lease or data is gone; a deleted or expired session's files go too."""
        lost = [session_id for session_id, hosted in self.sessions.items() if hosted.lost]
        for session_id in lost:
            await self._release(keys=[self.keys.lease(session_id)], args=[self.id])
            gone = not await self.redis.exists(self.keys.session(session_id))
            if gone:  # deleted or expired (a lost lease: the next owner's files)
                self.snapshots.delete_file(session_id)
            await self._drop(session_id, delete_spool=gone)
        if lost:
            await self._advertise()

    async def _drop(self, session_id: str, delete_spool: bool = False) -> None:
        """Forget a session this worker no longer holds; its upload spool stays for the next
        holder unless `delete_spool`."""
        hosted = self.sessions.pop(session_id)
        if hosted.answer is not None:
            await self._in_engine(hosted.answer.pieces.close)
            hosted.answer = None
        await self._close_ingest(hosted, delete=delete_spool)
        log.info("dropped session %s", session_id)

    async def _close_ingest(self, hosted: Hosted, delete: bool = True) -> None:
        """Close the session's ingest (an upload's after the frames being decoded, on the same thread)."""
        ingest, batch, hosted.ingest, hosted.batch = hosted.ingest, hosted.batch, None, None
        if batch is not None:
            batch.add_done_callback(lambda done: done.cancelled() or done.exception())  # its result is not wanted
        if ingest is None:
            return
        if ingest.live:
            ingest.close(delete)
        else:
            await self._in_thread(self._decode_thread, ingest.close, delete)

    async def _park(self, session_id: str, hosted: Hosted) -> None:
        """Let an idle or failed session go: snapshotted, its lease released, out of the model's
        admitted sessions. Refused while work arrives for it (it stays, and waits another idle period)."""
        if not hosted.error and not await self._maybe_snapshot(session_id, hosted, force=True):
            return
        keys = [
            self.keys.session(session_id), self.keys.lease(session_id), self.keys.questions(session_id),
            self.keys.media(session_id), self.keys.streamer(session_id),
        ]
        if not await self._park_script(keys=keys, args=[self.id, "1" if hosted.error else "0"]):
            hosted.active_at = time.monotonic()
            return
        await leave(self.redis, self.keys, session_id, self.model.name)
        await self._drop(session_id)
        await self._advertise()
        log.info("session %s left this worker (%s)", session_id, "failed" if hosted.error else "idle")

    async def _requeue(self, session_id: str, worker_id: str, model: str | None = None) -> bool:
        """Queue a session of `worker_id` (a dead one, or this one) again for a worker of `model`."""
        now = time.time()
        if not await self._requeue_script(keys=[self.keys.session(session_id), self.keys.lease(session_id)], args=[worker_id, now]):
            return False
        await enqueue(self.redis, self.keys, session_id, model or self.model.name, now)
        return True

    async def _repair(self) -> bool:
        """Recreate the pending queue's group if it is gone and give up every session whose
        data is gone; True when either was needed."""
        repaired = await self._ensure_group(self.keys.pending(self.model.name))
        for session_id, hosted in self.sessions.items():
            if await self.redis.exists(*self.keys.session_data(session_id)[:3]) < 3:
                hosted.lost = repaired = True
        return repaired

    async def _fail(self, session_id: str, hosted: Hosted, message: str) -> None:
        """The session's media failed: it takes no more (questions are refused), and it lets its
        place go once the questions it had are answered."""
        hosted.error = message
        hosted.media_closed = True
        if hosted.unacked:  # nothing will ever replay them
            await self._consume(self.keys.media(session_id), *hosted.unacked)
            hosted.unacked = []
        await self._close_ingest(hosted)
        await self._set(session_id, SessionState.ERROR, error=message)
        await self._event(session_id, MediaErrorEvent(code="session_error", message=message))
        log.info("session %s failed: %s", session_id, message)

    # -- questions -----------------------------------------------------------------------------

    async def _start_answer(self, session_id: str, hosted: Hosted) -> None:
        """A question's step: refused, or its prefill and first token."""
        entry_id, fields = hosted.questions.popleft()
        questions = self.keys.questions(session_id)
        try:
            question = Question.model_validate_json(fields[b"m"])
        except (KeyError, TypeError, ValueError):
            log.warning("session %s: dropped a malformed (or deleted) question", session_id)
            await self._consume(questions, entry_id)
            return
        stream = self.keys.answer(session_id, question.answer_id)
        if await self.redis.xlen(stream):  # the same question twice (a retried submit): answered once
            log.warning("session %s: answer %s already has events; not answering again", session_id, question.answer_id)
            await self._consume(questions, entry_id)
            return
        if hosted.error:
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="session_error", message=hosted.error))
            return
        before = hosted.engine.stats()
        if before.frames == 0 and self.model.sees_frames:
            message = "the session has no video yet: upload a file or stream to it, then ask"
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="no_video", message=message))
            return

        def begin() -> tuple[int, AnswerRun | None, str | None]:  # on the engine's thread
            tokens = len(self.model.tokenize(question.question, user=True))
            if tokens > protocol.MAX_QUESTION_TOKENS:
                return tokens, None, None
            pieces = hosted.engine.ask(question.question, question.max_new_tokens, engine_sampling(question.sampling))
            run = AnswerRun(entry_id, question, stream, pieces, before)
            return tokens, run, next(run.pieces, None)

        try:
            tokens, run, piece = await self._in_engine(begin)
        except ContextFull as err:
            message = f"{err}: ask a shorter question, or start a session with a policy that evicts"
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="context_full", message=message))
            return
        except Exception:
            log.exception("session %s: answering failed", session_id)
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="internal_error", message=f"answering failed {INTERNAL}"))
            return
        if run is None:
            message = f"the question is {tokens} tokens long; at most {protocol.MAX_QUESTION_TOKENS} are taken"
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="question_too_long", message=message))
            return
        hosted.answer = run
        await self._answer_piece(session_id, hosted, piece)

    async def _continue_answer(self, session_id: str, hosted: Hosted) -> None:
        """An answer's step: its next token (after sending what Redis did not take before)."""
        run = hosted.answer
        if run.outbox:
            await self._answer_piece(session_id, hosted, "")
            return
        try:
            piece = await self._in_engine(next, run.pieces, None)
        except Exception:
            log.exception("session %s: answering failed", session_id)
            await self._cancel_answer(session_id, hosted, ErrorEvent(code="internal_error", message=f"answering failed {INTERNAL}"))
            return
        await self._answer_piece(session_id, hosted, piece)

    async def _answer_piece(self, session_id: str, hosted: Hosted, piece: str | None) -> None:
        """Send a generated piece (None: the answer is over). A session found gone stops here."""
        run = hosted.answer
        run.add(piece or "")
        while run.outbox:
            if not await self._publish(session_id, run.stream, run.outbox[0], run.published):
                await self._cancel_answer(session_id, hosted)  # deleted: nobody will read on
                hosted.lost = True
                return
            run.outbox.pop(0)
            run.published += 1
        if piece is None:
            await self._finish_answer(session_id, hosted)

    async def _finish_answer(self, session_id: str, hosted: Hosted) -> None:
        run = hosted.answer
        if not await self._publish(session_id, run.stream, run.done(hosted.engine), run.published):  # Redis failing: tried again
            hosted.lost = True  # deleted meanwhile
        hosted.answer = None
        hosted.changed = True
        self.answers += 1
        stats = hosted.engine.stats()
        self.evictions += stats.evictions - run.before.evictions
        self.retrieved_tokens += stats.retrieved_tokens - run.before.retrieved_tokens
        self.retrieved_pages += stats.retrieved_pages - run.before.retrieved_pages
        self.retrieval_ms += stats.retrieval_ms - run.before.retrieval_ms
        hosted.host_bytes = stats.host_bytes
        await self._consume(self.keys.questions(session_id), run.entry_id)
        await self._set(session_id, **self._progress(hosted.engine))
        await self._report_memory(session_id, hosted, force=True)

    async def _cancel_answer(self, session_id: str, hosted: Hosted, error: ErrorEvent | None = None) -> None:
        """Stop an answer under way (its turn still ends in the cache), with `error` as its last event."""
        run, hosted.answer = hosted.answer, None
        hosted.changed = True
        await self._in_engine(run.pieces.close)
        if error is not None:
            await self._publish(session_id, run.stream, error, run.published)
        await self._consume(self.keys.questions(session_id), run.entry_id)

    async def _refuse(self, session_id: str, entry_id: bytes, stream: str, error: ErrorEvent) -> None:
        await self._publish(session_id, stream, error, 0)
        await self._consume(self.keys.questions(session_id), entry_id)

    async def _publish(self, session_id: str, stream: str, event: TokenEvent | DoneEvent | ErrorEvent, index: int) -> bool:
        """Add an answer's `index`-th event (from 0); False when the session is gone."""
        document = AnswerEnvelope(event=event).model_dump_json()
        keys = [self.keys.session(session_id), stream]
        args = [document, protocol.ANSWER_MAXLEN, protocol.ANSWER_TTL_S, index]
        return bool(await self._publish_script(keys=keys, args=args))

    # -- media ---------------------------------------------------------------------------------

    async def _receive_media(self, session_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Hand a media entry to the session's ingest. An upload's entries are acknowledged once
        spooled, with its byte count; a live stream's once a snapshot covers them."""
        hosted = self.sessions[session_id]
        hosted.active_at = hosted.media_at = time.monotonic()
        entry = MediaEntry.read(fields)
        media = self.keys.media(session_id)
        try:
            if entry.kind == MediaKind.ABORT:  # the gateway gave up on this upload and freed the slot; drop its bytes
                await self._close_ingest(hosted)
                await self._consume(media, entry_id)
                return
            if entry.kind == MediaKind.CONNECT:
                await self._connect(session_id, hosted, entry.format, entry.connection)
            elif hosted.ingest is None:
                hosted.ingest = UploadIngest(
                    self._spool(session_id), hosted.record.fps, self.settings.max_frame_side,
                    self.settings.max_upload_bytes,
                )
            elif hosted.ingest.live and hosted.settled and entry.kind in (MediaKind.DATA, MediaKind.FRAME):
                await self._unsettle(session_id, hosted)  # media again, without a new connection
            await self._in_thread(self._media_thread, hosted.ingest.receive, entry)
            if not hosted.ingest.live:
                await self._received_upload(session_id, hosted, entry.kind, entry_id)
            else:
                hosted.unacked.append(entry_id)
        except DecodeError as err:
            await self._consume(media, entry_id)
            await self._fail(session_id, hosted, str(err))
        except FAILURES:
            raise
        except Exception:
            log.exception("session %s: receiving media failed", session_id)
            await self._consume(media, entry_id)
            await self._fail(session_id, hosted, f"receiving media failed {INTERNAL}")

    async def _connect(self, session_id: str, hosted: Hosted, media_format: str, connection: str) -> None:
        """A stream socket connected: keep the session's live ingest (a reconnection) or open one."""
        ingest = hosted.ingest
        if ingest is None or not ingest.live or ingest.format != media_format:
            await self._close_ingest(hosted)
            hosted.ingest = open_live(media_format, hosted.record.fps, self.settings.max_frame_side, self._live_limits)
        await self._unsettle(session_id, hosted, connection)

    async def _unsettle(self, session_id: str, hosted: Hosted, connection: str | None = None) -> None:
        """Ingesting again: the stream socket `connection` connected (by default, media came
        again from the connection that sent last)."""
        hosted.settled = False
        await self._set(session_id, SessionState.INGESTING)
        connection = connection or _live_connection(hosted)
        await self._event(session_id, StateEvent(state=SessionState.INGESTING, connection=connection))

    async def _received_upload(self, session_id: str, hosted: Hosted, kind: str, entry_id: bytes) -> None:
        """Record the upload's progress and acknowledge the entry in one step, so that a worker
        taking over finds the spool file and the count in agreement."""
        ingest = hosted.ingest
        fields: dict[str, object] = {"upload_bytes": ingest.bytes_received}
        if kind == MediaKind.END:
            hosted.media_closed = True
            fields |= {"upload_ended": True, "media_duration_s": ingest.info.duration_s if ingest.info else None}
        pairs = [item for pair in protocol.to_hash(**fields).items() for item in pair]
        keys = [self.keys.session(session_id), self.keys.media(session_id)]
        await self._upload_ack(keys=keys, args=[entry_id, *pairs])

    def _decode_uploads(self) -> None:
        """Start decoding each upload's next frames on the decode thread, while the engine works."""
        loop = asyncio.get_running_loop()
        for hosted in self.sessions.values():
            ingest = hosted.ingest
            if hosted.batch is None and ingest is not None and not ingest.live and ingest.has_work and hosted.held:
                hosted.batch = loop.run_in_executor(self._decode_thread, ingest.next_frames, self.settings.frames_per_step)

    async def _ingest_step(self, session_id: str, hosted: Hosted) -> None:
        """Append the frames that are ready (an upload's decoded batch, or a live stream's queue),
        report, and notice the end."""
        ingest = hosted.ingest
        try:
            if ingest.live:
                batch = ingest.next_frames(self.settings.frames_per_step)
            else:
                batch: Batch = await hosted.batch  # done: the scheduler chose this step for it
                hosted.batch = None
            appended = 0
            if batch.frames and not hosted.record.context_full:  # past the context, frames are let go
                images, times = [f.image for f in batch.frames], [f.time_s for f in batch.frames]
                before = hosted.engine.stats()
                try:
                    await self._in_engine(hosted.engine.append_frames, images, times)
                except ContextFull as err:
                    await self._context_full(session_id, hosted, err)
                hosted.changed = True
                stats = hosted.engine.stats()
                appended = stats.frames - before.frames
                self.frames_ingested += appended
                self.evictions += stats.evictions - before.evictions
                hosted.host_bytes = stats.host_bytes
                hosted.lag_s = batch.lag_s if ingest.live else 0.0
        except DecodeError as err:
            await self._fail(session_id, hosted, str(err))
            return
        except Exception:
            log.exception("session %s: ingest failed", session_id)
            await self._fail(session_id, hosted, f"ingest failed {INTERNAL}")
            return
        for message in batch.warnings:
            await self._event(session_id, WarningEvent(code="frame_skipped", message=message))
        if ingest.live:
            for code, connection, message in ingest.take_errors():
                await self._event(session_id, MediaErrorEvent(code=code, message=message, connection=connection))
        if appended:
            stats = hosted.engine.stats()
            dropped = ingest.dropped if ingest.live else 0
            await self._event(
                session_id,
                IngestEvent(
                    frames=stats.frames,
                    times=[f.time_s for f in batch.frames[:appended]],
                    video_time_s=stats.video_time_s,
                    lag_s=round(batch.lag_s, 3),
                    dropped=dropped,
                    cache_tokens=stats.cache_tokens,
                ),
            )
            await self._set(session_id, frames_dropped=dropped, ingest_lag_s=round(batch.lag_s, 3), **self._progress(hosted.engine))
            await self._report_memory(session_id, hosted)
        if not ingest.live and ingest.finished:
            await self._finish_ingest(session_id, hosted)

    async def _context_full(self, session_id: str, hosted: Hosted, err: ContextFull) -> None:
        """The cache reached the model's context: later frames are not taken (said once)."""
        hosted.record.context_full = True
        await self._set(session_id, context_full=True)
        message = f"{err}: later frames are not taken; ask about what it holds, or use a policy that evicts"
        await self._event(session_id, WarningEvent(code="context_full", message=message))

    async def _finish_ingest(self, session_id: str, hosted: Hosted) -> None:
        """All media so far is in the cache: an upload is done (its spool goes once a snapshot
        covers it), a live stream's client ended or left (its ingest stays, for a client that
        connects again)."""
        if not hosted.ingest.live:
            if not await self._maybe_snapshot(session_id, hosted, force=True):
                return  # the spool stays until a snapshot covers the whole upload; tried again next turn
            await self._close_ingest(hosted)
            if hosted.engine.stats().frames == 0:
                await self._fail(session_id, hosted, "the video has no frames")
                return
        hosted.settled = True
        if hosted.engine.stats().frames == 0:
            await self._set(session_id, SessionState.READY, SessionState.INGESTING)
            message = "the stream ended before any frame could be decoded"
            await self._event(session_id, MediaErrorEvent(code="empty_stream", message=message, connection=hosted.ingest.connection))
            return
        await self._report_memory(session_id, hosted, force=True)
        await self._set(session_id, SessionState.INGESTED, SessionState.INGESTING, **self._progress(hosted.engine))
        await self._event(session_id, StateEvent(state=SessionState.INGESTED, connection=_live_connection(hosted)))

    # -- snapshots -----------------------------------------------------------------------------

    async def _maybe_snapshot(self, session_id: str, hosted: Hosted, force: bool = False) -> bool:
        """Snapshot a session that changed, every SNAPSHOT_INTERVAL_S or once SNAPSHOT_AFTER_ENTRIES
        live media entries wait for one, then acknowledge the media it covers. Never in the
        middle of an answer; a live session only while no frame waits for the engine, so the
        media it acknowledges is in the cache (or sampled out). True when the session's state is
        in a snapshot."""
        if hosted.lost or hosted.error or not hosted.held or hosted.answer is not None:
            return False
        if not (hosted.changed or hosted.unacked):
            return True
        due = time.monotonic() - hosted.snapshot_at >= self.settings.snapshot_interval_s
        if not (force or due or len(hosted.unacked) >= SNAPSHOT_AFTER_ENTRIES):
            return False
        if hosted.ingest is not None and hosted.ingest.live and len(hosted.ingest.queue) and not force:
            return False
        covered, hosted.unacked = hosted.unacked, []
        changed, hosted.changed, hosted.snapshot_at = hosted.changed, False, time.monotonic()
        try:
            engine = await self._in_engine(hosted.engine.snapshot)
            ingest = hosted.ingest.state() if hosted.ingest is not None and hosted.ingest.live else None
            await self.snapshots.save(session_id, engine, ingest)
        except Exception as err:
            hosted.unacked, hosted.changed = covered + hosted.unacked, changed or hosted.changed
            if isinstance(err, FAILURES):
                raise
            log.exception("session %s: snapshot failed", session_id)
            return False
        if covered:
            await self._consume(self.keys.media(session_id), *covered)
        return True

    async def _sweep_files(self) -> None:
        """Delete spool and snapshot files of sessions that are gone (deleted, expired, or lost
        with a Redis that restarted empty), older than SWEEP_MIN_AGE_S."""
        now = time.time()
        files = [
            path
            for folder in (self.spool_dir, self.snapshots.directory)
            if folder.is_dir()
            for path in folder.iterdir()
            if path.suffix in (".upload", ".snapshot", ".partial")
        ]
        for path in files:
            try:
                if now - path.stat().st_mtime < SWEEP_MIN_AGE_S:
                    continue
            except FileNotFoundError:
                continue
            if not await self.redis.exists(self.keys.session(path.stem)):
                path.unlink(missing_ok=True)
                log.info("deleted %s: its session is gone", path)

    # -- bookkeeping ---------------------------------------------------------------------------

    async def _report_memory(self, session_id: str, hosted: Hosted, force: bool = False) -> None:
        """Write what the session's cache holds (GET /sessions/{id}/memory), at most every
        MEMORY_INTERVAL_S unless `force`."""
        if not force and time.monotonic() - hosted.memory_at < MEMORY_INTERVAL_S:
            hosted.memory_stale = True  # reported at a later turn
            return
        hosted.memory_at, hosted.memory_stale = time.monotonic(), False
        memory, stats = await self._in_engine(lambda: (hosted.engine.memory(), hosted.engine.stats()))
        report = MemoryReport(
            policy=memory.policy,
            budget_tokens=memory.budget_tokens,
            cache_tokens=memory.cache_tokens,
            frame_tokens=round(memory.frame_tokens, 2),
            text_tokens=round(memory.text_tokens, 2),
            evictions=stats.evictions,
            evicted_tokens=stats.evicted_tokens,
            frames=stats.frames,
            video_time_s=round(stats.video_time_s, 3),
            spans=[MemorySpan(**asdict(span)) for span in memory.spans],
            recall=hosted.record.recall,
            host_budget_tokens=memory.host_budget_tokens,
            host_tokens=memory.host_tokens,
            host_bytes=stats.host_bytes,
            retrievals=stats.retrievals,
            updated_at=time.time(),
        )
        keys = [self.keys.session(session_id), self.keys.memory(session_id)]
        await self._set_if_live(keys=keys, args=[report.model_dump_json(), self.settings.session_ttl_s])

    @staticmethod
    def _progress(engine: Session) -> dict[str, object]:
        stats = engine.stats()
        return {
            "frames_ingested": stats.frames,
            "video_time_s": round(stats.video_time_s, 3),
            "cache_tokens": stats.cache_tokens,
        }

    async def _set(
        self,
        session_id: str,
        state: SessionState | None = None,
        from_state: SessionState | None = None,
        **fields: object,
    ) -> bool:
        """Write fields, then the state (only from `from_state` when given, a change that
        protocol.TRANSITIONS allows), and restart the session's idle clock, atomically. False
        when the session is gone."""
        if state is not None and from_state is not None:
            check_transition(from_state, state)
        pairs = [item for pair in protocol.to_hash(**fields).items() for item in pair]
        args = [self.settings.session_ttl_s, state or "", from_state or "", *pairs]
        return bool(await self._update(keys=list(self.keys.session_data(session_id)), args=args))

    async def _event(self, session_id: str, event: IngestEvent | StateEvent | WarningEvent | MediaErrorEvent) -> None:
        document = EventEnvelope(event=event).model_dump_json()
        stream = self.keys.events(session_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, {"m": document}, maxlen=protocol.EVENTS_MAXLEN, approximate=True)
            pipe.expire(stream, self.settings.session_ttl_s)
            await pipe.execute()

    async def _consume(self, stream: str, *entry_ids: bytes) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, protocol.GROUP, *entry_ids)
            pipe.xdel(stream, *entry_ids)
            await pipe.execute()

    async def _ensure_group(self, stream: str) -> bool:
        """Create the stream and its consumer group unless they exist; True when it did."""
        try:
            await self.redis.xgroup_create(stream, protocol.GROUP, id="0", mkstream=True)
            return True
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
            return False

    async def _advertise(self) -> None:
        info = WorkerInfo(
            id=self.id,
            model=self.model.name,
            sessions=len(self.sessions),
            max_sessions=self.settings.max_sessions,
            expires_at=time.time() + self.settings.lease_ttl_s,
            session_ids=[*self.sessions, *self._claiming],
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            kv_free_bytes=self._kv_free_bytes(),
            context_tokens=self.context_tokens,
            host_bytes_per_token=self.host_bytes_per_token,
            index_bytes_per_host_token=self.index_bytes_per_host_token,
            host_free_bytes=self._host_free_bytes(),
            host_bytes=sum(h.host_bytes for h in self.sessions.values()),
            retrieved_tokens=self.retrieved_tokens,
            retrieved_pages=self.retrieved_pages,
            retrieval_ms=round(self.retrieval_ms, 3),
            frames_ingested=self.frames_ingested,
            evictions=self.evictions,
            answers=self.answers,
            ingest_lag_s=round(max((h.lag_s for h in self.sessions.values()), default=0.0), 3),
        )
        await self.redis.hset(self.keys.workers(), self.id, info.model_dump_json())

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
                    keys = [self.keys.lease(session_id), self.keys.session(session_id)]
                    renewed_at = time.monotonic()
                    if await self._renew(keys=keys, args=[self.id, self._lease_ms]):
                        hosted.lease_until = renewed_at + self._lease_margin_s
                    else:
                        hosted.lost = True
                await self._forget_dead_workers()
                await self._find_orphaned_media()
                if time.monotonic() - self._swept_at >= SWEEP_INTERVAL_S:
                    self._swept_at = time.monotonic()
                    await self._sweep_files()
            except FAILURES as err:
                log.warning("heartbeat: Redis failed (%s)", err)
            except Exception:
                log.exception("heartbeat failed")

    async def _forget_dead_workers(self) -> None:
        """Put the sessions of workers whose advertisement lapsed back in the pending queue (a
        Lua script makes sure only one worker does, and only once their leases lapsed); forget
        workers silent for DEAD_WORKER_FORGET_S."""
        now = time.time()
        for worker_id, raw in (await self.redis.hgetall(self.keys.workers())).items():
            info = WorkerInfo.model_validate_json(raw)
            if info.alive or info.id == self.id:
                continue
            for session_id in info.session_ids:
                if await self._requeue(session_id, info.id, info.model):
                    log.info("session %s of the dead worker %s is free again", session_id, info.id)
            if info.expires_at < now - DEAD_WORKER_FORGET_S:
                await self.redis.hdel(self.keys.workers(), worker_id)

    async def _shutdown(self) -> None:
        """Hand every session over: answers under way finish (for up to STOP_GRACE_S, then end
        with `session_reset`), then each session is snapshotted, its lease released and queued
        for another worker (or this one, restarted); questions not begun wait for that worker.
        Then leave the registry."""
        try:
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and any(h.answering for h in self.sessions.values()):
                for session_id, hosted in list(self.sessions.items()):
                    if hosted.answering:
                        await self._continue_answer(session_id, hosted)
            for session_id, hosted in list(self.sessions.items()):
                if hosted.answer is not None:
                    message = "the worker stopped while answering; ask again"
                    await self._cancel_answer(session_id, hosted, ErrorEvent(code="session_reset", message=message))
                for _ in range(self.settings.live_queue_frames):  # frames already read go into the snapshot
                    if not (hosted.ingest is not None and hosted.ingest.live and len(hosted.ingest.queue)):
                        break
                    await self._ingest_step(session_id, hosted)
                await self._maybe_snapshot(session_id, hosted, force=True)
                await self._release(keys=[self.keys.lease(session_id)], args=[self.id])
                await self._requeue(session_id, self.id)
                await self._drop(session_id)
            await self.redis.hdel(self.keys.workers(), self.id)
        except FAILURES as err:
            log.warning("shutdown: Redis failed (%s)", err)
        finally:
            self._engine_thread.shutdown(wait=True, cancel_futures=True)
            self._decode_thread.shutdown(wait=True, cancel_futures=True)
            self._media_thread.shutdown(wait=True, cancel_futures=True)

    async def _in_engine(self, fn: Callable[..., T], *args: object) -> T:
        return await self._in_thread(self._engine_thread, fn, *args)

    @staticmethod
    async def _in_thread(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

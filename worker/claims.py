"""How a worker takes sessions: from its model's pending queue, while it has room, by lease;
each opened from its snapshot when it has one, then what a dead worker had read but not finished
is replayed (its questions, then its media, in order)."""

import asyncio
import functools
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from engine import Model, PoolFull, Session, SessionConfig
from streamvqa import protocol
from streamvqa.pending import leave
from streamvqa.protocol import Keys, SessionRecord, SessionState
from streamvqa.redis_client import FAILURES, xreadgroup
from worker.answering import Answering
from worker.capacity import Capacity
from worker.decode import INTERNAL
from worker.hosted import Hosted
from worker.intake import MediaIntake
from worker.leases import Leases
from worker.records import RecordWriter, progress
from worker.snapshots import SnapshotStore
from worker.threads import Threads

log = logging.getLogger(__name__)

PENDING_POLL_S = 0.1  # how often a busy worker looks for new sessions
NO_ROOM_WAIT_S = 1.0  # after a session that did not fit, the pending queue waits this long


class OptionsDoNotFit(Exception):
    """A new session whose options the engine refuses for this worker's model."""


class Claims:
    def __init__(
        self, redis: Redis, reader: Redis, keys: Keys, model: Model, max_sessions: int, sessions: dict[str, Hosted],
        threads: Threads, leases: Leases, capacity: Capacity, store: SnapshotStore, records: RecordWriter,
        intake: MediaIntake, answering: Answering,
    ) -> None:
        """`reader` reads the pending queue (XREADGROUP), as the worker's `reader` its streams."""
        self.redis = redis
        self.reader = reader
        self.keys = keys
        self.model = model
        self.max_sessions = max_sessions
        self.sessions = sessions  # the worker's: those it holds
        self.claiming: set[str] = set()  # sessions being opened: advertised, not yet held
        self.threads = threads
        self.leases = leases
        self.capacity = capacity
        self.store = store
        self.records = records
        self.intake = intake
        self.answering = answering
        self._no_room_until = 0.0
        self._pending_at = 0.0  # monotonic time the pending queue was last read
        self._orphans_at = 0.0  # ... and searched for entries a dead worker read but never took

    async def ensure_queue(self) -> bool:
        """Create the model's pending queue and its consumer group unless they exist; True when it did."""
        try:
            await self.redis.xgroup_create(self.keys.pending(self.model.name), protocol.GROUP, id="0", mkstream=True)
            return True
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
            return False

    async def take_new(self, idle_block_ms: int) -> None:
        """Take up to the room left (MAX_SESSIONS, cache memory) from the pending queue of this
        worker's model: waiting for one while the worker holds none, at most every
        PENDING_POLL_S while it is busy."""
        now = time.monotonic()
        block_ms = None if self.sessions else idle_block_ms
        room = self.max_sessions - len(self.sessions)
        if room <= 0 or now < self._no_room_until or (self.sessions and now - self._pending_at < PENDING_POLL_S):
            if block_ms is not None:
                await asyncio.sleep(block_ms / 1000)
            return
        self._pending_at = now
        pending = self.keys.pending(self.model.name)
        orphans = []
        if now - self._orphans_at >= self.leases.lease_ttl_s / 3:  # entries a dead worker read but never took
            self._orphans_at = now
            _, orphans, *_ = await self.redis.xautoclaim(
                pending, protocol.GROUP, self.leases.worker_id, self.leases.lease_ms, "0-0", count=room
            )
        reply = [(pending, orphans)] if orphans else await self._read(pending, room, block_ms)
        for _, rows in reply:
            for entry_id, fields in rows:
                try:
                    await self.claim(fields[b"session_id"].decode())
                except FAILURES:
                    raise  # the entry stays pending: this or another worker claims it again
                except Exception:
                    log.exception("could not take a session from %r", fields)
                await self.records.consume(pending, entry_id)
        if reply:
            await self.leases.advertise(self.sessions, self.claiming)

    async def _read(self, pending: str, count: int, block_ms: int | None) -> list:
        """XREADGROUP of the pending queue; nothing when its group was gone (made again now)."""
        try:
            return await xreadgroup(self.reader, protocol.GROUP, self.leases.worker_id, {pending: ">"}, count, block_ms)
        except ResponseError as err:
            if "NOGROUP" in str(err) and await self.ensure_queue():
                return []
            raise

    async def claim(self, session_id: str) -> None:
        """Take a session: a new one, one that left a worker idle, or one whose worker died (from
        its snapshot, then the media and questions that worker had read but not finished)."""
        if not await self.leases.take(session_id):
            return  # another worker holds it, or it expired while it waited
        self.claiming.add(session_id)
        try:
            await self.leases.advertise(self.sessions, self.claiming)  # named before opening: if this worker dies now, it is queued again
            stored = await self.redis.hgetall(self.keys.session(session_id))
            if not stored:  # deleted since the lease was taken
                await self.leases.release(session_id)
                return
            stored.pop(b"token_sha256", None)
            record = SessionRecord.from_hash(stored)
            if not self.capacity.fits(record, [h.record for h in self.sessions.values()]):
                await self._no_room(session_id)
                return
            try:
                hosted = await self._open(session_id, record)
            except PoolFull:  # its snapshot's cache peaks higher than its record says
                await self._no_room(session_id)
                return
        except FAILURES:
            raise
        except OptionsDoNotFit as err:  # the client's options, not a fault: the session fails saying why
            await self._not_opened(session_id, str(err))
            log.info("session %s not opened: %s", session_id, err)
            return
        except Exception:
            await self._not_opened(session_id, f"the worker could not open it {INTERNAL}")
            raise
        finally:
            self.claiming.discard(session_id)
        if not await self.leases.renew(session_id, hosted):
            await self.intake.close(hosted, delete=False)
            await self.threads.engine(hosted.engine.release)
            return  # opening took longer than the lease, and another worker has it now
        self.sessions[session_id] = hosted
        await self.records.set(session_id, worker=self.leases.worker_id, **progress(hosted.engine))
        await self.records.set(session_id, SessionState.READY, SessionState.PENDING)
        await self._replay(session_id)
        log.info("took session %s", session_id)

    async def _not_opened(self, session_id: str, error: str) -> None:
        """The session cannot be opened: it fails saying why, its place and memory back at once."""
        await self.leases.release(session_id)
        await self.records.set(session_id, SessionState.ERROR, error=error)
        await leave(self.redis, self.keys, session_id, self.leases.model)

    async def _no_room(self, session_id: str) -> None:
        """No room for the session's cache here: back in the queue, for this or another worker."""
        await self.leases.release(session_id)
        await self.leases.requeue(session_id)
        self._no_room_until = time.monotonic() + NO_ROOM_WAIT_S

    async def _open(self, session_id: str, record: SessionRecord) -> Hosted:
        """The session's engine and ingest: restored from its snapshot when it has one."""
        snapshot = await self.store.load(session_id)
        if snapshot is None:
            try:
                hosted = Hosted(record, await self.threads.engine(Session, self.model, self._config(record), self.capacity.pool))
            except ValueError as err:  # the engine's checks of the options against the model (pins, the opening)
                raise OptionsDoNotFit(f"the session's options do not fit its model: {err}") from err
        else:
            log.info("session %s: restoring its snapshot of %d bytes", session_id, len(snapshot.engine))
            read_page = None
            if snapshot.pages is not None:  # its host pages saved apart
                read_page = functools.partial(self.store.read_page, session_id, snapshot.pages)
            hosted = Hosted(
                record, await self.threads.engine(Session.restore, self.model, snapshot.engine, self.capacity.pool, read_page)
            )
            hosted.page_files = snapshot.pages
        await self.intake.reopen(session_id, hosted, snapshot.ingest if snapshot is not None else None)
        return hosted

    def _config(self, record: SessionRecord) -> SessionConfig:
        """A new session's engine options, from its record."""
        return SessionConfig(
            policy=record.policy,
            budget_tokens=record.budget_tokens,
            policy_options=record.policy_options,
            recall=record.recall,
            pin_turns=record.pin_turns,
            context_tokens=self.capacity.context_tokens,
            peak_tokens=self.capacity.peak_tokens(record),
            **({"host_budget_tokens": record.host_budget_tokens, "retrieval_tokens": record.retrieval_tokens} if record.recall else {}),
            **({"system_prompt": record.system_prompt} if record.system_prompt else {}),
        )

    async def _replay(self, session_id: str) -> None:
        """Finish what a dead worker had read but not finished: its questions (each answered once,
        or failed with `session_reset` when it had begun answering), then its media, in order.
        Each handler acknowledges an entry deleted after it was read (no fields)."""
        hosted = self.sessions[session_id]
        for stream, handle in (
            (self.keys.questions(session_id), self.answering.reclaim),
            (self.keys.media(session_id), self.intake.receive),
        ):
            start = "0-0"
            while True:
                start, entries, *_ = await self.redis.xautoclaim(stream, protocol.GROUP, self.leases.worker_id, 0, start, count=64)
                for entry_id, fields in entries:
                    for _ in range(1000):  # the queue has room before the next entry
                        ingest = hosted.ingest
                        if ingest is None or ingest.frames_block or ingest.accepts_media:
                            break
                        await self.intake.step([(session_id, hosted)])
                    await handle(session_id, hosted, entry_id, fields)
                if start in (b"0-0", "0-0"):
                    break
        if hosted.failed:
            await self.intake.fail(session_id, hosted, hosted.error)

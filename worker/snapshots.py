"""Session snapshots where any worker can read them: in Redis when small, in a directory when large.

A snapshot is the engine's `snapshot()` bytes plus the live ingest's state (its sampling clock
and init segment). It lives in the hash `session:{id}:snapshot` (fields `engine` or `path`,
`ingest`, `taken_at`) and expires with the session. Files are written whole, then renamed, so
a reader never sees half a snapshot; on several machines the directory must be shared.

`Snapshots` decides when a held session is snapshotted, and acknowledges the live media a
snapshot covers: until then a crash loses nothing that replaying the media cannot rebuild.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis

from streamvqa import protocol
from streamvqa.protocol import Keys, scripts
from streamvqa.redis_client import FAILURES
from worker.hosted import Hosted
from worker.records import RecordWriter
from worker.threads import Threads

log = logging.getLogger(__name__)

SNAPSHOT_AFTER_ENTRIES = protocol.MEDIA_BACKLOG_ENTRIES // 2  # unacknowledged live media that forces a snapshot
SWEEP_MIN_AGE_S = 60.0  # a file younger than this is never deleted by a sweep


@dataclass(frozen=True)
class Snapshot:
    engine: bytes
    ingest: dict | None  # the live ingest's `state()`, if the session was streaming
    taken_at: float


class SnapshotStore:
    def __init__(self, redis: Redis, keys: Keys, directory: Path, redis_max_bytes: int, ttl_s: int) -> None:
        self.redis = redis
        self._store = redis.register_script(scripts.STORE_SNAPSHOT_LUA)
        self.keys = keys
        self.directory = directory
        self.redis_max_bytes = redis_max_bytes
        self.ttl_s = ttl_s

    async def save(self, session_id: str, engine: bytes, ingest: dict | None) -> int:
        """Store a snapshot, replacing the last; returns its size in bytes (0: the session is gone)."""
        fields: dict[str, bytes | str] = {"ingest": json.dumps(ingest), "taken_at": repr(time.time())}
        if len(engine) <= self.redis_max_bytes:
            fields["engine"] = engine
        else:
            fields["path"] = str(await asyncio.to_thread(self._write_file, session_id, engine))
        pairs = [item for pair in fields.items() for item in pair]
        keys = [self.keys.session(session_id), self.keys.snapshot(session_id)]
        if not await self._store(keys=keys, args=[self.ttl_s, *pairs]):
            return 0  # the session is gone (its file goes with the next sweep)
        if "engine" in fields:
            await asyncio.to_thread(self._path(session_id).unlink, missing_ok=True)
        return len(engine)

    async def load(self, session_id: str) -> Snapshot | None:
        """The session's latest snapshot, or None; OSError when its file is unreachable."""
        fields = await self.redis.hgetall(self.keys.snapshot(session_id))
        if not fields:
            return None
        engine = fields.get(b"engine")
        if engine is None:
            engine = await asyncio.to_thread(Path(fields[b"path"].decode()).read_bytes)
        return Snapshot(engine, json.loads(fields[b"ingest"]), float(fields[b"taken_at"]))

    def delete_file(self, session_id: str) -> None:
        self._path(session_id).unlink(missing_ok=True)

    def _path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.snapshot"

    def _write_file(self, session_id: str, engine: bytes) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(session_id)
        partial = path.with_suffix(".partial")
        partial.write_bytes(engine)
        partial.replace(path)
        return path


class Snapshots:
    """When to snapshot a held session, and what its snapshot lets go of."""

    def __init__(self, store: SnapshotStore, records: RecordWriter, threads: Threads, interval_s: float) -> None:
        self.store = store
        self.records = records
        self.threads = threads
        self.interval_s = interval_s

    async def maybe_take(self, session_id: str, hosted: Hosted, force: bool = False) -> bool:
        """Snapshot a session that changed, every `interval_s` or once SNAPSHOT_AFTER_ENTRIES
        live media entries wait for one, then acknowledge the media it covers. Never in the
        middle of an answer; a live session only while no frame waits for the engine, so the
        media it acknowledges is in the cache (or sampled out). True when the session's state is
        in a snapshot."""
        if hosted.lost or hosted.failed or not hosted.held or hosted.answer is not None:
            return False
        if not (hosted.changed or hosted.unacked):
            return True
        due = time.monotonic() - hosted.snapshot_at >= self.interval_s
        if not (force or due or len(hosted.unacked) >= SNAPSHOT_AFTER_ENTRIES):
            return False
        if hosted.ingest is not None and hosted.ingest.backlog and not force:
            return False
        covered, hosted.unacked = hosted.unacked, []
        changed, hosted.changed, hosted.snapshot_at = hosted.changed, False, time.monotonic()
        try:
            engine = await self.threads.engine(hosted.engine.snapshot)
            ingest = hosted.ingest.state() if hosted.ingest is not None else None
            await self.store.save(session_id, engine, ingest)
        except Exception as err:
            hosted.unacked, hosted.changed = covered + hosted.unacked, changed or hosted.changed
            if isinstance(err, FAILURES):
                raise
            log.exception("session %s: snapshot failed", session_id)
            return False
        if covered:
            await self.records.consume(self.store.keys.media(session_id), *covered)
        return True


async def sweep(redis: Redis, keys: Keys, folders: list[Path]) -> None:
    """Delete spool and snapshot files of sessions that are gone (deleted, expired, or lost with
    a Redis that restarted empty), older than SWEEP_MIN_AGE_S."""
    now = time.time()
    files = [
        path
        for folder in folders
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
        if not await redis.exists(keys.session(path.stem)):
            path.unlink(missing_ok=True)
            log.info("deleted %s: its session is gone", path)

"""Session snapshots where any worker can read them: in Redis when small, in a directory when large.

A snapshot is the engine's `snapshot()` bytes plus the live ingest's state (its sampling clock
and init segment). It lives in the hash `session:{id}:snapshot` (fields `engine` or `path`,
`ingest`, `taken_at`) and expires with the session. Files are written whole, then renamed, so
a reader never sees half a snapshot; on several machines the directory must be shared.
"""

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis

from streamvqa.protocol import Keys, scripts


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

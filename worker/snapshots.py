"""Session snapshots where any worker can read them: in Redis when small, in a directory when large.

A snapshot is the engine's `snapshot()` bytes plus the live ingest's state, in the hash
`session:{id}:snapshot`; a large one, or a host tier's pages saved apart (each in a file of its
own, written once it changed), go to files (docs/protocol.md, "Crash recovery"). Files are
written whole, then renamed, so a reader never sees half a snapshot; on several machines the
directory must be shared. Only the lease holder stores a snapshot, each file has a name of its
own (`<id>.<stamp>.snapshot`, `<id>.pages/`), and files no snapshot names are deleted once the
snapshot that replaced them is stored: a worker that lost the session while it wrote cannot
overwrite the new holder's files, and a reader always finds every file its snapshot names.

`Snapshots` decides when a held session is snapshotted, and acknowledges the live media a
snapshot covers: until then a crash loses nothing that replaying the media cannot rebuild.
"""

import asyncio
import json
import logging
import shutil
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
    pages: dict[int, str] | None = None  # the host pages saved apart: page number -> file name in `<id>.pages`


@dataclass(frozen=True)
class HostPages:
    """A snapshot's host pages saved apart: those that changed, and every page it holds."""

    changed: dict[int, bytes]  # page number -> `Session.changed_host_pages` bytes
    held: list[int]  # every page the snapshot needs
    files: dict[int, str]  # the files of the last snapshot's pages (page number -> name)


class SnapshotStore:
    def __init__(self, redis: Redis, keys: Keys, directory: Path, redis_max_bytes: int, ttl_s: int, worker_id: str) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self._store = redis.register_script(scripts.STORE_SNAPSHOT_LUA)
        self.keys = keys
        self.directory = directory
        self.redis_max_bytes = redis_max_bytes
        self.ttl_s = ttl_s

    async def save(self, session_id: str, engine: bytes, ingest: dict | None, pages: HostPages | None = None) -> tuple[int, dict[int, str] | None]:
        """Store a snapshot, replacing the last; returns the bytes written (0: the session is
        gone, or another worker holds it now) and, with `pages`, the files of its host pages now."""
        fields: dict[str, bytes | str] = {"ingest": json.dumps(ingest), "taken_at": repr(time.time())}
        if len(engine) <= self.redis_max_bytes:
            fields["engine"] = engine
        else:
            fields["path"] = str(await asyncio.to_thread(self._write_file, session_id, engine))
        files = None
        if pages is not None:
            files = await asyncio.to_thread(self._write_pages, session_id, pages)
            fields["pages"] = json.dumps(files)
        pairs = [item for pair in fields.items() for item in pair]
        keys = [self.keys.session(session_id), self.keys.snapshot(session_id), self.keys.lease(session_id)]
        stored, replaced = await self._store(keys=keys, args=[self.ttl_s, self.worker_id, *pairs])
        if stored != 1:  # the session is gone (its files go with the next sweep), or is another worker's
            if stored == -1:
                await asyncio.to_thread(self._forget, session_id, fields.get("path"), pages, files)
            return 0, files
        last = replaced.decode() if replaced is not None else None  # the file of the snapshot replaced
        if last not in (None, fields.get("path")):
            await asyncio.to_thread(Path(last).unlink, missing_ok=True)
        if files is not None:
            await asyncio.to_thread(self._prune_pages, session_id, files)
        return len(engine) + sum(len(data) for data in (pages.changed.values() if pages else ())), files

    async def load(self, session_id: str) -> Snapshot | None:
        """The session's latest snapshot, or None; OSError when its file is unreachable."""
        fields = await self.redis.hgetall(self.keys.snapshot(session_id))
        if not fields:
            return None
        engine = fields.get(b"engine")
        if engine is None:
            engine = await asyncio.to_thread(Path(fields[b"path"].decode()).read_bytes)
        pages = {int(number): name for number, name in json.loads(fields[b"pages"]).items()} if b"pages" in fields else None
        return Snapshot(engine, json.loads(fields[b"ingest"]), float(fields[b"taken_at"]), pages)

    def read_page(self, session_id: str, files: dict[int, str], number: int) -> bytes:
        """A host page a snapshot names (OSError when its file is unreachable)."""
        return (self._pages(session_id) / files[number]).read_bytes()

    def delete_file(self, session_id: str) -> None:
        for path in self._files(session_id):
            path.unlink(missing_ok=True)
        shutil.rmtree(self._pages(session_id), ignore_errors=True)

    def _files(self, session_id: str) -> list[Path]:
        """The session's snapshot files (one, or more while a newer one is being stored, or when a
        worker died between writing one and storing it)."""
        if not self.directory.is_dir():
            return []
        return [*self.directory.glob(f"{session_id}.*.snapshot"), *self.directory.glob(f"{session_id}.snapshot")]

    def _forget(self, session_id: str, path: str | None, pages: HostPages | None, files: dict[int, str] | None) -> None:
        """Delete what this worker wrote for a snapshot it could not store (another worker holds
        the session): its file, and the page files it wrote (named by no stored snapshot)."""
        if path is not None:
            Path(path).unlink(missing_ok=True)
        if pages is not None and files is not None:
            for number in pages.changed:
                (self._pages(session_id) / files[number]).unlink(missing_ok=True)

    def _pages(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.pages"

    def _write_pages(self, session_id: str, pages: HostPages) -> dict[int, str]:
        """Each page that changed to a new file (written whole, then renamed); the files of
        every page held."""
        folder = self._pages(session_id)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.time_ns()
        held = set(pages.held)
        files = {number: name for number, name in pages.files.items() if number in held}
        for number, data in pages.changed.items():
            name = f"{number}.{stamp}.page"
            partial = folder / f"{name}.partial"
            partial.write_bytes(data)
            partial.replace(folder / name)
            files[number] = name
        missing = held - set(files)
        if missing:  # a page held that no snapshot saved: a fault, not a snapshot to store
            raise RuntimeError(f"host pages {sorted(missing)[:5]} held but never saved")
        return files

    def _prune_pages(self, session_id: str, files: dict[int, str]) -> None:
        """Delete the page files the stored snapshot does not name."""
        named = set(files.values())
        for path in self._pages(session_id).iterdir():
            if path.name not in named:
                path.unlink(missing_ok=True)

    def _write_file(self, session_id: str, engine: bytes) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{session_id}.{time.time_ns()}.snapshot"
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
        if hosted.failed or not hosted.held or hosted.answer is not None:
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
        apart = hosted.page_files is not None or hosted.host_bytes > self.store.redis_max_bytes
        pages = None
        try:
            if apart:  # its host pages apart, each once it changed
                session = hosted.engine
                engine, changed_pages, held = await self.threads.engine(
                    lambda: (session.snapshot(host_pages=False), session.changed_host_pages(), session.host_pages)
                )
                pages = HostPages(changed_pages, held, hosted.page_files or {})
            else:
                engine = await self.threads.engine(hosted.engine.snapshot)
            ingest = hosted.ingest.state() if hosted.ingest is not None else None
            _, files = await self.store.save(session_id, engine, ingest, pages)
            if files is not None:
                hosted.page_files = files
        except Exception as err:
            hosted.unacked, hosted.changed = covered + hosted.unacked, changed or hosted.changed
            if pages is not None:  # to be written at the next
                await self.threads.engine(hosted.engine.unsaved_host_pages, list(pages.changed))
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
    swept = (".upload", ".snapshot", ".partial", ".pages")
    files = [path for folder in folders if folder.is_dir() for path in folder.iterdir() if path.suffix in swept]
    for path in files:
        try:
            if now - path.stat().st_mtime < SWEEP_MIN_AGE_S:
                continue
        except FileNotFoundError:
            continue
        if not await redis.exists(keys.session(path.name.split(".")[0])):
            if path.is_dir():  # a session's host pages
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            log.info("deleted %s: its session is gone", path)

"""A held session's watches: when each is due a check, the checks a step runs, and their outcome
written to Redis (`streamvqa/protocol/watches.py` has the watch and the rule that fires it).

Before each step the worker reads, in one round trip, the `watches_rev` count of every session
it holds, and the watches again of those where it moved (`Watching.refresh`), so a watch made
before a frame was sent is known before that frame is taken. A watch is due once the cache's
video time is `every_s` past its last check (past its creation before its first); the scheduler
checks the most overdue one of a session that neither answers nor takes frames in that step, and
an ingest's frames stop at a session's next check (`frames_before_check`), so that each check
sees the video up to its own time.

Each outcome is written by one script (scripts.RECORD_CHECK_LUA): the watch and its firing at
once, only if the stored watch is the one the check was decided from. A worker that takes the
session over checks from what Redis holds: a firing is written once, and sent once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from redis.asyncio import Redis

from engine import Check, Checked, Result, Session
from streamvqa import protocol
from streamvqa.protocol import EventEnvelope, Evidence, Keys, Watch, WatchFiredEvent, scripts
from streamvqa.protocol.watches import MAX_CONDITION_CHARS

log = logging.getLogger(__name__)

CHECK_PROMPT_TOKENS = 64  # a check's prompt beside its condition (docs/engine.md: about 20 on SmolLM2)
TIME_EPSILON_S = 1e-6


@dataclass
class SessionWatches:
    """The watches of one held session, as last read from Redis or written by this worker."""

    watches: dict[str, Watch] = field(default_factory=dict)
    rev: bytes | None = None  # the session's `watches_rev` when they were last read (None: never read)
    failed_s: dict[str, float] = field(default_factory=dict)  # a watch whose check failed: the video time of that try

    def _due_s(self, watch: Watch) -> float:
        failed_s = self.failed_s.get(watch.id)
        return watch.due_s() if failed_s is None else max(watch.due_s(), failed_s + watch.every_s)

    def due(self, video_s: float) -> Watch | None:
        """The most overdue watch at video time `video_s`, if one is due."""
        due = [(self._due_s(watch), watch.id) for watch in self.watches.values()]
        due_s, watch_id = min(due, default=(math.inf, ""))
        return self.watches[watch_id] if due_s <= video_s + TIME_EPSILON_S else None

    def frames_before_check(self, next_frame_s: float, fps: float, most: int) -> int:
        """How many of the next frames (the first at `next_frame_s`, then every 1/fps) to take
        so that the last is the first at or past the next check's time: at most `most`. A watch
        due now is checked before those frames (the scheduler's rule): its next check is
        `every_s` after the video time now."""
        now_s = next_frame_s - 1 / fps
        due_s = min(
            (due if (due := self._due_s(watch)) > now_s + TIME_EPSILON_S else now_s + watch.every_s
             for watch in self.watches.values()),
            default=math.inf,
        )
        if due_s == math.inf:
            return most
        return max(1, min(most, math.floor((due_s - next_frame_s) * fps + TIME_EPSILON_S) + 1))


class Watched(Protocol):
    """What checks read and write of a held session (`worker/hosted.py`'s `Hosted`)."""

    engine: Session
    watches: SessionWatches

    @property
    def held(self) -> bool: ...


class Checking:
    """The checks of a step, one due watch of each session; then each outcome written."""

    def __init__(self, watching: Watching, work: list[tuple[str, Watched]]) -> None:
        self.watching = watching
        self.items: list[tuple[str, Watched, Watch, float]] = []  # session id, its session, the watch, the video time
        for session_id, hosted in work:
            video_s = hosted.engine.stats().video_time_s
            watch = hosted.watches.due(video_s)
            if watch is not None:
                self.items.append((session_id, hosted, watch, video_s))

    def work(self) -> list[Check]:
        # an armed watch fires at its threshold: its check then reads its evidence too
        return [
            Check(hosted.engine, watch.condition, watch.threshold if watch.armed else None) for _, hosted, watch, _ in self.items
        ]

    async def publish(self, results: list[Result] | Exception) -> None:
        outcomes = [results] * len(self.items) if isinstance(results, Exception) else results
        for (session_id, hosted, watch, video_s), outcome in zip(self.items, outcomes, strict=True):
            if isinstance(outcome, Checked):
                await self.watching.record(session_id, hosted, watch, video_s, outcome)
            else:  # tried again `every_s` later
                hosted.watches.failed_s[watch.id] = video_s
                log.warning("session %s: the check of watch %s at %.1f s failed: %s", session_id, watch.id, video_s, outcome)


class Watching:
    """Reads the watches of the sessions a worker holds, and writes their checks' outcomes."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._record = redis.register_script(scripts.RECORD_CHECK_LUA)

    async def refresh(self, sessions: Mapping[str, Watched]) -> None:
        """Read again the watches of each held session whose `watches_rev` moved since they
        were last read (or that were never read): one round trip for the counts."""
        held = [(session_id, hosted) for session_id, hosted in sessions.items() if hosted.held]
        if not held:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, _ in held:
                pipe.hget(self.keys.session(session_id), "watches_rev")
            revs = await pipe.execute()
        for (session_id, hosted), rev in zip(held, revs, strict=True):
            rev = rev or b"0"
            if rev != hosted.watches.rev:
                await self.read(session_id, hosted, rev)

    async def read(self, session_id: str, hosted: Watched, rev: bytes | None = None) -> None:
        """The session's watches as Redis holds them now; `rev`: the count read just before
        (None: read it too)."""
        if rev is None:
            rev = await self.redis.hget(self.keys.session(session_id), "watches_rev") or b"0"
        stored = await self.redis.hgetall(self.keys.watches(session_id))
        hosted.watches.rev = rev
        hosted.watches.watches = {key.decode(): Watch.model_validate_json(value) for key, value in stored.items()}
        hosted.watches.failed_s = {key: value for key, value in hosted.watches.failed_s.items() if key in hosted.watches.watches}

    async def checks(self, work: list[tuple[str, Watched]]) -> Checking | None:
        """The checks of a step (None when none of these sessions has one due)."""
        checking = Checking(self, work)
        return checking if checking.items else None

    async def record(self, session_id: str, hosted: Watched, watch: Watch, time_s: float, checked: Checked) -> None:
        """Write a check's outcome (and its firing, as a `watch_fired` event) unless another
        worker wrote this watch meanwhile; then read the watches again."""
        evidence = [Evidence(time_s=e.time_s, weight=e.weight) for e in checked.evidence]
        after, firing = watch.checked(time_s, checked.p_yes, evidence)
        event = ""
        if firing is not None:
            fired = WatchFiredEvent(watch_id=watch.id, time_s=firing.time_s, probability=firing.probability, evidence=firing.evidence)
            event = EventEnvelope(event=fired).model_dump_json()
        keys = [self.keys.session(session_id), self.keys.watches(session_id), self.keys.events(session_id)]
        args = [watch.id, watch.checks, after.checked_s, after.model_dump_json(), event, protocol.EVENTS_MAXLEN]
        written = await self._record(keys=keys, args=args)
        hosted.watches.failed_s.pop(watch.id, None)
        if written == 1:
            hosted.watches.watches[watch.id] = after
        else:  # deleted, or written by another worker: what Redis holds now
            await self.read(session_id, hosted)


def check_tokens(watch: Watch | None) -> int:
    """What a check counts in a step's token budget: its prompt, the condition at most a token a character."""
    return CHECK_PROMPT_TOKENS + (len(watch.condition) if watch is not None else MAX_CONDITION_CHARS)

"""A session's watches: standing yes/no conditions its worker checks every few seconds of video,
firing a `watch_fired` event when one becomes true (`streamvqa/protocol/watches.py` has the rule).
The routes add, list, look up and remove them; the worker checks them."""

import time
import uuid

from fastapi import APIRouter, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, field_validator

from app.deps import AuthorizedSession, KeysDep, RedisDep, Settings
from app.errors import ApiError, ErrorBody
from streamvqa.protocol import Watch, scripts
from streamvqa.protocol.watches import DEFAULT_EVERY_S, DEFAULT_THRESHOLD, MAX_CONDITION_CHARS, MAX_EVERY_S

router = APIRouter(tags=["watches"])


class NewWatch(BaseModel):
    condition: str = Field(
        min_length=1, max_length=MAX_CONDITION_CHARS, description="A yes/no condition about the video, like 'a red circle is visible'."
    )
    every_s: float = Field(
        DEFAULT_EVERY_S, gt=0, le=MAX_EVERY_S,
        description="Seconds of video between two checks; at least the session's frame interval (1/fps).",
    )
    threshold: float = Field(DEFAULT_THRESHOLD, gt=0, le=1, description="p(yes) at or above which the watch fires.")

    @field_validator("condition")
    @classmethod
    def _not_blank(cls, condition: str) -> str:
        if not condition.strip():
            raise ValueError("the condition is blank")
        return condition


class WatchList(BaseModel):
    watches: list[Watch] = Field(description="The session's watches, oldest first.")
    max_watches: int = Field(description="The most watches a session may have (MAX_WATCHES_PER_SESSION).")


@router.post(
    "/sessions/{session_id}/watches", status_code=status.HTTP_201_CREATED,
    responses={429: {"model": ErrorBody, "description": "`too_many_watches`: the session has MAX_WATCHES_PER_SESSION."}},
)
async def create_watch(session: AuthorizedSession, body: NewWatch, redis: RedisDep, keys: KeysDep, settings: Settings) -> Watch:
    """Watch the session's video for a condition: from now on, every `every_s` seconds of video
    its worker scores p(yes) and fires a `watch_fired` event when it reaches `threshold`."""
    interval_s = 1 / session.fps
    if body.every_s < interval_s - 1e-9:
        message = f"at least the session's frame interval, {interval_s:g} s (its fps is {session.fps:g})"
        raise RequestValidationError([{"loc": ("body", "every_s"), "msg": message, "type": "value_error"}])
    watch = Watch(
        id=uuid.uuid4().hex, condition=body.condition, every_s=body.every_s, threshold=body.threshold,
        created_video_s=session.video_time_s, created_at=round(time.time(), 3),
    )
    add = redis.register_script(scripts.ADD_WATCH_LUA)
    added = await add(
        keys=[keys.session(session.id), keys.watches(session.id)],
        args=[settings.max_watches_per_session, watch.id, watch.model_dump_json()],
    )
    if added == -1:
        raise ApiError(404, "session_not_found", "no such session (or it expired)")
    if added == 0:
        raise ApiError(
            429, "too_many_watches",
            f"the session has {settings.max_watches_per_session} watches (MAX_WATCHES_PER_SESSION); delete one first",
        )
    return watch


@router.get("/sessions/{session_id}/watches")
async def list_watches(session: AuthorizedSession, redis: RedisDep, keys: KeysDep, settings: Settings) -> WatchList:
    stored = await redis.hvals(keys.watches(session.id))
    watches = sorted((Watch.model_validate_json(value) for value in stored), key=lambda w: (w.created_at, w.id))
    return WatchList(watches=watches, max_watches=settings.max_watches_per_session)


@router.get("/sessions/{session_id}/watches/{watch_id}")
async def get_watch(session: AuthorizedSession, watch_id: str, redis: RedisDep, keys: KeysDep) -> Watch:
    """The watch, with its firings (`fired`, the latest 100) and its last check."""
    stored = await redis.hget(keys.watches(session.id), watch_id)
    if stored is None:
        raise _no_watch(watch_id)
    return Watch.model_validate_json(stored)


@router.delete("/sessions/{session_id}/watches/{watch_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_watch(session: AuthorizedSession, watch_id: str, redis: RedisDep, keys: KeysDep) -> None:
    """Stop the watch and forget its firings (its events stay in the session's events)."""
    delete = redis.register_script(scripts.DELETE_WATCH_LUA)
    if not await delete(keys=[keys.session(session.id), keys.watches(session.id)], args=[watch_id]):
        raise _no_watch(watch_id)


def _no_watch(watch_id: str) -> ApiError:
    return ApiError(404, "watch_not_found", f"the session has no watch {watch_id[:64]!r}")

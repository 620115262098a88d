"""Typed dependencies of the routes: settings, Redis, the session store, the caller's session."""

import re
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis

from app.errors import ApiError
from app.sessions import SessionStore
from app.settings import GatewaySettings
from streamvqa.protocol import Keys, SessionRecord

SESSION_ID = re.compile(r"[0-9a-f]{32}")
_bearer = HTTPBearer(auto_error=False, description="The session's token, from `POST /sessions`.")


def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


def get_redis(request: Request) -> Redis:
    return request.app.state.redis


def get_keys(request: Request) -> Keys:
    return request.app.state.keys


def get_store(request: Request) -> SessionStore:
    return request.app.state.store


Settings = Annotated[GatewaySettings, Depends(get_settings)]
RedisDep = Annotated[Redis, Depends(get_redis)]
KeysDep = Annotated[Keys, Depends(get_keys)]
Store = Annotated[SessionStore, Depends(get_store)]


async def authorized_session(
    session_id: str,
    store: Store,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> SessionRecord:
    """The session named in the path, when the caller holds its token: 404, 401 or 403 otherwise."""
    if not SESSION_ID.fullmatch(session_id):
        raise ApiError(404, "session_not_found", f"no session {session_id}")
    record, valid = await store.authenticate(session_id, credentials.credentials if credentials else None)
    if record is None:
        raise ApiError(404, "session_not_found", f"no session {session_id}")
    if credentials is None:
        raise ApiError(
            401, "unauthorized", "send the session token as 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )
    if not valid:
        raise ApiError(403, "forbidden", "the token is not this session's token")
    await store.touch(session_id)
    return record


AuthorizedSession = Annotated[SessionRecord, Depends(authorized_session)]

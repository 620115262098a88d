"""Typed dependencies of the routes, HTTP and WebSocket alike: settings, Redis, the session store,
metrics, the rate limiter, the caller and the caller's session.

Each is `async def`, though none awaits: FastAPI runs a plain `def` dependency on its thread
pool, a hop that made `GET /sessions/{id}` measurably slower (docs/benchmarks.md, "Gateway")."""

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.requests import HTTPConnection
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis

from app.chat_media import DEFAULT_PORTS, MediaSlots
from app.errors import ApiError
from app.limits import RateLimiter, key_id
from app.metrics import GatewayMetrics
from app.sessions import SessionStore
from app.settings import GatewaySettings
from streamvqa.protocol import Keys, SessionRecord

_bearer = HTTPBearer(auto_error=False, description="The session's token, from `POST /sessions`.")
_api_key = APIKeyHeader(
    name="X-API-Key", auto_error=False, description="An API key, when the gateway has `API_KEYS`: creates and lists sessions."
)


def _app_state(name: str) -> Callable[[HTTPConnection], Awaitable[Any]]:
    """The dependency that reads `name` of the app's state (set up at start, app/main.py)."""

    async def dependency(connection: HTTPConnection) -> Any:
        return getattr(connection.app.state, name)

    return dependency


Settings = Annotated[GatewaySettings, Depends(_app_state("settings"))]
RedisDep = Annotated[Redis, Depends(_app_state("redis"))]
KeysDep = Annotated[Keys, Depends(_app_state("keys"))]
Store = Annotated[SessionStore, Depends(_app_state("store"))]
Metrics = Annotated[GatewayMetrics, Depends(_app_state("metrics"))]
Limiter = Annotated[RateLimiter, Depends(_app_state("rate_limiter"))]
ChatMediaSlots = Annotated[MediaSlots, Depends(_app_state("chat_media_slots"))]


async def bearer_token(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str | None:
    return credentials.credentials if credentials else None


Bearer = Annotated[str | None, Depends(bearer_token)]


def valid_api_key(settings: GatewaySettings, api_key: str | None) -> bool:
    """Whether `api_key` is one of the configured keys (each compared in constant time)."""
    if api_key is None:
        return False
    given = api_key.encode()
    return any([hmac.compare_digest(given, key.encode()) for key in settings.api_key_list])


def _check_key(settings: GatewaySettings, api_key: str | None, how: str) -> None:
    """401 without an API key (`how` says how to send one), 403 for one that is not valid."""
    if api_key is None:
        raise ApiError(401, "api_key_required", f"send an API key {how}")
    if not valid_api_key(settings, api_key):
        raise ApiError(403, "api_key_invalid", "the API key is not valid")


def caller_of(settings: GatewaySettings, api_key: str | None, address: str) -> str:
    """Who is calling, for limits and ownership: the API key's id, else the client's address."""
    if settings.api_key_list and valid_api_key(settings, api_key):
        return f"key:{key_id(api_key)}"
    return f"addr:{address}"


async def api_caller(request: Request, settings: Settings, api_key: Annotated[str | None, Depends(_api_key)]) -> str:
    """The caller who creates or lists sessions: with API keys configured, one of them is needed."""
    if settings.api_key_list:
        _check_key(settings, api_key, "as the X-API-Key header")
    return caller_of(settings, api_key, address_of(request))


async def limited_caller(connection: HTTPConnection, settings: Settings) -> str:
    """Who a rate limit counts: the caller's valid API key (as X-API-Key, or as the bearer token,
    as OpenAI's clients send it), else its address (no key needed)."""
    scheme, _, bearer = connection.headers.get("authorization", "").partition(" ")
    address = address_of(connection)
    keyed = session_owner(settings, connection.headers.get("x-api-key"), bearer if scheme.lower() == "bearer" else None, address)
    return keyed or caller_of(settings, None, address)


LimitedCaller = Annotated[str, Depends(limited_caller)]


async def rate_limit(limiter: Limiter, caller: LimitedCaller) -> None:
    """429 when the caller (API key, else address) is over `RATE_LIMIT_PER_S`."""
    await limiter.check(caller)


Caller = Annotated[str, Depends(api_caller)]


async def metrics_reader(settings: Settings, api_key: Annotated[str | None, Depends(_api_key)], bearer: Bearer) -> None:
    """With API keys configured, `/metrics` needs one (unless METRICS_PUBLIC): as X-API-Key, or as
    a bearer token, which is what Prometheus' `authorization` setting sends."""
    if settings.api_key_list and not settings.metrics_public:
        _check_key(settings, api_key if api_key is not None else bearer, "as the X-API-Key header or as a bearer token")


def origin_allowed(connection: HTTPConnection, settings: GatewaySettings) -> bool:
    """Whether a socket's page may open it: no Origin (not a browser), the gateway's own origin
    (the Origin's host and port are the Host header's), or one of CORS_ORIGINS."""
    origin = connection.headers.get("origin")
    if origin is None:
        return True
    allowed = settings.cors_origin_list
    if "*" in allowed or origin.rstrip("/") in allowed:
        return True
    parts = urlsplit(origin)
    try:
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
        host = urlsplit(f"//{connection.headers.get('host', '')}")
        host_port = host.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:  # a port that is not a number
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.hostname, port) == (host.hostname, host_port)


async def _session(
    session_id: str, store: SessionStore, token: str | None, owner: str | None = None, presented: bool = False,
    hint: str = "",
) -> SessionRecord:
    """The session `session_id` when `token` is its token or `owner` created it: 404 when there
    is none, 401 when nothing was presented (no token, nor `presented`: an API key), 403 else;
    `hint` ends the 401's message."""
    record, valid = await store.authenticate(session_id, token, owner)
    if record is None:
        raise ApiError(404, "session_not_found", f"no session {session_id}")
    if not valid and token is None and not presented:
        raise ApiError(
            401, "unauthorized", f"send the session token as 'Authorization: Bearer <token>'{hint}",
            {"WWW-Authenticate": "Bearer"},
        )
    if not valid:
        whose = "this session's token" + (" nor its owner's API key" if presented else "")
        raise ApiError(403, "forbidden", f"the {'credentials are' if presented else 'token is'} not {whose}")
    await store.touch(session_id)
    return record


async def authorized_session(session_id: str, store: Store, bearer: Bearer) -> SessionRecord:
    """The session named in the path, when the caller holds its token: 404, 401 or 403 otherwise."""
    return await _session(session_id, store, bearer)


AuthorizedSession = Annotated[SessionRecord, Depends(authorized_session)]


def session_owner(settings: GatewaySettings, api_key: str | None, bearer: str | None, address: str) -> str | None:
    """Who the sessions a caller creates belong to (their `owner`), and whose limits it counts
    against: with API_KEYS, the valid key sent as X-API-Key or as the bearer token (None without
    one); without, the client's `address`. An address proves nothing by itself: see
    `proven_owner` for who may act as an owner."""
    if not settings.api_key_list:
        return caller_of(settings, None, address)
    key = next((key for key in (api_key, bearer) if valid_api_key(settings, key)), None)
    return None if key is None else caller_of(settings, key, address)


def proven_owner(settings: GatewaySettings, api_key: str | None, bearer: str | None, address: str) -> str | None:
    """The owner a caller may act as, ending the sessions it created without their tokens: with
    API_KEYS, its valid key (X-API-Key, or as the bearer token); without, its address only where
    ADDRESS_OWNS_SESSIONS says that an address is one person, and only when it presents no bearer
    token (a token names its own session: another session's is refused, whoever sends it)."""
    if settings.api_key_list:
        return session_owner(settings, api_key, bearer, address)
    if settings.address_owns_sessions and bearer is None:
        return caller_of(settings, None, address)
    return None


def address_of(connection: HTTPConnection) -> str:
    return connection.client.host if connection.client else "unknown"


async def owned_session(
    session_id: str,
    connection: HTTPConnection,
    store: Store,
    settings: Settings,
    api_key: Annotated[str | None, Depends(_api_key)],
    bearer: Bearer,
) -> SessionRecord:
    """The session named in the path, when the caller holds its token or acts as its owner
    (`proven_owner`: the API key that created it; without API_KEYS, only with
    ADDRESS_OWNS_SESSIONS, the address it was created from): 404, 401 or 403 otherwise. A caller
    that is not the owner learns no more than without this: that the id exists."""
    owner = proven_owner(settings, api_key, bearer, address_of(connection))
    presented = bool(settings.api_key_list) and api_key is not None
    hint = ", or call as its owner: with the API key that created it" if settings.api_key_list else (
        ", or call from the address that created it" if settings.address_owns_sessions else ""
    )  # how else than with its token the caller may act on the session
    return await _session(session_id, store, bearer, owner, presented, hint)


OwnedSession = Annotated[SessionRecord, Depends(owned_session)]


@dataclass(frozen=True)
class Viewer:
    """Whose sessions a caller sees (`GET /sessions`, and their ids in `GET /models`): of those
    `owner` created, every one when `every` (it proved itself their owner: an API key, or with
    ADDRESS_OWNS_SESSIONS an address), else only the one whose token is `token`, if any."""

    owner: str
    every: bool
    token: str | None = None


async def session_viewer(caller: Caller, settings: Settings, bearer: Bearer) -> Viewer:
    """With API_KEYS the key (one is needed); without, the address, which sees every session it
    created only with ADDRESS_OWNS_SESSIONS, else the one whose token it presents."""
    if settings.api_key_list or settings.address_owns_sessions:
        return Viewer(caller, every=True)
    return Viewer(caller, every=False, token=bearer)


SessionViewer = Annotated[Viewer, Depends(session_viewer)]

"""The gateway application: `create_app(settings)` wires Redis, the routes and the dashboard."""

import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from app import asks, completions, errors, ops, routes, samples, streams, watches
from app.chat_media import MediaSlots
from app.deps import rate_limit
from app.hosts import HostCheck, allowed_names
from app.limits import BodyLimit, RateLimiter
from app.metrics import GatewayMetrics, RequestCounter
from app.sessions import SessionStore
from app.settings import GatewaySettings
from streamvqa.protocol import Keys
from streamvqa.redis_client import close, connect

DESCRIPTION = """
Ask questions about a live or uploaded video, in real time, in bounded memory.

Create a session (`POST /sessions`), send it video (`POST /sessions/{id}/upload`, or live over
`WS /sessions/{id}/stream`), and ask (`POST /sessions/{id}/ask`). Every call on a session carries
its token: `Authorization: Bearer <token>`. Errors are JSON: `{"code": "...", "message": "..."}`.
The WebSocket protocol is in docs/streaming.md and docs/protocol.md.

OpenAI's clients work against `/v1`: `POST /v1/chat/completions` answers the last user message
about a video or image sent in `messages` (a `video_url` or `image_url` part: a session is made
for it, named in the `X-Session-Id` header and the reply's `session_id`), or about a session's
video (its `session_id` in the body; its token, or with `API_KEYS` the key that owns it, as the
API key). `GET /v1/models` and `GET /v1/models/{id}` tell the models served. Errors there take
OpenAI's shape.
"""


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = connect(settings.redis_url, settings.redis_max_connections, cluster=settings.redis_cluster)
        keys = Keys(settings.redis_prefix)
        app.state.settings = settings
        app.state.redis = redis
        app.state.keys = keys
        app.state.store = SessionStore(redis, keys, settings.session_ttl_s)
        app.state.metrics = metrics
        app.state.rate_limiter = RateLimiter(
            redis, keys.rate, settings.rate_limit_per_s, settings.rate_limit_burst, metrics.rate_limited
        )
        app.state.stream_sockets = 0  # open `WS /sessions/{id}/stream` sockets, at most max_stream_sockets
        app.state.chat_media_slots = MediaSlots(settings.max_chat_media_requests)
        app.state.started_at = int(time.time())  # unix seconds: `created` of the models /v1/models lists
        try:
            yield
        finally:
            await close(redis)

    # /docs (Swagger UI) and /redoc with the assets fastapi-offline ships: no CDN, so they work offline
    app = FastAPIOffline(title="streamvqa", description=DESCRIPTION, version="0.1.0", lifespan=lifespan)
    errors.install(app, openai_routes=completions.router.routes)
    limited = [Depends(rate_limit)]
    app.include_router(ops.router)
    for router in (routes.router, asks.router, watches.router):
        app.include_router(router, dependencies=limited, responses=errors.ERROR_RESPONSES)
    app.include_router(completions.router, dependencies=limited)
    app.include_router(samples.router, dependencies=limited)
    app.include_router(streams.router)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.header_timeout_s,
        larger={completions.CHAT_PATH: settings.chat_body_bytes}, min_bytes_per_s=settings.upload_min_bytes_per_s,
    )
    if settings.cors_origin_list:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origin_list),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-API-Key", "Last-Event-ID", "Accept", completions.SESSION_HEADER],
            expose_headers=["Location", "Retry-After", completions.SESSION_HEADER],
            max_age=600,
        )
    app.add_middleware(RequestCounter, metrics=metrics)
    # the outermost: a request to another name is refused before anything answers it
    app.add_middleware(HostCheck, allowed=allowed_names(settings.allowed_host_list, settings.host))
    if settings.frontend_dir.is_dir():
        app.mount("/", StaticFiles(directory=settings.frontend_dir, html=True), name="dashboard")
    else:
        logging.getLogger(__name__).warning("no dashboard: %s is not a folder", settings.frontend_dir)
    return app

"""The gateway application: `create_app(settings)` wires Redis, the routes and the dashboard."""

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from app import errors
from app import streams
from app.routes import router
from app.sessions import SessionStore
from app.settings import GatewaySettings
from streamvqa.protocol import Keys
from streamvqa.redis_client import connect


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = connect(settings.redis_url, settings.redis_max_connections)
        keys = Keys(settings.redis_prefix)
        app.state.settings = settings
        app.state.redis = redis
        app.state.keys = keys
        app.state.store = SessionStore(redis, keys, settings.session_ttl_s)
        app.state.stream_sockets = 0  # open `WS /sessions/{id}/stream` sockets, at most max_stream_sockets
        try:
            yield
        finally:
            await redis.aclose()
            await redis.connection_pool.aclose()

    app = FastAPI(
        title="streamvqa",
        summary="Ask questions about a live or uploaded video, in real time, in bounded memory.",
        version="0.1.0",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(router)
    app.include_router(streams.router)
    if settings.frontend_dir.is_dir():
        app.mount("/", StaticFiles(directory=settings.frontend_dir, html=True), name="dashboard")
    else:
        logging.getLogger(__name__).warning("no dashboard: %s is not a folder", settings.frontend_dir)
    return app

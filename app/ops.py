"""Operations: liveness, readiness and Prometheus metrics (no session, no token; with API keys,
metrics need one unless METRICS_PUBLIC)."""

import logging

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.deps import Metrics, RedisDep, Store, metrics_reader
from app.errors import ERROR_RESPONSES, REDIS_UNREACHABLE, ApiError, ErrorBody

log = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])


UNAVAILABLE = {503: {"model": ErrorBody, "description": "`redis_unreachable` (and for readiness, `no_worker`)."}}


@router.get("/healthz", responses=UNAVAILABLE)
async def healthz(redis: RedisDep) -> dict[str, str]:
    """200 while the gateway reaches Redis."""
    try:
        await redis.ping()
    except Exception as err:
        log.warning("Redis is unreachable: %s", err)
        raise ApiError(503, "redis_unreachable", REDIS_UNREACHABLE) from err
    return {"status": "ok"}


@router.get("/readyz", responses=UNAVAILABLE)
async def readyz(store: Store) -> dict[str, str | int]:
    """200 when the gateway reaches Redis and at least one worker is alive; 503 otherwise."""
    try:
        alive = await store.live_workers(None)
    except Exception as err:
        log.warning("Redis is unreachable: %s", err)
        raise ApiError(503, "redis_unreachable", REDIS_UNREACHABLE, {"Retry-After": "5"}) from err
    if not alive:
        raise ApiError(503, "no_worker", "no worker is alive", {"Retry-After": "5"})
    return {"status": "ready", "workers": len(alive)}


@router.get(
    "/metrics", response_class=Response, dependencies=[Depends(metrics_reader)],
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, 401: ERROR_RESPONSES[401], 403: ERROR_RESPONSES[403]},
)
async def metrics(store: Store, gateway: Metrics) -> Response:
    """Prometheus text format: this gateway's requests, questions, answer latencies and stream
    bytes, and every live worker's sessions, frames ingested, evictions, answers and ingest lag.
    With API_KEYS set, it needs a key (X-API-Key or a bearer token) unless METRICS_PUBLIC is true."""
    return Response(gateway.render(await store.live_workers(None)), media_type=CONTENT_TYPE_LATEST)

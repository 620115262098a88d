"""Limits on what one caller may ask of the gateway: request rate, body size, socket message rate."""

import asyncio
import hashlib
import json
import time

from prometheus_client import Counter
from redis.asyncio import Redis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OPENAI_PREFIX, ApiError, openai_error
from streamvqa.protocol import scripts


def key_id(api_key: str) -> str:
    """A name for an API key that reveals nothing of it (in Redis keys and logs)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


class RateLimiter:
    def __init__(self, redis: Redis, bucket_key, per_s: float, burst: int, refused: Counter) -> None:
        self._take = redis.register_script(scripts.RATE_BUCKET_LUA)
        self._bucket_key = bucket_key  # caller -> Redis key
        self.per_s, self.burst = per_s, burst
        self._refused = refused  # counts the requests and sockets refused

    async def check(self, caller: str) -> None:
        """ApiError 429 (with Retry-After) when `caller` is over its rate."""
        if self.per_s <= 0:
            return
        wait_ms = await self._take(keys=[self._bucket_key(caller)], args=[self.per_s, self.burst])
        if wait_ms:
            self._refused.inc()
            retry = str(max(1, -(-int(wait_ms) // 1000)))
            raise ApiError(429, "rate_limited", f"too many requests; try again in {retry} s", {"Retry-After": retry})


class MessageRate:
    """A socket's own token bucket: `per_s` messages a second, bursts of twice that."""

    def __init__(self, per_s: float) -> None:
        self.per_s, self.burst = per_s, 2 * per_s
        self._tokens, self._at = self.burst, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class BodyLimit:
    """ASGI middleware: request bodies over `max_bytes` are refused with 413, whether they
    announce their length or not, and bodies not all received within `timeout_s` (from when the
    app first reads the body: at once, but for a chat completion that waits for its turn to read
    one that may carry media, `chat_media.MediaSlots`) with 408;
    uploads (paths ending in /upload) have limits of their own. A path of `larger` (path ->
    bytes: a route that carries media in its JSON) may be that large instead, and its body may
    take longer: `timeout_s` plus a second for each `min_bytes_per_s` received (the upload's
    pace). Refusals on /v1 take OpenAI's error shape."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout_s: float, larger: dict[str, int] | None = None,
        min_bytes_per_s: int = 0,
    ) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.larger, self.min_bytes_per_s = larger or {}, min_bytes_per_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].endswith("/upload"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        max_bytes = self.larger.get(path, self.max_bytes)
        paced = path in self.larger and self.min_bytes_per_s > 0
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await _refuse(send, path, 413, "body_too_large", f"the request body exceeds {max_bytes} bytes")
            return
        received, refused, complete = 0, False, False
        started: float | None = None  # when the app first read the body

        def deadline() -> float:
            return started + self.timeout_s + (received / self.min_bytes_per_s if paced else 0.0)

        async def limited() -> Message:
            nonlocal received, refused, complete, started
            started = started if started is not None else time.monotonic()
            if refused:
                return {"type": "http.disconnect"}
            if complete:  # the body is in; later calls wait for the client to leave
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline() - time.monotonic()))
            except TimeoutError:
                refused = True
                pace = f" plus a second per {self.min_bytes_per_s} bytes" if paced else ""
                await _refuse(send, path, 408, "body_timeout", f"the request body did not arrive within {self.timeout_s:g} s{pace}")
                return {"type": "http.disconnect"}
            received += len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if received > max_bytes:  # answer now; the app sees the client leave
                refused = True
                await _refuse(send, path, 413, "body_too_large", f"the request body exceeds {max_bytes} bytes")
                return {"type": "http.disconnect"}
            return message

        async def sending(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited, sending)


async def _refuse(send: Send, path: str, status: int, code: str, message: str) -> None:
    error = openai_error(status, code, message) if path.startswith(OPENAI_PREFIX) else {"code": code, "message": message}
    body = json.dumps(error).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

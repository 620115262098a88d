"""The Host check: the gateway answers only to its own names (ALLOWED_HOSTS).

A page of any site can point its own name at 127.0.0.1 (DNS rebinding): its browser then takes
the gateway for that page's own origin, so neither CORS nor the sockets' Origin check stops it
from listing, using and ending sessions. Its requests still name its site in their Host header:
a gateway that answers only to its own names refuses them, with `400 invalid_host`, and refuses
such a socket before it opens."""

import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import OPENAI_PREFIX, openai_error

log = logging.getLogger(__name__)

ANY_HOST_PATHS = ("/healthz", "/readyz")  # probes call by address (a pod's, a container's); they tell nothing
MAX_NAMES_LOGGED = 16  # refused names worth a warning each, the first ones (a misconfiguration shows at once)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")  # HOST values that bind every address: no one name


def allowed_names(allowed_hosts: tuple[str, ...], bound: str) -> tuple[str, ...]:
    """The names answered, as `host_allowed` compares them: ALLOWED_HOSTS (`allowed_hosts`), else
    the loopback names and `bound` (HOST) when it is one address."""
    if allowed_hosts:
        return tuple(_configured(name) for name in allowed_hosts)
    bound = _configured(bound)
    return LOOPBACK_NAMES + (() if bound in WILDCARD_ADDRESSES or bound in LOOPBACK_NAMES else (bound,))


def _configured(name: str) -> str:
    """A configured name as `host_name` gives a header's: lower case, no port, an IPv6 address
    without brackets (with them or not), no trailing dot."""
    name = name.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:  # name:port (an IPv6 address has two colons or more)
        name = name.partition(":")[0]
    return name.rstrip(".")


def host_name(host: str) -> str | None:
    """The name of a Host header (`name`, `name:port`, `[IPv6]:port`), lower case, without a
    trailing dot; None for a header that is not one."""
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket:
            return None
    else:
        name, colon, port = host.partition(":")
        rest = colon + port
    if rest and not (rest[0] == ":" and rest[1:].isdigit()):
        return None
    return name.rstrip(".") or None


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether the Host header names one of `allowed`: a name, `*.domain` (any name under it) or
    `*` (any Host at all)."""
    if "*" in allowed:
        return True
    name = host_name(host) if host is not None else None
    if name is None:
        return False
    return any(name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in allowed)


class HostCheck:
    """ASGI middleware: a request or socket whose Host is not one of `allowed` is refused."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, allowed
        self.logged: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in ANY_HOST_PATHS:
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(b"host")
        host = raw.decode("latin-1") if raw is not None else None
        if host_allowed(host, self.allowed):
            await self.app(scope, receive, send)
            return
        shown = "no Host header" if host is None else f"the Host {host[:100]!r}"
        if len(self.logged) < MAX_NAMES_LOGGED and shown not in self.logged:
            self.logged.add(shown)
            log.warning("refused a request with %s: add its name to ALLOWED_HOSTS if it is this gateway's", shown)
        message = f"{shown} is not a name of this gateway (ALLOWED_HOSTS)"
        error = openai_error(400, "invalid_host", message) if scope["path"].startswith(OPENAI_PREFIX) else (
            {"code": "invalid_host", "message": message}
        )
        body = json.dumps(error).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):  # the refusal as an HTTP reply, with its reason
            await send({"type": "websocket.http.response.start", "status": 400, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})

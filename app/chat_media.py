"""The bytes of a chat completion's media part: a data URL decoded, or an http(s) URL fetched
(bounded in size and time; from public addresses only, unless MEDIA_FETCH_PRIVATE), with its
SHA-256. The gateway never decodes them: a video goes to
the worker as an upload does, an image as a stream socket's frame does."""

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

import httpx

from app.chat_messages import MediaRef
from app.errors import ApiError
from app.settings import GatewaySettings
from streamvqa.protocol import FRAME_HEADER_BYTES, frame_message, parse_frame_header

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Media:
    kind: str  # video or image
    data: bytes
    sha256: str
    param: str  # where the request sent it


def limit_bytes(kind: str, settings: GatewaySettings) -> int:
    """The largest media of `kind` a chat completion may carry: a video what an upload may be
    (MAX_CHAT_MEDIA_BYTES at most), an image what a `frames` message on a socket may hold."""
    return settings.chat_media_bytes if kind == "video" else settings.ws_max_message_bytes - FRAME_HEADER_BYTES


async def load(ref: MediaRef, settings: GatewaySettings) -> Media:
    """The part's bytes; ApiError 400 for a URL that is neither data nor http(s), a data URL that
    does not decode, an image not JPEG, PNG or WebP, a URL whose host (or a redirect's) is not
    a public address (`media_url_private`), or one that cannot be fetched in
    MEDIA_FETCH_TIMEOUT_S; 413 over the limit of its kind."""
    max_bytes = limit_bytes(ref.kind, settings)
    scheme = ref.url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _decoded(ref, max_bytes)
    elif scheme in ("http", "https"):
        if not settings.media_fetch_urls:
            raise _bad(ref, "invalid_media_url", "this gateway takes media as data URLs only (MEDIA_FETCH_URLS=false)")
        data = await _fetched(ref, max_bytes, settings)
    else:
        raise _bad(ref, "invalid_media_url", f"a {ref.kind} URL must be a data URL or http(s), not {scheme[:20]!r}")
    if not data:
        raise _bad(ref, "invalid_media", f"the {ref.kind} is empty")
    if ref.kind == "image":
        try:
            parse_frame_header(frame_message(0.0, data))  # the rule of a socket's `frames` message
        except ValueError as err:
            raise _bad(ref, "invalid_media", str(err).replace("a frame's image", "an image_url")) from err
    return Media(ref.kind, data, hashlib.sha256(data).hexdigest(), ref.param)


def _decoded(ref: MediaRef, max_bytes: int) -> bytes:
    header, comma, payload = ref.url[5:].partition(",")
    if not comma:
        raise _bad(ref, "invalid_media_url", "a data URL is data:[<type>][;base64],<data>")
    if header.lower().endswith(";base64"):
        if len(payload) * 3 // 4 > max_bytes + 2:  # before decoding it
            raise _too_large(ref, max_bytes)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise _bad(ref, "invalid_media_url", f"the data URL's base64 does not decode: {err}") from err
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(ref, max_bytes)
    return data


async def _fetched(ref: MediaRef, max_bytes: int, settings: GatewaySettings) -> bytes:
    """The body of the URL, following up to MAX_REDIRECTS redirects, each hop's host checked
    (`_request`); `media_unreachable` for a reply not 200, a failure, or over the time."""
    timeout_s, url = settings.media_fetch_timeout_s, ref.url
    try:
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=timeout_s, trust_env=False) as http:
            for _ in range(MAX_REDIRECTS + 1):
                request = await _request(http, ref, url, settings.media_fetch_private)
                reply = await http.send(request, stream=True)
                try:
                    if reply.status_code in REDIRECTS and "location" in reply.headers:
                        url = str(httpx.URL(url).join(reply.headers["location"]))
                        continue
                    if reply.status_code != 200:
                        raise _bad(ref, "media_unreachable", f"fetching {_shown(url)} answered {reply.status_code}")
                    return await _body(ref, reply, max_bytes)
                finally:
                    await reply.aclose()
    except TimeoutError as err:
        raise _bad(ref, "media_unreachable", f"fetching {_shown(ref.url)} took over {timeout_s:g} s") from err
    except httpx.InvalidURL as err:
        raise _bad(ref, "invalid_media_url", f"not a URL: {err}") from err
    except httpx.HTTPError as err:  # refused, reset, a bad certificate
        raise _bad(ref, "media_unreachable", f"fetching {_shown(url)} failed: {err or type(err).__name__}") from err
    raise _bad(ref, "media_unreachable", f"fetching {_shown(ref.url)} was redirected more than {MAX_REDIRECTS} times")


async def _request(http: httpx.AsyncClient, ref: MediaRef, url: str, allow_private: bool) -> httpx.Request:
    """The GET of one hop. Unless `allow_private`, its host is resolved here (without blocking
    the loop), refused when any of its addresses is not a public one (`_public`), and the request
    goes to the address checked (the Host header and TLS name stay the host's), so that a second
    resolution cannot lead it elsewhere."""
    target = httpx.URL(url)
    if target.scheme not in ("http", "https") or not target.host:
        raise _bad(ref, "invalid_media_url", f"{_shown(url)} is not an http(s) URL")
    if allow_private:
        return http.build_request("GET", target)
    port = target.port or DEFAULT_PORTS[target.scheme]
    try:
        found = await asyncio.get_running_loop().getaddrinfo(target.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise _bad(ref, "media_unreachable", f"fetching {_shown(url)} failed: its host does not resolve ({err})") from err
    addresses = [ipaddress.ip_address(info[4][0]) for info in found]
    refused = next((address for address in addresses if not _public(address)), None)
    if refused is not None:
        raise _bad(
            ref, "media_url_private", f"{target.host} resolves to {refused}, not a public address: the gateway does "
            "not fetch media from loopback, private, link-local, multicast, reserved or unspecified addresses unless "
            "MEDIA_FETCH_PRIVATE=true",
        )
    pinned = target.copy_with(host=str(addresses[0]))
    return http.build_request(
        "GET", pinned, headers={"Host": target.netloc.decode()}, extensions={"sni_hostname": target.host}
    )


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not loopback, private, link-local, multicast, reserved or unspecified (nor another range
    IANA marks not globally reachable)."""
    return address.is_global and not address.is_multicast


async def _body(ref: MediaRef, reply: httpx.Response, max_bytes: int) -> bytes:
    declared = reply.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(ref, max_bytes)
    data = bytearray()
    async for piece in reply.aiter_bytes():
        data += piece
        if len(data) > max_bytes:
            raise _too_large(ref, max_bytes)
    return bytes(data)


def _shown(url: str) -> str:
    return url if len(url) <= 200 else f"{url[:200]}..."


def _too_large(ref: MediaRef, max_bytes: int) -> ApiError:
    return ApiError(413, "media_too_large", f"the {ref.kind} exceeds the limit of {max_bytes} bytes", param=ref.param)


def _bad(ref: MediaRef, code: str, message: str) -> ApiError:
    return ApiError(400, code, message, param=ref.param)

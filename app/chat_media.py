"""The bytes of a chat completion's media part: a data URL decoded, or an http(s) URL fetched
(bounded in size and time; from public addresses only, unless MEDIA_FETCH_PRIVATE), with its
SHA-256. The gateway never decodes them: a video goes to
the worker as an upload does, an image as a stream socket's frame does.

Media is held in pieces of about MEDIA_CHUNK_BYTES (a data URL is decoded piece by piece, never
copied whole), taken one by one as they are sent on (`Media.take_chunks`); and only so many
requests at once may hold media in a gateway's memory (`MediaSlots`)."""

import asyncio
import binascii
import hashlib
import ipaddress
import socket
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

import httpx

from app.chat_messages import MediaRef
from app.errors import ApiError
from app.settings import GatewaySettings
from streamvqa.protocol import FRAME_HEADER_BYTES, MEDIA_CHUNK_BYTES, frame_message, parse_frame_header

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)
DEFAULT_PORTS = {"http": 80, "https": 443}
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: the last 32 bits are an IPv4 address
BASE64_PIECE_CHARS = 4 * MEDIA_CHUNK_BYTES  # a data URL's base64 decoded this much at a time: 3 whole chunks
SLOT_WAIT_S = 30.0  # the longest a request waits for a `MediaSlots` slot (having read nothing of its media meanwhile)


@dataclass(frozen=True)
class Media:
    kind: str  # video or image
    chunks: deque[bytes] = field(repr=False)  # its bytes, in pieces; sending them on takes them (`take_chunks`)
    sha256: str
    param: str  # where the request sent it

    def take_chunks(self) -> Iterator[bytes]:
        """Its pieces in order, each let go as it is taken: once sent on, the media holds no bytes."""
        while self.chunks:
            yield self.chunks.popleft()


class MediaSlots:
    """How many chat completions may hold media in this gateway's memory at once
    (MAX_CHAT_MEDIA_REQUESTS): each takes a slot before the first byte of its media comes (its
    body, when the body may carry a data URL; or a fetch) and gives it back once its media is sent
    on. A request waits for a slot at most `wait_s` (it has read nothing meanwhile), then is
    refused: 503 `media_busy`, with Retry-After."""

    def __init__(self, count: int, wait_s: float = SLOT_WAIT_S) -> None:
        self.count, self.wait_s = count, wait_s
        self._free = asyncio.Semaphore(count)

    async def take(self) -> None:
        try:
            async with asyncio.timeout(self.wait_s):
                await self._free.acquire()
        except TimeoutError:
            raise ApiError(
                503, "media_busy", f"this gateway holds as many requests' media as it may at once "
                f"(MAX_CHAT_MEDIA_REQUESTS={self.count}); try again", {"Retry-After": "1"},
            ) from None

    def give(self) -> None:
        self._free.release()


class MediaRoom:
    """One request's hold on a `MediaSlots` slot: taken once, given back once."""

    def __init__(self, slots: MediaSlots) -> None:
        self.slots, self.held = slots, False

    async def take(self) -> None:
        if not self.held:
            await self.slots.take()
            self.held = True

    def leave(self) -> None:
        if self.held:
            self.slots.give()
            self.held = False


def limit_bytes(kind: str, settings: GatewaySettings) -> int:
    """The largest media of `kind` a chat completion may carry: a video what an upload may be
    (MAX_CHAT_MEDIA_BYTES at most), an image what a `frames` message on a socket may hold."""
    return settings.chat_media_bytes if kind == "video" else settings.ws_max_message_bytes - FRAME_HEADER_BYTES


async def load(ref: MediaRef, settings: GatewaySettings, room: MediaRoom | None = None) -> Media:
    """The part's bytes (its URL taken out of the message); ApiError 400 for a URL that is neither
    data nor http(s), a data URL that does not decode, an image not JPEG, PNG or WebP, a URL whose
    host (or a redirect's) is not a public address (`media_url_private`), or one that cannot be
    fetched in MEDIA_FETCH_TIMEOUT_S; 413 over the limit of its kind. A fetch waits for the
    request's `room` first."""
    max_bytes = limit_bytes(ref.kind, settings)
    url = ref.take_url()
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        chunks = _decoded(ref, url, max_bytes)
    elif scheme in ("http", "https"):
        if not settings.media_fetch_urls:
            raise _bad(ref, "invalid_media_url", "this gateway takes media as data URLs only (MEDIA_FETCH_URLS=false)")
        if room is not None:
            await room.take()
        chunks = await _fetched(ref, url, max_bytes, settings)
    else:
        raise _bad(ref, "invalid_media_url", f"a {ref.kind} URL must be a data URL or http(s), not {scheme[:20]!r}")
    del url  # a data URL's text: decoded, it is not needed
    if not chunks:
        raise _bad(ref, "invalid_media", f"the {ref.kind} is empty")
    if ref.kind == "image":
        try:
            parse_frame_header(frame_message(0.0, chunks[0]))  # the rule of a socket's `frames` message
        except ValueError as err:
            raise _bad(ref, "invalid_media", str(err).replace("a frame's image", "an image_url")) from err
    sha256 = hashlib.sha256()
    for chunk in chunks:
        sha256.update(chunk)
    return Media(ref.kind, chunks, sha256.hexdigest(), ref.param)


def _decoded(ref: MediaRef, url: str, max_bytes: int) -> deque[bytes]:
    """A data URL's bytes; base64 decoded a piece at a time, so that no copy of the whole text is made."""
    comma = url.find(",")
    if comma < 0:
        raise _bad(ref, "invalid_media_url", "a data URL is data:[<type>][;base64],<data>")
    if not url[5:comma].lower().endswith(";base64"):
        data = unquote_to_bytes(url[comma + 1 :])
        if len(data) > max_bytes:
            raise _too_large(ref, max_bytes)
        return deque(_chunked(data))
    if (len(url) - comma - 1) * 3 // 4 > max_bytes + 2:  # before decoding it
        raise _too_large(ref, max_bytes)
    chunks, size = deque(), 0
    try:
        for start in range(comma + 1, len(url), BASE64_PIECE_CHARS):
            piece = binascii.a2b_base64(url[start : start + BASE64_PIECE_CHARS], strict_mode=True)
            size += len(piece)
            chunks += _chunked(piece)
    except (binascii.Error, ValueError) as err:
        raise _bad(ref, "invalid_media_url", f"the data URL's base64 does not decode: {err}") from err
    if size > max_bytes:
        raise _too_large(ref, max_bytes)
    return chunks


def _chunked(data: bytes) -> list[bytes]:
    return [data[start : start + MEDIA_CHUNK_BYTES] for start in range(0, len(data), MEDIA_CHUNK_BYTES)]


async def _fetched(ref: MediaRef, url: str, max_bytes: int, settings: GatewaySettings) -> deque[bytes]:
    """The body of the URL, following up to MAX_REDIRECTS redirects, each hop's host checked
    (`_request`); `media_unreachable` for a reply not 200, a failure, or over the time."""
    timeout_s, first = settings.media_fetch_timeout_s, url
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
        raise _bad(ref, "media_unreachable", f"fetching {_shown(first)} took over {timeout_s:g} s") from err
    except httpx.InvalidURL as err:
        raise _bad(ref, "invalid_media_url", f"not a URL: {err}") from err
    except httpx.HTTPError as err:  # refused, reset, a bad certificate
        raise _bad(ref, "media_unreachable", f"fetching {_shown(url)} failed: {err or type(err).__name__}") from err
    raise _bad(ref, "media_unreachable", f"fetching {_shown(first)} was redirected more than {MAX_REDIRECTS} times")


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
        embedded = _embedded_v4(refused)
        shown = f"{refused} (which reaches {embedded})" if embedded is not None else str(refused)
        raise _bad(
            ref, "media_url_private", f"{target.host} resolves to {shown}, not a public address: the gateway does "
            "not fetch media from loopback, private, link-local, multicast, reserved or unspecified addresses unless "
            "MEDIA_FETCH_PRIVATE=true",
        )
    pinned = target.copy_with(host=str(addresses[0]))
    return http.build_request(
        "GET", pinned, headers={"Host": target.netloc.decode()}, extensions={"sni_hostname": target.host}
    )


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not loopback, private, link-local, site-local, multicast, reserved or unspecified (nor
    another range IANA marks not globally reachable); an IPv6 address that stands for an IPv4
    one (`_embedded_v4`) is judged by that one, and the other forms in ::/8 (IPv4-compatible
    addresses among them) are reserved."""
    embedded = _embedded_v4(address)
    if embedded is not None:
        return _public(embedded)
    site_local = address.version == 6 and address.is_site_local  # fec0::/10, deprecated, not global (Python says it is)
    return address.is_global and not (address.is_multicast or address.is_reserved or site_local)


def _embedded_v4(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches: IPv4-mapped (::ffff:a.b.c.d), NAT64's well-known
    prefix (64:ff9b::a.b.c.d, which a DNS64 resolver gives for an IPv4-only host) or 6to4
    (2002:aabb:ccdd::); None for any other address."""
    if address.version == 4:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


async def _body(ref: MediaRef, reply: httpx.Response, max_bytes: int) -> deque[bytes]:
    declared = reply.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(ref, max_bytes)
    chunks, size = deque(), 0
    async for chunk in reply.aiter_bytes(MEDIA_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(ref, max_bytes)
        chunks.append(chunk)
    return chunks


def _shown(url: str) -> str:
    return url if len(url) <= 200 else f"{url[:200]}..."


def _too_large(ref: MediaRef, max_bytes: int) -> ApiError:
    return ApiError(413, "media_too_large", f"the {ref.kind} exceeds the limit of {max_bytes} bytes", param=ref.param)


def _bad(ref: MediaRef, code: str, message: str) -> ApiError:
    return ApiError(400, code, message, param=ref.param)

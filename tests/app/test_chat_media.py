"""Fetching a chat completion's media URL: never from the gateway's own networks unless
MEDIA_FETCH_PRIVATE, every address a host resolves to checked, and each redirect checked as the
first URL is (followed by the gateway, at most MAX_REDIRECTS). A real HTTP server on loopback."""

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app import chat_media
from app.chat_messages import MediaRef, MediaUrl
from app.errors import ApiError
from app.settings import GatewaySettings

PARAM = "messages.0.content.1.video_url.url"
BODY = b"\0\0\0\x18ftypmp42" * 8


class Handler(BaseHTTPRequestHandler):
    """/video: the body; /to/<url>: a redirect to <url>; /loop: a redirect to itself."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/to/"):
            self._redirect(self.path.removeprefix("/to/"))
        elif self.path == "/loop":
            self._redirect("/loop")
        elif self.path == "/video":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
        else:
            self.send_error(404)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def load(url: str, **settings: object) -> bytes:
    ref = MediaRef("video", MediaUrl(url=url), PARAM)
    return b"".join(asyncio.run(chat_media.load(ref, GatewaySettings(**settings))).take_chunks())


def refused(url: str, **settings: object) -> ApiError:
    with pytest.raises(ApiError) as err:
        load(url, **settings)
    return err.value


def test_a_loopback_url_is_refused_by_default_naming_the_rule_and_the_setting(server):
    err = refused(f"http://{server}/video")
    assert (err.status, err.code, err.param) == (400, "media_url_private", PARAM)
    assert err.message == (
        "127.0.0.1 resolves to 127.0.0.1, not a public address: the gateway does not fetch media from loopback, "
        "private, link-local, multicast, reserved or unspecified addresses unless MEDIA_FETCH_PRIVATE=true"
    )
    assert load(f"http://{server}/video", media_fetch_private=True) == BODY


@pytest.mark.parametrize("host", [
    "localhost", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "224.0.0.1", "240.0.0.1",
    "100.64.0.1", "[::1]", "[fe80::1]", "[fc00::1]", "[::ffff:127.0.0.1]", "[ff02::1]", "[::]",
    # IPv6 forms that reach a private IPv4 address: NAT64, 6to4, IPv4-compatible; and site-local, NAT64 for local use
    "[64:ff9b::7f00:1]", "[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::]", "[2002:a00:1::1]", "[::127.0.0.1]", "[::10.0.0.1]",
    "[::8.8.8.8]", "[fec0::1]", "[64:ff9b:1::a00:1]",
])
def test_every_address_that_is_not_public_is_refused(host):
    assert refused(f"http://{host}:9/video.mp4").code == "media_url_private"


def test_an_ipv6_address_that_stands_for_an_ipv4_one_is_judged_by_it():
    """NAT64 (a DNS64 resolver's answer for an IPv4-only host), 6to4 and IPv4-mapped addresses of
    public hosts are public; the same forms of 169.254.169.254 (cloud metadata) are not."""
    public = ["64:ff9b::5db8:d822", "2002:5db8:d822::1", "::ffff:93.184.216.34", "2606:2800:220:1::", "93.184.216.34"]
    assert [chat_media._public(ipaddress.ip_address(address)) for address in public] == [True] * 5
    err = refused("http://[64:ff9b::a9fe:a9fe]:9/latest/meta-data")
    assert err.message.startswith(
        "64:ff9b::a9fe:a9fe resolves to 64:ff9b::a9fe:a9fe (which reaches 169.254.169.254), not a public address"
    )


def test_a_host_is_refused_when_any_of_its_addresses_is_private(monkeypatch):
    async def resolves_to_two(self, host, port, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in ("93.184.216.34", "10.0.0.7")]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", resolves_to_two)
    err = refused("https://media.example/clip.mp4")
    assert (err.code, err.message.split(",")[0]) == ("media_url_private", "media.example resolves to 10.0.0.7")


def test_redirects_are_followed_each_hop_checked_and_bounded(server, monkeypatch):
    assert load(f"http://{server}/to/http://{server}/video", media_fetch_private=True) == BODY
    loop = refused(f"http://{server}/loop", media_fetch_private=True)
    assert (loop.code, loop.message) == (
        "media_unreachable", f"fetching http://{server}/loop was redirected more than 3 times"
    )
    scheme = refused(f"http://{server}/to/ftp://media.example/clip.mp4", media_fetch_private=True)
    assert (scheme.code, scheme.message) == ("invalid_media_url", "ftp://media.example/clip.mp4 is not an http(s) URL")
    # a hop to a private address is refused even when the first URL's was allowed: here 127.0.0.1
    # stands for a public address and 127.0.0.2 for a private one
    monkeypatch.setattr(chat_media, "_public", lambda address: address != ipaddress.ip_address("127.0.0.2"))
    port = server.split(":")[1]
    hop = refused(f"http://{server}/to/http://127.0.0.2:{port}/video")
    assert (hop.code, hop.message.split(",")[0]) == ("media_url_private", "127.0.0.2 resolves to 127.0.0.2")
    assert load(f"http://{server}/to/http://{server}/video") == BODY


def test_fetching_can_be_turned_off():
    err = refused("https://media.example/clip.mp4", media_fetch_urls=False)
    assert (err.code, err.message) == (
        "invalid_media_url", "this gateway takes media as data URLs only (MEDIA_FETCH_URLS=false)"
    )

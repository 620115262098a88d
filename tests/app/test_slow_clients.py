"""Clients that hold connections without using them are let go; forwarded addresses are believed
only from the proxies named in FORWARDED_ALLOW_IPS."""

import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from streamvqa.redis_server import free_port
from tests.support import Client, Stack, running_stack, sample_video

HEADER_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def patient(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(redis_url, tmp_path_factory.mktemp("slow"), HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S)) as stack:
        yield stack


def _send_slowly(port: int, head: bytes, rest: bytes, every_s: float) -> tuple[int, bytes]:
    """Send `head`, then `rest` a byte every `every_s`, until the server answers or closes; how
    many bytes of `rest` were sent, and what came back."""
    sent, received = 0, b""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(head)
        while sent < len(rest):
            readable, _, _ = select.select([connection], [], [], every_s)
            if readable:
                break
            try:
                sent += connection.send(rest[sent : sent + 1])
            except OSError:
                break
        connection.settimeout(30)
        try:
            while chunk := connection.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    return sent, received


def test_a_connection_that_sends_nothing_is_closed(patient):
    _, received = _send_slowly(patient.port, b"", b"", 0.0)
    assert received.startswith(b"HTTP/1.1 408 ")


def test_headers_sent_a_byte_at_a_time_are_cut_off(patient):
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    sent, received = _send_slowly(patient.port, b"", request, 0.05)  # 240 bytes at 20 a second: 12 s
    assert sent < len(request)
    assert received.startswith(b"HTTP/1.1 408 ")


def test_a_trickling_upload_is_refused_and_frees_the_session_for_a_real_one(patient):
    user = Client(patient.url)
    user.create(fps=1)
    head = (
        f"POST /sessions/{user.id}/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {user.token}\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    sent, received = _send_slowly(patient.port, head, b"\0" * 1000, 1.0)  # a byte a second
    assert sent < 1000
    assert received.startswith(b"HTTP/1.1 408 ") and b"upload_too_slow" in received
    assert user.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
    assert user.wait_for_state("ingested")["frames_ingested"] == 10


def test_a_forwarded_address_is_believed_only_from_a_configured_proxy(patient):
    owner = Client(patient.url)
    owner.create()
    spoofed = {"X-Forwarded-For": "198.51.100.7"}
    # the gateway's own caller is 127.0.0.1, whatever the header says: its token lists the session
    # from the address that created it
    listed = httpx.get(f"{patient.url}/sessions", headers={**spoofed, **owner.auth}).json()["sessions"]
    assert owner.id in [session["id"] for session in listed]

    port = free_port()
    proxied = patient.start("proxied", "app", PORT=str(port), FORWARDED_ALLOW_IPS="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/healthz")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proxied.poll() is None
                time.sleep(0.1)
        made = httpx.post(f"{url}/sessions", headers=spoofed, json={}).json()
        behind, auth = made["id"], {"Authorization": f"Bearer {made['token']}"}
        from_proxy = [s["id"] for s in httpx.get(f"{url}/sessions", headers={**spoofed, **auth}).json()["sessions"]]
        assert from_proxy == [behind]  # the proxy's client 198.51.100.7 is its own caller
        assert httpx.get(f"{url}/sessions", headers=auth).json()["sessions"] == []  # not the proxy's own address's
    finally:
        proxied.terminate()
        proxied.wait(timeout=15)

"""API keys, limits, CORS, the Host check and session isolation, against a gateway configured to
enforce them."""

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from app.hosts import allowed_names, host_allowed
from app.settings import GatewaySettings
from tests.support import Client, Stack, StreamSocket, running_stack, sample_video

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"


@pytest.fixture(scope="module")
def guarded(redis_url, tmp_path_factory) -> Iterator[Stack]:
    with running_stack(
        redis_url,
        tmp_path_factory.mktemp("guarded"),
        API_KEYS=f"{KEY_A}, {KEY_B}",
        MAX_SESSIONS_PER_KEY="2",
        MAX_BODY_BYTES="2048",
        MAX_SOCKETS_PER_SESSION="2",
        WS_MESSAGES_PER_S="5",
        CORS_ORIGINS="https://dash.example",
        MAX_SESSIONS="64",
    ) as stack:
        yield stack


class KeyedClient(Client):
    def __init__(self, base_url: str, api_key: str | None) -> None:
        super().__init__(base_url)
        if api_key is not None:
            self.http.headers["X-API-Key"] = api_key


@pytest.fixture
def users(guarded) -> Iterator[tuple[KeyedClient, KeyedClient]]:
    a, b = KeyedClient(guarded.url, KEY_A), KeyedClient(guarded.url, KEY_B)
    assert a.create().status_code == 201 and b.create().status_code == 201
    yield a, b
    for user in (a, b):
        user.delete()
        user.http.close()


def test_creating_or_listing_sessions_needs_a_configured_api_key(guarded):
    for key, status, code in ((None, 401, "api_key_required"), ("key-c-guessed", 403, "api_key_invalid")):
        user = KeyedClient(guarded.url, key)
        reply = user.create()
        assert (reply.status_code, reply.json()["code"]) == (status, code)
        assert user.http.get("/sessions").status_code == status


def test_each_key_lists_only_its_own_sessions(users):
    a, b = users
    listed_a = [s["id"] for s in a.http.get("/sessions").json()["sessions"]]
    listed_b = [s["id"] for s in b.http.get("/sessions").json()["sessions"]]
    assert listed_a == [a.id] and listed_b == [b.id]


def test_a_key_holds_at_most_max_sessions_per_key(users):
    a, _ = users
    second = KeyedClient(a.http.base_url, KEY_A)
    assert second.create().status_code == 201
    third = KeyedClient(a.http.base_url, KEY_A)
    reply = third.create()
    assert (reply.status_code, reply.json()["code"]) == (429, "too_many_sessions")
    second.delete()
    assert third.create().status_code == 201  # a deleted session frees its place
    third.delete()


def test_no_endpoint_or_socket_lets_one_sessions_token_reach_another(users):
    a, b = users
    assert b.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    b.wait_for_state("ingested")
    answer_id = b.ask("What?", max_new_tokens=2).json()["answer_id"]
    session = f"/sessions/{b.id}"
    calls = [
        ("GET", session, {}),
        ("DELETE", session, {}),
        ("POST", f"{session}/upload", {"content": b"data"}),
        ("POST", f"{session}/ask", {"json": {"question": "What?"}}),
        ("POST", f"{session}/ask", {"json": {"question": "What?", "stream": True}}),
        ("GET", f"{session}/memory", {}),
        ("GET", f"{session}/events", {}),
        ("GET", f"{session}/answers/{answer_id}", {}),
        ("GET", f"{session}/answers/{answer_id}", {"headers": {"Accept": "text/event-stream"}}),
    ]
    for method, path, extra in calls:
        headers = {**a.auth, **extra.pop("headers", {})}
        reply = a.http.request(method, path, headers=headers, **extra)
        assert (reply.status_code, reply.json()["code"]) == (403, "forbidden"), (method, path)
    for media_format in ("frames", None):
        socket = StreamSocket(b, media_format, token=a.token)
        assert socket.started is None and socket.close_code == 4401
    assert b.get().json()["state"] == "ingested"  # untouched


def test_the_query_token_never_reaches_the_gateway_log(guarded, users):
    a, _ = users
    socket = StreamSocket(a, None, query_token=True)
    assert socket.started["type"] == "started"
    socket.close()
    assert a.token not in guarded.log("gateway")
    assert "token=[redacted]" in guarded.log("gateway")


def test_request_bodies_over_max_body_bytes_are_413(users):
    a, _ = users
    announced = a.http.post("/sessions", json={"system_prompt": "x" * 3000})
    assert (announced.status_code, announced.json()["code"]) == (413, "body_too_large")
    chunked = a.http.post(
        f"/sessions/{a.id}/ask", headers={**a.auth, "Content-Type": "application/json"},
        content=iter([b'{"question": "', b"y" * 3000, b'"}']),
    )
    assert (chunked.status_code, chunked.json()["code"]) == (413, "body_too_large")


def test_only_configured_origins_may_call_from_a_browser(guarded):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-api-key,content-type"}
    allowed = httpx.options(f"{guarded.url}/sessions", headers={"Origin": "https://dash.example", **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://dash.example"
    refused = httpx.options(f"{guarded.url}/sessions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in refused.headers


def test_a_browser_socket_from_a_page_of_another_origin_is_closed_with_4403(guarded, users):
    a, _ = users
    url = f"ws://127.0.0.1:{guarded.port}/sessions/{a.id}/stream"
    start = json.dumps({"type": "start", "format": None})

    def first_event(origin: str | None) -> tuple[str | None, int | None, str]:
        with ws_connect(url, origin=origin, additional_headers=a.auth, open_timeout=10) as socket:
            try:
                socket.send(start)
                return json.loads(socket.recv(timeout=10))["type"], None, ""
            except ConnectionClosed as closed:
                return None, closed.rcvd.code, closed.rcvd.reason

    assert first_event("https://evil.example") == (
        None, 4403, "a page of https://evil.example may not open sockets here (CORS_ORIGINS)"
    )
    assert first_event("http://127.0.0.1:1")[1] == 4403  # the gateway's host, another port
    assert first_event("https://dash.example") == ("started", None, "")  # in CORS_ORIGINS
    assert first_event(f"http://127.0.0.1:{guarded.port}") == ("started", None, "")  # the gateway's own page
    assert first_event(None) == ("started", None, "")  # not a browser


def test_with_api_keys_metrics_need_a_key(guarded):
    missing = httpx.get(f"{guarded.url}/metrics")
    assert (missing.status_code, missing.json()["code"]) == (401, "api_key_required")
    wrong = httpx.get(f"{guarded.url}/metrics", headers={"X-API-Key": "key-c-guessed"})
    assert (wrong.status_code, wrong.json()["code"]) == (403, "api_key_invalid")
    for headers in ({"X-API-Key": KEY_A}, {"Authorization": f"Bearer {KEY_B}"}):  # Prometheus sends a bearer token
        reply = httpx.get(f"{guarded.url}/metrics", headers=headers)
        assert reply.status_code == 200 and "streamvqa_gateway_sessions_created_total" in reply.text


def test_metrics_public_opens_metrics_beside_api_keys(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, API_KEYS=KEY_A, METRICS_PUBLIC="true") as stack:
        assert httpx.get(f"{stack.url}/metrics").status_code == 200
        assert httpx.get(f"{stack.url}/sessions").status_code == 401  # the rest still needs a key


def test_a_session_has_at_most_max_sockets_per_session(users):
    a, _ = users
    first, second = StreamSocket(a, "frames"), StreamSocket(a, None)
    assert first.started["format"] == "frames" and second.started["format"] is None
    third = StreamSocket(a, None)
    assert third.started is None and third.close_code == 4429
    second.close()
    fourth = None
    for _ in range(20):  # the gateway forgets the closed socket as it finishes closing
        fourth = StreamSocket(a, None)
        if fourth.started is not None:
            break
    assert fourth.started["type"] == "started"
    for socket in (first, fourth):
        socket.close()


def test_a_socket_sending_over_its_message_rate_is_closed_with_4429(users):
    a, _ = users
    socket = StreamSocket(a, None)
    for _ in range(40):  # 5 per second allowed, bursts of 10
        if not socket.send(json.dumps({"type": "hello"})):
            break
    assert socket.wait_closed() == 4429
    assert "messages per second" in socket.close_reason


def test_requests_over_the_rate_limit_are_429_with_retry_after(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, RATE_LIMIT_PER_S="0.5", RATE_LIMIT_BURST="3") as stack:
        user = Client(stack.url)
        replies = [user.http.get("/sessions") for _ in range(5)]
        assert [r.status_code for r in replies] == [200, 200, 200, 429, 429]
        assert replies[-1].json()["code"] == "rate_limited"
        assert 1 <= int(replies[-1].headers["retry-after"]) <= 2
        assert httpx.get(f"{stack.url}/healthz").status_code == 200  # operations are not limited
        url = f"ws://127.0.0.1:{stack.port}/sessions/{'0' * 32}/stream"
        with ws_connect(url, open_timeout=10) as socket:  # sockets count against the same rate
            with pytest.raises(ConnectionClosed):  # closed at once, before any message
                socket.recv(timeout=10)
            assert socket.close_code == 4429


def test_an_api_key_sent_as_the_bearer_counts_against_the_key_not_the_address(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, API_KEYS=f"{KEY_A},{KEY_B}", RATE_LIMIT_PER_S="0.1", RATE_LIMIT_BURST="2") as stack:
        def models(**headers: str) -> int:
            return httpx.get(f"{stack.url}/v1/models", headers=headers).status_code

        assert [models(authorization=f"Bearer {KEY_A}") for _ in range(3)] == [200, 200, 429]  # as OpenAI's clients send it
        assert models(**{"X-API-Key": KEY_A}) == 429  # the same key's bucket, however it is sent
        assert [models(authorization=f"Bearer {KEY_B}") for _ in range(2)] == [200, 200]  # another key's own
        assert models() == 200  # the address, without a key, has its own too
        assert models(authorization="Bearer not-a-key") == 200  # not a key: the address's
        assert models() == 429


def test_with_api_keys_models_needs_a_key_and_names_only_the_key_s_sessions(guarded, users):
    a, b = users
    missing = httpx.get(f"{guarded.url}/models")
    assert (missing.status_code, missing.json()["code"]) == (401, "api_key_required")
    wrong = httpx.get(f"{guarded.url}/models", headers={"X-API-Key": "key-c-guessed"})
    assert (wrong.status_code, wrong.json()["code"]) == (403, "api_key_invalid")
    for user in users:
        user.wait_for_state("ready")

    def pool(key: str, session_id: str) -> dict:  # once the worker says that the session leases its pages
        deadline = time.monotonic() + 30
        while True:
            [memory] = httpx.get(f"{guarded.url}/models", headers={"X-API-Key": key}).json()["models"][0]["memory"]
            if session_id in memory["pool_session_pages"] or time.monotonic() > deadline:
                return memory
            time.sleep(0.2)

    for key, user in ((KEY_A, a), (KEY_B, b)):
        memory = pool(key, user.id)
        assert list(memory["pool_session_pages"]) == [user.id] and list(memory["host_pool_session_pages"]) == [user.id]


# -- the Host check: a page that rebinds its own name to this machine is refused ---------------------


def _handshake(port: int, host: str, path: str, headers: str = "") -> tuple[str, str]:
    """A WebSocket opening handshake to the gateway with this Host: the reply's status line and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n".encode()
        )
        reply = b""
        while chunk := raw.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply and (reply.startswith(b"HTTP/1.1 101") or reply.endswith(b"}")):
                break
    head, _, body = reply.decode(errors="replace").partition("\r\n\r\n")
    return head.split("\r\n")[0], body


def test_a_page_of_another_name_rebound_to_this_machine_can_neither_list_use_nor_end_sessions(stack, client):
    assert client.create().status_code == 201
    rebound = f"rebound.example:{stack.port}"  # its own origin, as the browser sees it: CORS does not apply
    page = {"Host": rebound, "Origin": f"http://{rebound}"}
    refusal = {"code": "invalid_host", "message": f"the Host '{rebound}' is not a name of this gateway (ALLOWED_HOSTS)"}
    session = f"{stack.url}/sessions/{client.id}"
    for reply in (
        httpx.get(f"{stack.url}/sessions", headers={**page, **client.auth}),
        httpx.post(f"{stack.url}/sessions", headers=page, json={}),
        httpx.get(session, headers={**page, **client.auth}),
        httpx.post(f"{session}/ask", headers={**page, **client.auth}, json={"question": "What?"}),
        httpx.delete(session, headers={**page, **client.auth}),
        httpx.get(f"{stack.url}/", headers=page),
    ):
        assert (reply.status_code, reply.json()) == (400, refusal)
    status, body = _handshake(stack.port, rebound, f"/sessions/{client.id}/stream?token={client.token}", f"Origin: http://{rebound}\r\n")
    assert (status, json.loads(body)) == ("HTTP/1.1 400 Bad Request", refusal)
    assert client.get().json()["state"] in ("pending", "ready")  # untouched
    openai = httpx.get(f"{stack.url}/v1/models", headers=page)
    assert (openai.status_code, openai.json()["error"]["code"]) == (400, "invalid_host")  # in OpenAI's shape there
    assert httpx.get(f"{stack.url}/healthz", headers=page).status_code == 200  # probes call by any name


def test_the_loopback_names_are_answered_by_default(stack, client):
    assert client.create().status_code == 201
    for host in (f"localhost:{stack.port}", f"127.0.0.1:{stack.port}", f"[::1]:{stack.port}", "LocalHost", "127.0.0.1"):
        assert httpx.get(f"{stack.url}/sessions/{client.id}", headers={"Host": host, **client.auth}).status_code == 200, host
    status, _ = _handshake(stack.port, f"localhost:{stack.port}", f"/sessions/{client.id}/stream?token={client.token}")
    assert status == "HTTP/1.1 101 Switching Protocols"
    for host in (f"localhost.evil.example:{stack.port}", "127.0.0.1.nip.io", "[::1", "localhost:port"):
        assert httpx.get(f"{stack.url}/sessions/{client.id}", headers={"Host": host, **client.auth}).status_code == 400, host


def test_allowed_hosts_names_the_gateway_s_names_and_nothing_else(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, ALLOWED_HOSTS="streamvqa.example, *.lan.example") as stack:
        def status(host: str) -> int:
            return httpx.get(f"{stack.url}/models", headers={"Host": host}).status_code

        assert [status(host) for host in ("streamvqa.example", "STREAMVQA.example:443", "gpu.lan.example:8000")] == [200] * 3
        assert [status(host) for host in ("lan.example", f"localhost:{stack.port}", "example")] == [400] * 3
        assert "refused a request with the Host 'lan.example': add its name to ALLOWED_HOSTS" in stack.log("gateway")


@pytest.mark.parametrize(("settings", "allowed"), [
    ({}, ("localhost", "127.0.0.1", "::1")),
    ({"host": "0.0.0.0"}, ("localhost", "127.0.0.1", "::1")),  # every address: no one name
    ({"host": "::"}, ("localhost", "127.0.0.1", "::1")),
    ({"host": "192.168.1.20"}, ("localhost", "127.0.0.1", "::1", "192.168.1.20")),  # the one address it binds
    ({"host": "fd00::20"}, ("localhost", "127.0.0.1", "::1", "fd00::20")),
    ({"allowed_hosts": "Gateway:8000, [fd00::20], *.example.com"}, ("gateway", "fd00::20", "*.example.com")),
])
def test_the_default_names_are_loopback_and_the_address_bound(settings, allowed):
    configured = GatewaySettings(**settings)
    assert allowed_names(configured.allowed_host_list, configured.host) == allowed


@pytest.mark.parametrize(("host", "answered"), [
    ("gateway", True), ("gateway:8000", True), ("GATEWAY.", True), ("[fd00::20]:8000", True), ("a.example.com", True),
    ("a.b.example.com:1", True), ("example.com", False), ("gateway.evil", False), ("evilgateway", False), ("", False),
    ("fd00::20", False), ("[fd00::20", False), ("gateway:80:80", False), ("gateway@evil", False), (None, False),
])
def test_a_host_header_is_answered_by_its_name_alone(host, answered):
    assert host_allowed(host, ("gateway", "fd00::20", "*.example.com")) is answered

"""Who may list and end a session besides its token. A bearer token names its own session and
nothing else. Without API keys (by default) an address proves nothing: it lists and ends only the
sessions whose tokens it sends. With API keys, a key owns the sessions it creates: it lists them
and ends any of them without their tokens; with ADDRESS_OWNS_SESSIONS an address does (one
person's machine). Failed and ended sessions stop counting toward the owner's limit at once, and
no other caller sees or ends them."""

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from streamvqa.client import AsyncClient, StreamvqaError
from streamvqa.client import Client as PythonClient
from tests.support import Client, Stack, running_stack

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"
NOT_A_VIDEO = b"not a video at all" * 100
UNAUTHORIZED = {"code": "unauthorized", "message": "send the session token as 'Authorization: Bearer <token>'"}
FORBIDDEN = {"code": "forbidden", "message": "the token is not this session's token"}


@pytest.fixture(scope="module")
def by_token(redis_url, tmp_path_factory) -> Iterator[Stack]:
    """No API keys, the default: a session is its token's; two sessions each address."""
    with running_stack(redis_url, tmp_path_factory.mktemp("by-token"), MAX_SESSIONS_PER_KEY="2", MAX_SESSIONS="64") as stack:
        yield stack


@pytest.fixture(scope="module")
def by_address(redis_url, tmp_path_factory) -> Iterator[Stack]:
    """No API keys, and ADDRESS_OWNS_SESSIONS: a client's address owns its sessions; two sessions each."""
    with running_stack(
        redis_url, tmp_path_factory.mktemp("by-address"), ADDRESS_OWNS_SESSIONS="true", MAX_SESSIONS_PER_KEY="2",
        MAX_SESSIONS="64",
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def by_key(redis_url, tmp_path_factory) -> Iterator[Stack]:
    with running_stack(
        redis_url, tmp_path_factory.mktemp("by-key"), API_KEYS=f"{KEY_A},{KEY_B}", MAX_SESSIONS_PER_KEY="2", MAX_SESSIONS="64",
    ) as stack:
        yield stack


@pytest.fixture
def made(by_token) -> Iterator[Callable[..., Client]]:
    """made(**options): a new session of `by_token`, from 127.0.0.1, ended after the test."""
    users = []

    def make(**options: object) -> Client:
        user = Client(by_token.url)
        assert user.create(**options).status_code == 201
        users.append(user)
        return user

    yield make
    for user in users:
        user.delete()
        user.http.close()


def _end_all(http: httpx.Client) -> None:
    for session in http.get("/sessions").json()["sessions"]:
        http.delete(f"/sessions/{session['id']}")


@pytest.fixture
def owner(by_address) -> Iterator[httpx.Client]:
    """The REST API as the address 127.0.0.1, with none of its sessions left from another test."""
    http = httpx.Client(base_url=by_address.url, timeout=60)
    _end_all(http)
    yield http
    _end_all(http)
    http.close()


def _keyed(stack: Stack, key: str | None) -> Client:
    user = Client(stack.url)
    if key is not None:
        user.http.headers["X-API-Key"] = key
    return user


def _listed(http: httpx.Client, **headers: str) -> tuple[list[tuple[str, str]], int, int]:
    body = http.get("/sessions", headers=headers).json()
    return [(s["id"], s["state"]) for s in body["sessions"]], body["counted"], body["max_sessions"]


def _fail(user: Client) -> None:
    user.wait_for_state("ready")
    assert user.upload(NOT_A_VIDEO).status_code == 202
    assert user.wait_for_state("error")["error"]


def test_the_owner_lists_its_sessions_and_ends_one_without_its_token(by_address, owner):
    first, second = Client(by_address.url), Client(by_address.url)
    assert first.create(fps=2).status_code == 201
    assert second.create().status_code == 201
    body = owner.get("/sessions").json()
    assert [s["id"] for s in body["sessions"]] == [second.id, first.id]  # newest first
    assert (body["counted"], body["max_sessions"]) == (2, 2)
    listed = body["sessions"][1]
    assert (listed["model"], listed["fps"], listed["state"] in ("pending", "ready")) == ("tiny-random-llava", 2.0, True)
    assert abs(listed["created_at"] - time.time()) < 60
    assert "token" not in listed and "token_sha256" not in listed and "owner" not in listed

    refused = Client(by_address.url).create()
    assert refused.status_code == 429
    assert refused.json() == {
        "code": "too_many_sessions",
        "message": "this caller holds 2 sessions (MAX_SESSIONS_PER_KEY), failed ones left out; end one first: "
        "GET /sessions lists them and DELETE /sessions/{id} ends one, from the same address or with its token",
    }

    assert owner.delete(f"/sessions/{first.id}").status_code == 204  # no token
    assert first.get().status_code == 404
    assert _listed(owner) == ([(second.id, second.get().json()["state"])], 1, 2)
    assert Client(by_address.url).create().status_code == 201  # the ended session counts no more, at once
    assert owner.delete(f"/sessions/{first.id}").status_code == 404  # ended already


def test_a_failed_session_stops_counting_at_once_and_is_listed_until_its_owner_ends_it(by_address, owner):
    failing, live = Client(by_address.url), Client(by_address.url)
    assert failing.create().status_code == 201 and live.create().status_code == 201
    _fail(failing)
    third = Client(by_address.url)
    assert third.create().status_code == 201  # at once: no wait for the failed session to expire
    sessions, counted, _ = _listed(owner)
    assert [session_id for session_id, _ in sessions] == [third.id, live.id, failing.id]
    assert (sessions[2][1], counted) == ("error", 2)
    assert Client(by_address.url).create().status_code == 429  # two that have not failed

    assert owner.delete(f"/sessions/{failing.id}").status_code == 204
    assert [session_id for session_id, _ in _listed(owner)[0]] == [third.id, live.id]


def test_an_owner_lists_its_latest_failed_sessions_beside_its_live_ones_and_no_more(by_address, owner, redis_url):
    failed = []
    for _ in range(4):
        user = Client(by_address.url)
        assert user.create().status_code == 201  # failed sessions never count: four in a row under a limit of two
        _fail(user)
        failed.append(user)
    live = Client(by_address.url)
    assert live.create().status_code == 201
    # MAX_SESSIONS_PER_KEY (2) failed sessions are listed, the newest; the older ones still open by their token
    assert [session_id for session_id, _ in _listed(owner)[0]] == [live.id, failed[3].id, failed[2].id]
    assert failed[0].get().json()["state"] == "error"
    store = redis.Redis.from_url(redis_url)
    owned = f"{by_address.prefix}owner:addr:127.0.0.1"
    assert store.scard(owned) == 3 and 0 < store.ttl(owned) <= 6 * 3600
    store.close()
    for user in failed[:2]:
        user.delete()


def test_another_address_neither_sees_nor_ends_the_owner_s_sessions(by_address, owner):
    mine = Client(by_address.url)
    assert mine.create().status_code == 201
    elsewhere = httpx.Client(  # all of 127.0.0.0/8 is this machine: another address, another owner
        base_url=by_address.url, timeout=60, transport=httpx.HTTPTransport(local_address="127.0.0.2"),
    )
    assert elsewhere.get("/sessions").json()["sessions"] == []
    missing = elsewhere.delete(f"/sessions/{mine.id}")
    assert missing.status_code == 401 and missing.json() == {
        "code": "unauthorized",
        "message": "send the session token as 'Authorization: Bearer <token>', or call from the address that created it",
    }
    wrong = elsewhere.delete(f"/sessions/{mine.id}", headers={"Authorization": "Bearer not-the-token"})
    assert (wrong.status_code, wrong.json()["code"]) == (403, "forbidden")
    assert mine.get().status_code == 200  # untouched
    assert elsewhere.delete(f"/sessions/{mine.id}", headers=mine.auth).status_code == 204  # its token opens it anywhere
    elsewhere.close()


@pytest.mark.parametrize("path", ["/sessions/not-a-session-id", "/sessions/0123456789abcdef0123456789abcdef", "/sessions/%00"])
def test_ending_a_session_that_is_not_there_is_404(owner, path):
    reply = owner.delete(path)
    assert (reply.status_code, reply.json()["code"]) == (404, "session_not_found")


def test_an_api_key_ends_its_own_sessions_and_no_other_key_s(by_key):
    a, b = _keyed(by_key, KEY_A), _keyed(by_key, KEY_B)
    assert a.create().status_code == 201 and b.create().status_code == 201
    other = _keyed(by_key, KEY_A)
    assert other.create().status_code == 201
    refused = _keyed(by_key, KEY_A).create()
    assert (refused.status_code, refused.json()["message"]) == (429, (
        "this caller holds 2 sessions (MAX_SESSIONS_PER_KEY), failed ones left out; end one first: "
        "GET /sessions lists them and DELETE /sessions/{id} ends one, with the same X-API-Key or with its token"
    ))
    assert [s["id"] for s in b.http.get("/sessions").json()["sessions"]] == [b.id]

    anonymous = httpx.Client(base_url=by_key.url, timeout=60)  # the same address, no key: not an owner
    missing = anonymous.delete(f"/sessions/{a.id}")
    assert missing.status_code == 401 and missing.json()["message"] == (
        "send the session token as 'Authorization: Bearer <token>', or call as its owner: with the API key that created it"
    )
    assert b.http.delete(f"/sessions/{a.id}").status_code == 403  # key B, not A's
    assert anonymous.delete(f"/sessions/{a.id}", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 403
    assert a.get().status_code == 200  # untouched

    assert a.http.delete(f"/sessions/{a.id}").status_code == 204  # as X-API-Key
    assert anonymous.delete(f"/sessions/{other.id}", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 204
    assert a.http.get("/sessions").json()["sessions"] == []
    assert _keyed(by_key, KEY_A).create().status_code == 201
    anonymous.close()
    _end_all(a.http)
    b.delete()


def test_the_client_and_the_command_end_the_owner_s_sessions_without_tokens(by_key, by_address, owner):
    with PythonClient(by_key.url, api_key=KEY_A) as client:
        session = client.create_session()
        assert [s["id"] for s in client.sessions()] == [session.id]
        client.end_session(session.id)
        client.end_session(session.id)  # ending it again is no error
        assert client.sessions() == []

    async def ends() -> list[dict]:
        async with AsyncClient(by_key.url, api_key=KEY_B) as client:
            session = await client.create_session()
            await client.end_session(session.id)
            return await client.sessions()

    assert asyncio.run(ends()) == []

    user = Client(by_address.url)
    assert user.create().status_code == 201
    env = {name: value for name, value in os.environ.items() if not name.startswith("STREAMVQA_")}
    run = subprocess.run(
        [sys.executable, "-m", "streamvqa.cli", "--url", by_address.url, "delete", user.id],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert (run.returncode, run.stderr) == (0, "")
    assert user.get().status_code == 404


# -- without API keys, by default: the token is the only key ----------------------------------------


def test_without_api_keys_another_session_s_token_or_none_does_not_end_a_session(by_token, made):
    a, b = made(), made()  # from one address, as every user behind a reverse proxy is
    wrong = b.http.delete(f"/sessions/{a.id}", headers=b.auth)
    assert (wrong.status_code, wrong.json()) == (403, FORBIDDEN)
    bare = httpx.delete(f"{by_token.url}/sessions/{a.id}", timeout=60)
    assert (bare.status_code, bare.json()) == (401, UNAUTHORIZED)
    assert a.get().json()["state"] in ("pending", "ready")  # untouched
    assert httpx.delete(f"{by_token.url}/sessions/{a.id}", headers=a.auth, timeout=60).status_code == 204
    assert (a.get().status_code, b.get().status_code) == (404, 200)


def test_without_api_keys_an_address_lists_only_the_session_whose_token_it_sends(by_token, made):
    a, b = made(system_prompt="Only A may read this opening."), made()
    bare = httpx.get(f"{by_token.url}/sessions", timeout=60).json()
    assert bare == {"sessions": [], "counted": 2, "max_sessions": 2}  # its count, and nothing of the sessions
    listed = httpx.get(f"{by_token.url}/sessions", headers=b.auth, timeout=60).json()
    assert ([s["id"] for s in listed["sessions"]], listed["counted"]) == ([b.id], 2)
    guessed = httpx.get(f"{by_token.url}/sessions", headers={"Authorization": "Bearer " + "0" * 64}, timeout=60).json()
    assert guessed["sessions"] == []
    assert "Only A may read" not in json.dumps([bare, listed, guessed])
    assert httpx.get(f"{by_token.url}/sessions", headers=a.auth, timeout=60).json()["sessions"][0]["system_prompt"] == (
        "Only A may read this opening."
    )
    refused = Client(by_token.url).create()
    assert (refused.status_code, refused.json()) == (429, {
        "code": "too_many_sessions",
        "message": "this caller holds 2 sessions (MAX_SESSIONS_PER_KEY), failed ones left out; end one first: "
        "DELETE /sessions/{id} with its token ends one (sessions idle for 21600 s end by themselves)",
    })


def _pool(url: str, headers: dict[str, str], ready: Callable[[dict], bool]) -> dict:
    """The worker's memory in GET /models as `headers` see it, once `ready(memory)` (at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        [memory] = httpx.get(f"{url}/models", headers=headers, timeout=60).json()["models"][0]["memory"]
        if ready(memory) or time.monotonic() > deadline:
            return memory
        time.sleep(0.2)


def test_models_names_no_session_but_the_one_whose_token_is_sent(by_token, made):
    a, b = made(), made()
    for user in (a, b):
        user.wait_for_state("ready")
        memory = _pool(by_token.url, user.auth, lambda memory: user.id in memory["pool_session_pages"])
        assert list(memory["pool_session_pages"]) == [user.id] and list(memory["host_pool_session_pages"]) == [user.id]
    memory = _pool(by_token.url, {}, lambda memory: True)
    assert (memory["pool_session_pages"], memory["host_pool_session_pages"]) == ({}, {})
    assert memory["pool_free_pages"] < memory["pool_pages"]  # the pages are leased all the same


def test_without_api_keys_the_client_and_the_command_end_a_session_with_its_token_only(by_token, made):
    user = made()
    env = {name: value for name, value in os.environ.items() if not name.startswith("STREAMVQA_")}

    def streamvqa(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "streamvqa.cli", "--url", by_token.url, *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    listed = streamvqa("sessions")
    assert (listed.returncode, listed.stdout) == (0, "")
    assert listed.stderr == (
        "not listed: 1 more session of this address, counted toward its limit of 2; without API keys the gateway lists "
        "an address's sessions only where ADDRESS_OWNS_SESSIONS is set (end one with its token: delete ID --token T)\n"
    )
    with PythonClient(by_token.url) as client, pytest.raises(StreamvqaError) as refused:
        client.end_session(user.id)
    assert (refused.value.status, refused.value.code) == (401, "unauthorized")
    bare = streamvqa("delete", user.id)
    assert (bare.returncode, "(unauthorized)" in bare.stderr) == (1, True), bare.stderr
    assert user.get().status_code == 200
    ended = streamvqa("delete", user.id, "--token", user.token)
    assert (ended.returncode, ended.stderr) == (0, "")
    assert user.get().status_code == 404


# -- with ADDRESS_OWNS_SESSIONS -------------------------------------------------------------------


def test_a_token_names_its_own_session_even_where_the_address_owns_them(by_address, owner):
    a, b = Client(by_address.url), Client(by_address.url)
    assert a.create().status_code == 201 and b.create().status_code == 201
    wrong = owner.delete(f"/sessions/{a.id}", headers=b.auth)  # the owning address, with another session's token
    assert (wrong.status_code, wrong.json()) == (403, FORBIDDEN)
    assert a.get().status_code == 200
    assert owner.delete(f"/sessions/{a.id}").status_code == 204  # no token: as the owner

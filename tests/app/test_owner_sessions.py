"""A caller owns the sessions it creates (its API key, else its address): it lists them and ends
any of them without their tokens, failed and ended ones stop counting toward its limit at once,
and no other caller sees or ends them."""

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from streamvqa.client import AsyncClient
from streamvqa.client import Client as PythonClient
from tests.support import Client, Stack, running_stack

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"
NOT_A_VIDEO = b"not a video at all" * 100


@pytest.fixture(scope="module")
def by_address(redis_url, tmp_path_factory) -> Iterator[Stack]:
    """No API keys: a client's address owns its sessions; two sessions each."""
    with running_stack(redis_url, tmp_path_factory.mktemp("by-address"), MAX_SESSIONS_PER_KEY="2", MAX_SESSIONS="64") as stack:
        yield stack


@pytest.fixture(scope="module")
def by_key(redis_url, tmp_path_factory) -> Iterator[Stack]:
    with running_stack(
        redis_url, tmp_path_factory.mktemp("by-key"), API_KEYS=f"{KEY_A},{KEY_B}", MAX_SESSIONS_PER_KEY="2", MAX_SESSIONS="64",
    ) as stack:
        yield stack


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

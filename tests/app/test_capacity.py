"""Places on workers: never more sessions admitted than the workers may hold, and idle or failed
sessions give their place back, so that nobody is locked out for the sessions' lifetime."""

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import Client, Stack, delete_prefix, worker_memory_when

IDLE_RELEASE_S = 3


@pytest.fixture
def make_stack(redis_url: str, tmp_path):
    stacks = []

    def start(workers: int, each: dict[str, dict[str, str]] | None = None, **env: str | None) -> Stack:
        """`workers` workers, a and b, with `env` and each its own from `each` (by name)."""
        stack = Stack(redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", tmp_path / str(len(stacks)), **env)
        stack.directory.mkdir()
        stacks.append(stack)
        for name in "ab"[:workers]:
            stack.start(name, "worker", WORKER_ID=name, **(each or {}).get(name, {}))
        stack.start("gateway", "app")
        stack.wait_until_serving(workers=workers)
        return stack

    yield start
    for stack in stacks:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)


def _user(stack: Stack, api_key: str) -> Client:
    user = Client(stack.url)
    user.http.headers["X-API-Key"] = api_key
    return user


def test_concurrent_creates_get_the_places_there_are_and_idle_sessions_give_theirs_back(make_stack):
    # two workers of two places each; the per-key limit (8 by default) is above the four places
    stack = make_stack(2, MAX_SESSIONS="2", API_KEYS="key-one,key-two", MAX_SESSIONS_PER_KEY=None,
                       IDLE_RELEASE_S=str(IDLE_RELEASE_S))
    first = [_user(stack, "key-one") for _ in range(20)]
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda user: user.create(), first))
    assert sorted(reply.status_code for reply in replies) == [201] * 4 + [503] * 16
    assert {reply.json()["code"] for reply in replies if reply.status_code == 503} == {"no_capacity"}
    admitted = [user for user, reply in zip(first, replies, strict=True) if reply.status_code == 201]
    assert sorted(user.wait_for_state("ready", timeout_s=30)["worker"] for user in admitted) == ["a", "a", "b", "b"]
    admitted[0].show_frames()  # something to ask about once it comes back

    second = _user(stack, "key-two")
    refused = second.create()
    assert (refused.status_code, refused.json()["code"]) == (503, "no_capacity")
    full_at = time.monotonic()
    while second.create().status_code != 201:  # the idle sessions leave their workers
        assert time.monotonic() - full_at < IDLE_RELEASE_S + 10, "the idle sessions kept their places"
        time.sleep(0.2)
    assert second.wait_for_state("ready", timeout_s=30)["worker"] in ("a", "b")

    while (resting := admitted[0].get().json())["worker"]:
        assert time.monotonic() - full_at < IDLE_RELEASE_S + 10, "an idle session kept its place"
        time.sleep(0.2)
    assert resting["state"] == "ingested"  # kept, on no worker
    reply = admitted[0].ask("Are you back?", max_new_tokens=2)  # brings it back to a worker
    assert reply.status_code == 200 and reply.json()["tokens"] == 2
    assert admitted[0].get().json()["worker"] in ("a", "b")


def test_a_failed_session_gives_its_place_back_at_once(make_stack):
    stack = make_stack(1, MAX_SESSIONS="1", IDLE_RELEASE_S="0")  # idle sessions never leave
    failing = Client(stack.url)
    assert failing.create().status_code == 201
    failing.wait_for_state("ready")
    assert failing.upload(b"not a video at all" * 100).status_code == 202
    assert failing.wait_for_state("error")["error"]

    waiting = Client(stack.url)
    deadline = time.monotonic() + 10
    while (reply := waiting.create()).status_code != 201:
        assert reply.json()["code"] == "no_capacity" and time.monotonic() < deadline, reply.text
        time.sleep(0.2)
    assert waiting.wait_for_state("ready")["worker"] == "a"
    assert failing.get().json()["state"] == "error"  # still there to read, on no worker
    assert failing.ask("Anything?").status_code == 409


def _create_at_once(stack: Stack, count: int, **options: object) -> tuple[list[Client], list]:
    users = [Client(stack.url) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(lambda user: user.create(**options), users))
    return users, replies


@pytest.mark.parametrize(("env", "options", "memory"), [
    # tiny-random-llava: a 2,048-token budget (without recall) peaks at 2,048 + 2,048 + 1,024 tokens (budget, a
    # prompt, an answer), x 512 bytes x 1.5 (the rotated copy of the keys): 3,932,160 bytes; two
    # fit in 10 MB, a third does not
    ({"KV_MEMORY": "10MB"}, {"budget_tokens": 2048, "recall": False}, "cache"),  # 9.5 MiB
    # a 200,000-token host tier takes 200,000 x 280 bytes (keys and values in bfloat16): 56,000,000;
    # two fit in 125 MB, a third does not (their index, 4 MB each on the device, fits the cache memory)
    ({"HOST_MEMORY": "125MB"}, {"budget_tokens": 256, "recall": True, "host_budget_tokens": 200_000}, "host tier"),  # 119.2 MiB
])
def test_sessions_created_at_once_reserve_memory_and_those_that_fit_no_worker_get_503(make_stack, env, options, memory):
    stack = make_stack(1, MAX_SESSIONS="8", IDLE_RELEASE_S="0", **env)
    users, replies = _create_at_once(stack, 4, **options)
    assert sorted(reply.status_code for reply in replies) == [201, 201, 503, 503], [r.text for r in replies]
    refused = [reply.json() for reply in replies if reply.status_code == 503]
    assert {r["code"] for r in refused} == {"no_capacity"}
    # the peaks: budget, a prompt, an answer (5,120), and with recall what a question borrows (3,456)
    needs = "5120 tokens at its peak" if memory == "cache" else "3456 tokens at its peak and a 200000-token host tier"
    no_room = f"no worker serving 'tiny-random-llava' has room now for a cache of {needs}"
    offered = "9.5 MiB" if memory == "cache" else "119.2 MiB"  # the one worker's, not a sum over workers
    reserved = f"reserve the rest of the {memory} memory it offers ({offered}); idle ones give theirs back"
    for r in refused:  # refused by a worker's advertised room, or by the memory reserved at once
        assert r["message"] == no_room or (r["message"].startswith(no_room + ": ") and r["message"].endswith(reserved)), refused
    admitted = [user for user, reply in zip(users, replies, strict=True) if reply.status_code == 201]
    assert [user.wait_for_state("ready", timeout_s=30)["worker"] for user in admitted] == ["a", "a"]
    if memory == "cache":  # the worker's KV pool: 10 MB in whole pages of 64 tokens (49,152 bytes), 80 pages a session
        pool = worker_memory_when(stack, lambda pool: pool["pool_free_pages"] == 204 - 2 * 80, 10.0)
        assert (pool["pool_pages"], pool["pool_page_tokens"], pool["pool_bytes"]) == (204, 64, 204 * 49_152)
        assert pool["pool_free_pages"] == 44
    else:  # the worker's host pool: 125 MB in whole pages of 32 places (8,960 bytes), 6,250 pages a tier
        pool = worker_memory_when(stack, lambda pool: pool["host_pool_free_pages"] == 13_951 - 2 * 6_250, 10.0)
        assert (pool["host_pool_pages"], pool["host_pool_page_tokens"], pool["host_pool_bytes"]) == (13_951, 32, 13_951 * 8_960)
        assert pool["host_pool_free_pages"] == 1_451

    late = Client(stack.url)
    reply = late.create(**options)
    assert (reply.status_code, reply.json()["code"]) == (503, "no_capacity")
    admitted[0].delete()  # gives its memory back
    deadline = time.monotonic() + 10
    while (reply := late.create(**options)).status_code != 201:
        assert reply.json()["code"] == "no_capacity" and time.monotonic() < deadline, reply.text
        time.sleep(0.2)
    assert late.wait_for_state("ready", timeout_s=30)["worker"] == "a"
    if memory == "cache":  # the deleted session's pages went back, and the new one leased them
        pool = worker_memory_when(stack, lambda pool: pool["pool_free_pages"] == 44, 10.0)
        assert pool["pool_free_pages"] == 44
    else:
        pool = worker_memory_when(stack, lambda pool: pool["host_pool_free_pages"] == 1_451, 10.0)
        assert pool["host_pool_free_pages"] == 1_451


def test_a_burst_of_sessions_is_admitted_only_as_far_as_each_worker_holds_them(make_stack):
    # a 200,000-token host tier takes 200,000 x 280 bytes: 56,000,000. Worker a's host memory
    # holds one (100 MB), b's two (150 MB): together their 250 MB would hold four, but what is
    # left on each (44 and 38 MB) is no place for a fourth
    options = {"budget_tokens": 256, "recall": True, "host_budget_tokens": 200_000}
    stack = make_stack(2, {"a": {"HOST_MEMORY": "100MB"}, "b": {"HOST_MEMORY": "150MB"}}, MAX_SESSIONS="8",
                       IDLE_RELEASE_S="0")
    users, replies = _create_at_once(stack, 8, **options)
    assert sorted(reply.status_code for reply in replies) == [201] * 3 + [503] * 5, [r.text for r in replies]
    assert {reply.json()["code"] for reply in replies if reply.status_code == 503} == {"no_capacity"}
    admitted = [user for user, reply in zip(users, replies, strict=True) if reply.status_code == 201]
    assert sorted(user.wait_for_state("ready", timeout_s=30)["worker"] for user in admitted) == ["a", "b", "b"]

    late = Client(stack.url)  # still no worker with room for it, one after the other
    reply = late.create(**options)
    assert (reply.status_code, reply.json()["code"]) == (503, "no_capacity")
    admitted[0].delete()
    deadline = time.monotonic() + 10
    while (reply := late.create(**options)).status_code != 201:
        assert reply.json()["code"] == "no_capacity" and time.monotonic() < deadline, reply.text
        time.sleep(0.2)
    assert late.wait_for_state("ready", timeout_s=30)["worker"] in ("a", "b")



def test_a_refusal_for_memory_names_what_each_worker_offers_not_their_sum():
    """A session's memory is reserved on one worker: the 503 says what each offers."""
    from app.routes import _no_place
    from app.sessions import Room

    room = Room(places=8, device_bytes=1, host_bytes=1, device_limits=(2**29, 2**29), host_limits=(2**30, 2**28))
    assert _no_place("device", "m", room, "no room").endswith(
        "reserve the rest of the cache memory it offers (512.0 MiB on each of 2 workers); idle ones give theirs back"
    )
    assert _no_place("host", "m", room, "no room").endswith(
        "reserve the rest of the host tier memory it offers (1,024.0, 256.0 MiB); idle ones give theirs back"
    )

"""A worker's memory for its sessions: sized from KV_MEMORY and HOST_MEMORY (a share or bytes),
never above what is free, read again as sessions come and go, and said in GET /models."""

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine import load_model
from streamvqa.protocol import SessionRecord
from tests.support import Client, Stack, delete_prefix, running_stack, worker_memory_when
from worker.capacity import Capacity, Reading
from worker.settings import MemorySize, WorkerSettings

GIB, MIB = 2**30, 2**20


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random-llava", "cpu", None)  # 512 bytes per cached token


class Memory:
    """The machine's memory as a worker reads it (a CPU worker: its caches and host tiers in RAM)."""

    def __init__(self, total_bytes: int, free_bytes: int, held_bytes: int) -> None:
        self.reading = Reading(total_bytes, free_bytes, held_bytes)

    def __call__(self, device) -> Reading:
        return self.reading


@pytest.mark.parametrize(("text", "share", "size"), [
    ("auto", None, None), ("0", None, None), ("0.5", 0.5, None), ("50%", 0.5, None), ("1", 1.0, None),
    ("6000000", None, 6_000_000), ("8GiB", None, 8 * GIB), ("512MiB", None, 512 * MIB), ("2GB", None, 2_000_000_000),
])
def test_a_memory_setting_is_a_share_or_bytes(text, share, size):
    assert (MemorySize.parse(text).share, MemorySize.parse(text).bytes) == (share, size)


@pytest.mark.parametrize("text", ["-1", "lots", "8XB", "0.0", "", "150%", "2", "1.5", "64kB"])
def test_a_memory_setting_that_is_neither_is_refused_at_start_up(text):
    with pytest.raises(ValueError, match="kv_memory"):
        WorkerSettings(kv_memory=text)


def test_a_worker_started_beside_others_grows_its_caches_memory_once_they_leave_and_warns_meanwhile(tiny, caplog):
    caplog.set_level(logging.INFO, logger="worker.capacity")
    memory = Memory(16 * GIB, 10 * MIB, 1 * GIB)  # others hold nearly all of it
    capacity = Capacity(WorkerSettings(kv_memory="0.5", host_memory="1GiB"), tiny, read=memory)
    assert capacity.kv_memory_bytes == 9 * MIB  # 90% of what is free, not the 8 GiB stated
    # a session with the default options: (8,192 + 4,096 borrowed + 2,048 + 1,024) tokens x 512
    # bytes x 1.5 = 11,796,480 bytes, and its 65,536-token host tier's index, 1,310,720: 13,107,200
    assert capacity.default_sessions == 0
    assert capacity.warning.startswith("room for 0 session(s) with the default options in 9 MiB for caches")
    assert "holds 0 session(s) with the default options" in caplog.text
    assert "less than the 8,192 MiB stated (0.5 of 16,384 MiB)" in caplog.text

    memory.reading = Reading(16 * GIB, 12 * GIB, 1 * GIB)  # the others left
    capacity.refresh([])
    assert (capacity.kv_memory_bytes, capacity.default_sessions, capacity.warning) == (8 * GIB, 655, None)
    assert "memory for the sessions' caches: 8,192 MiB, as stated (0.5 of 16,384 MiB)" in caplog.text

    # its own sessions take 3 GiB of the RAM (caches and host tiers share it on a CPU): their
    # memory is still theirs, and one reserving 512 MiB of host tier leaves the caches that less
    held = [SessionRecord(id="a", model="tiny", policy="infmllm", budget_tokens=256, fps=1, recall=True,
                          host_budget_tokens=1_917_397)]  # x 280 bytes: 536,871,160, 512 MiB
    memory.reading = Reading(16 * GIB, 4 * GIB, 4 * GIB)
    capacity.refresh(held)
    assert capacity.kv_memory_bytes == 6_549_824_878  # 3 GiB + 90% of 4 GiB - 536,871,160
    assert capacity.host_memory_bytes == 1 * GIB

    memory.reading = Reading(16 * GIB, 100 * MIB, 1 * GIB)  # others come back: it never takes what they use
    capacity.refresh([])
    assert capacity.kv_memory_bytes == 90 * MIB and capacity.default_sessions == 7


def test_models_says_what_each_worker_offers_and_warns_when_its_caches_hold_under_two_sessions(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, KV_MEMORY="4MiB", HOST_MEMORY="64MiB") as stack:
        (model,) = httpx.get(f"{stack.url}/models").json()["models"]
        (memory,) = model["memory"]
        assert {k: memory[k] for k in ("kv_memory", "kv_memory_bytes", "kv_free_bytes", "host_memory", "host_memory_bytes")} == {
            "kv_memory": "4MiB", "kv_memory_bytes": 4 * MIB, "kv_free_bytes": 4 * MIB,
            "host_memory": "64MiB", "host_memory_bytes": 64 * MIB,
        }
        assert memory["device_free_bytes"] > 0 and memory["ram_free_bytes"] > 0
        assert memory["default_sessions"] == 0  # 13,107,200 bytes each
        assert memory["warning"].startswith("room for 0 session(s) with the default options in 4 MiB for caches")
        log = stack.log("worker")
        assert "memory for the sessions' caches: 4 MiB, as stated (4MiB)" in log
        assert "holds 0 session(s) with the default options (12 MiB each): set KV_MEMORY" in log



def test_a_worker_that_started_short_of_memory_takes_every_session_admitted_once_memory_is_free(redis_url, tmp_path):
    # the memory the worker sees (tests/worker/scripted_memory.py): others hold all but 10 MiB as it starts
    seen = tmp_path / "memory"
    seen.write_text(f"{16 * GIB} {10 * MIB} {GIB}")
    stack = Stack(redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", tmp_path, KV_MEMORY="100MB", HOST_MEMORY="64MiB",
                  MAX_SESSIONS="8", IDLE_RELEASE_S="0", LEASE_TTL_S="3", SCRIPTED_MEMORY=str(seen))
    stack.start("worker", "tests.worker.scripted_memory", WORKER_ID="a")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        memory = worker_memory_when(stack, lambda memory: memory["kv_memory_bytes"] == 9 * MIB, 15.0)
        assert memory["kv_memory_bytes"] == 9 * MIB  # 90% of the 10 MiB free
        assert memory["pool_bytes"] >= memory["kv_memory_bytes"]

        seen.write_text(f"{16 * GIB} {GIB} {GIB}")  # the others left
        memory = worker_memory_when(stack, lambda memory: memory["kv_memory_bytes"] == 100_000_000, 15.0)
        assert memory["kv_memory_bytes"] == 100_000_000  # as stated

        # tiny-random-llava: a 2,048-token budget peaks at 5,120 tokens, 80 pages of 64 (3,932,160 bytes):
        # four fit in 100 MB, and all four admitted are taken, not left pending
        users = [Client(stack.url) for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda user: user.create(budget_tokens=2048, recall=False), users))
        assert [reply.status_code for reply in replies] == [201] * 4, [reply.text for reply in replies]
        assert [user.wait_for_state("ready", timeout_s=30)["worker"] for user in users] == ["a"] * 4
        memory = worker_memory_when(stack, lambda memory: memory["pool_free_pages"] < memory["pool_pages"] - 240, 15.0)
        assert (memory["pool_pages"], memory["pool_free_pages"]) == (2_035, 2_035 - 4 * 80)  # 100 MB in whole pages
        assert memory["pool_bytes"] >= memory["kv_memory_bytes"]  # what it offers, its pool holds
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)

"""bench.chaos ends by itself: a live stream whose session failed is counted as failed, and its
client stops, instead of connecting again for ever (the run then never printed its summary). Its
summary prints every counter, 0 or not; a short run with faults prints the targets (0 lost, 0
twice, 0 stuck, every refused chat image a 400, every watch's firing that must come sent once)."""

import argparse
import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from bench.chaos import COUNTERS, Api, Tally, _chatter, _judge, _streamer, summary
from tests.support import running_stack

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    with running_stack(redis_url, tmp_path_factory.mktemp("chaos")) as stack:
        yield stack


def test_a_stream_whose_session_is_gone_ends_and_is_counted_as_failed(stack):
    async def run() -> tuple[Tally, str, int]:
        tally, stop = Tally(), asyncio.Event()  # the run is not over: only the failure may end the stream
        async with httpx.AsyncClient(timeout=30) as http:
            api = Api(http, [stack.url], random.Random(0))
            streaming = asyncio.create_task(_streamer(api, tally, stop, random.Random(0)))
            while not tally.streams:
                await asyncio.sleep(0.1)
            ((sid, token),) = tally.streams.items()
            while len(tally.sent[sid]) < 4:
                await asyncio.sleep(0.1)
            reply = await http.delete(f"{stack.url}/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})
            await asyncio.wait_for(streaming, 60)
            return tally, sid, reply.status_code

    tally, sid, deleted = asyncio.run(run())
    assert deleted == 204
    assert tally.failed == {sid: "http_404"}


def test_the_summary_prints_every_counter_when_none_counted():
    args = argparse.Namespace(seconds=1.0, fsync="always", lease_ttl_s=5.0)
    printed = summary(args, Tally(), None, 1.0, "logs")
    zero = ["asked", "answered", "reset", "lost", "answered_twice", "unjudged", "frames_sent", "frames_ingested",
            "frames_duplicated", "frames_lost", "frames_dropped", "uploads_wrong_frames", "stuck", "failed_sessions",
            "not_recovered", "watches", "firings", "firings_due", "firings_lost", "firings_twice", "firings_unrecorded",
            "watches_unjudged", *COUNTERS]
    assert {name: printed.get(name) for name in zero} == dict.fromkeys(zero, 0)
    assert "chat_refused_right" in COUNTERS and "chat_refused_wrong" in COUNTERS


def test_a_chat_user_hears_each_refused_image_refused_at_once_and_has_the_others_answered(stack):
    async def run() -> Tally:
        tally, stop = Tally(), asyncio.Event()
        async with httpx.AsyncClient(timeout=30) as http:
            chatting = asyncio.create_task(_chatter(Api(http, [stack.url], random.Random(0)), tally, stop, random.Random(3)))
            await asyncio.sleep(20)
            stop.set()
            await asyncio.wait_for(chatting, 60)
        store = aioredis.Redis.from_url(stack.redis_url)
        for sid in tally.chats:
            await _judge(store, stack.prefix, sid, tally)
        await store.aclose()
        return tally

    tally = asyncio.run(run())
    counts = {name: tally.counts[name] for name in ("chat_answered", "chat_failed", "chat_refused_right", "chat_refused_wrong")}
    assert counts["chat_refused_right"] >= 1 and counts["chat_answered"] >= 1, counts
    assert (counts["chat_failed"], counts["chat_refused_wrong"], tally.chat_wrong) == (0, 0, [])
    assert max(tally.chat_refused_s) < 10  # not ASK_TIMEOUT_S (300 s) and a 504
    assert set(tally.judged.values()) == {"answered"} and len(tally.judged) == counts["chat_answered"]


def test_a_short_run_with_faults_prints_its_counters_on_target():
    options = ["--seconds", "15", "--grace-s", "150", "--streamers", "1", "--uploaders", "1", "--fault-every", "6",
               "--faults", "worker,gateway", "--seed", "3"]  # seed 3: its chat user's 1st and 4th images are refused ones
    run = subprocess.run([sys.executable, "-m", "bench.chaos", *options], cwd=ROOT, capture_output=True, text=True, timeout=400)
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    assert printed["error"] is None, run.stdout[-3000:]
    assert sum(printed["faults"].values()) >= 1 and printed["not_recovered"] == 0, printed
    targets = ("lost", "answered_twice", "stuck", "unjudged", "frames_lost", "frames_duplicated", "uploads_wrong_frames",
               "failed_sessions", "chat_failed", "chat_refused_wrong", "clients_cut", "client_errors",
               "firings_lost", "firings_twice", "firings_unrecorded", "watches_unjudged")
    assert {name: printed[name] for name in targets} == dict.fromkeys(targets, 0), printed
    assert printed["answered"] >= 10 and printed["chat_answered"] >= 1 and printed["chat_refused_right"] >= 1, printed
    assert printed["firings_due"] >= 2 and printed["firings"] >= printed["firings_due"], printed  # the stream's and an upload's

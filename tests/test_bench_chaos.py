"""bench.chaos ends by itself: a live stream whose session failed is counted as failed, and its
client stops, instead of connecting again for ever (the run then never printed its summary)."""

import asyncio
import random

import httpx
import pytest

from bench.chaos import Api, Tally, _streamer
from tests.support import running_stack


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

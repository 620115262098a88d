"""The gateway's memory for media in `/v1/chat/completions` messages, measured on a real gateway
(its kernel high-water mark, VmHWM): bounded by MAX_CHAT_MEDIA_REQUESTS, whatever arrives at once."""

import asyncio
from pathlib import Path

import httpx
import pytest

from bench.chat_media import body, padded_video
from bench.common import status_bytes
from tests.support import running_stack, sample_video

MIB = 2**20
VIDEO_MIB = 16


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    with running_stack(redis_url, tmp_path_factory.mktemp("stack"), MAX_CHAT_MEDIA_REQUESTS="2") as stack:
        yield stack


def test_six_data_url_videos_at_once_cost_the_gateway_what_two_do(stack):
    """Each request holds its body and its decoded video until the video is sent on, about 2.7
    times the video at its peak (its text and the parsed JSON at once); two at a time hold memory,
    the others wait for their turn before reading their bodies. Before the bound, each held about
    4.5 times its video until its answer, all of them at once."""
    clip = sample_video("carphone_pristine.mp4").read_bytes()
    bodies = [body(padded_video(clip, VIDEO_MIB * MIB, fill)) for fill in range(1, 7)]
    warm = httpx.post(f"{stack.url}/v1/chat/completions", json=body(clip), timeout=120)
    assert warm.status_code == 200, warm.text
    pid = stack.processes["gateway"].pid
    before = status_bytes(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the high-water mark starts again from now

    async def at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=one) for one in bodies))

    replies = asyncio.run(at_once())
    assert [reply.status_code for reply in replies] == [200] * 6, [reply.text[:200] for reply in replies]
    assert len({reply.json()["session_id"] for reply in replies}) == 6
    peak_over_mib = (status_bytes(pid, "VmHWM") - before) / MIB
    # two requests' peaks (2 x 2.7 x 16 MiB = 86 MiB) and some slack: 81 MiB here; unbounded, 432
    assert peak_over_mib < 2 * 3 * VIDEO_MIB + 32, peak_over_mib

